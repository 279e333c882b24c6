"""Real stores for the storage tests: the redis-server of tests/conftest.py, page
directories under pytest's tmp_path, a Redis Cluster (3 masters, 3 replicas) and a
Mooncake Store (a `mooncake_master` and a lender process holding the segment) on
localhost (tests/storage/fleet.py). Nothing is mocked."""

import os
import uuid

import pytest
import redis

from radixkv_server.storage import open_storage
from radixkv_server.storage.record import NAME_TAG, VERSION, record_name
from tests.storage.fleet import Lender, MooncakeMaster, RedisCluster

MOONCAKE_SEGMENT = 256 << 20  # what the fixture's lender process lends to the store


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

    def name(self, backend, key: bytes, version: int = VERSION):
        """Where `backend` files `key`'s record (a path, a Redis key, a Mooncake key); with
        version=1, where the version-1 format filed it (the key's hex, no format tag)."""
        if self.kind == "file":
            path = backend.path_for(key)
            return path if version == VERSION else path.replace(f".{NAME_TAG}.page", ".page")
        tail = record_name(key) if version == VERSION else key.hex()
        if self.kind == "mooncake":
            return backend.prefix + tail
        return backend.key_prefix + tail.encode()

    def write_raw(self, backend, key: bytes, blob: bytes, version: int = VERSION) -> None:
        """Overwrite the stored record of `key` behind the backend's back (with version=1,
        the record under the version-1 name)."""
        name = self.name(backend, key, version)
        if self.kind == "file":
            os.makedirs(os.path.dirname(name), exist_ok=True)
            with open(name, "wb") as f:
                f.write(blob)
        elif self.kind == "mooncake":
            assert backend._client().upsert(name, blob) == 0
        elif self.kind == "redis_cluster":
            with self._cluster_client() as client:
                client.set(name, blob)
        else:
            client = self._redis_server.client()
            client.set(name, blob)
            client.close()

    def read_raw(self, backend, key: bytes, version: int = VERSION) -> bytes | None:
        name = self.name(backend, key, version)
        if self.kind == "file":
            try:
                with open(name, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        if self.kind == "mooncake":
            return backend._client().get(name) or None
        if self.kind == "redis_cluster":
            with self._cluster_client() as client:
                return client.get(name)
        client = self._redis_server.client()
        try:
            return client.get(name)
        finally:
            client.close()

    def _cluster_client(self):
        return redis.RedisCluster.from_url(self.url.split("?")[0].replace("redis+cluster://", "redis://").split(",")[0])

    def close_all(self) -> None:
        for backend in self._opened:
            backend.close()


@pytest.fixture(scope="session")
def mooncake_store():
    """A Mooncake Store for the session: a master, and a lender process that lends
    MOONCAKE_SEGMENT bytes (so backends opened by tests lend none and may close freely)."""
    master = MooncakeMaster().start()
    lender = Lender(master.address, MOONCAKE_SEGMENT, 0, 0, 0)
    yield master
    lender.stop()
    master.cleanup()


@pytest.fixture(scope="session")
def redis_cluster():
    """A Redis Cluster (3 masters, 3 replicas) shared by the session's tests."""
    cluster = RedisCluster().start()
    yield cluster
    cluster.cleanup()


@pytest.fixture(params=["file", "redis", "redis_cluster", "mooncake", "mooncake_direct"])
def store(request, tmp_path):
    """Each backend kind in turn, on a fresh store (or a fresh key prefix of a shared one)."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    if request.param == "file":
        store = Store("file", f"file://{tmp_path}/pages", None)
    elif request.param.startswith("mooncake"):  # fetch=staged (default) or direct (in place)
        master = request.getfixturevalue("mooncake_store")
        fetch = "direct" if request.param == "mooncake_direct" else "staged"
        store = Store("mooncake", f"mooncake://{master.address}?segment=0&prefix={prefix}&fetch={fetch}", None)
    elif request.param == "redis_cluster":
        cluster = request.getfixturevalue("redis_cluster")
        store = Store("redis_cluster", f"{cluster.url}?prefix={prefix}", None)
    else:
        url = request.getfixturevalue("redis_url")
        server = request.getfixturevalue("redis_server")
        store = Store("redis", f"{url}?prefix=test-{uuid.uuid4().hex[:8]}:", server)
    yield store
    store.close_all()
