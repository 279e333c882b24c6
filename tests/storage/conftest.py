"""Real stores for the storage tests: the redis-server of tests/conftest.py, and page
directories under pytest's tmp_path. Nothing is mocked."""

import uuid

import pytest

from radixkv_server.storage import open_storage


class Store:
    """One store (a directory, or a key prefix in Redis) that tests open backends on."""

    def __init__(self, kind: str, url: str, redis_server):
        self.kind = kind
        self.url = url
        self._redis_server = redis_server
        self._opened = []

    def open(self):
        backend = open_storage(self.url)
        self._opened.append(backend)
        return backend

    def write_raw(self, backend, key: bytes, blob: bytes) -> None:
        """Overwrite the stored record of `key` behind the backend's back."""
        if self.kind == "file":
            with open(backend.path_for(key), "wb") as f:
                f.write(blob)
        else:
            client = self._redis_server.client()
            client.set(backend.redis_key(key), blob)
            client.close()

    def read_raw(self, backend, key: bytes) -> bytes | None:
        if self.kind == "file":
            try:
                with open(backend.path_for(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        client = self._redis_server.client()
        try:
            return client.get(backend.redis_key(key))
        finally:
            client.close()

    def close_all(self) -> None:
        for backend in self._opened:
            backend.close()


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    """Each backend kind in turn, on a fresh store."""
    if request.param == "file":
        store = Store("file", f"file://{tmp_path}/pages", None)
    else:
        url = request.getfixturevalue("redis_url")
        server = request.getfixturevalue("redis_server")
        store = Store("redis", f"{url}?prefix=test-{uuid.uuid4().hex[:8]}:", server)
    yield store
    store.close_all()
