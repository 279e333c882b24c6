"""Real stores for the storage tests: redis-server on a temporary unix socket, and
page directories under pytest's tmp_path. Nothing is mocked."""

import os
import shutil
import subprocess
import tempfile
import time
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from radixkv_server.storage import open_storage

START_TIMEOUT_S = 15.0


class RedisServer:
    """A private redis-server listening only on a unix socket; stop() and start() again
    reuse the same socket path, as a restarted server would."""

    def __init__(self):
        # mkdtemp under /tmp, not tmp_path: a unix socket path must stay under 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="rkv-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.url = f"unix://{self.socket}"
        self.log = os.path.join(self.dir, "redis.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed; `make test` installs it "
                        "(scripts/ensure-system-deps.sh)", pytrace=False)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [exe, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
                 "--save", "", "--appendonly", "no", "--dir", self.dir],
                stdout=log, stderr=subprocess.STDOUT)
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        client = self.client()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                if self.proc.poll() is not None:
                    pytest.fail(f"redis-server exited with {self.proc.returncode}:\n{self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, OSError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server did not answer PING within {START_TIMEOUT_S}s:\n"
                                f"{self._log_tail()}")
                time.sleep(0.02)
        finally:
            client.close()

    def client(self) -> redis.Redis:
        """A plain client for checks and for damaging stored values; no retries."""
        return redis.Redis(unix_socket_path=self.socket, socket_timeout=2,
                           retry=Retry(NoBackoff(), 0))

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _log_tail(self) -> str:
        with open(self.log, "rb") as f:
            return f.read()[-2000:].decode(errors="replace")


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server shared by the session's tests (each test flushes it first)."""
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the shared redis-server, emptied for this test."""
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def private_redis():
    """A redis-server of this test alone, which the test may stop and restart."""
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


class Store:
    """One store (a directory, or a key prefix in Redis) that tests open backends on."""

    def __init__(self, kind: str, url: str, redis_server: RedisServer | None):
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
