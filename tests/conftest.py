"""Fixtures every test directory may use: a real redis-server on a temporary unix
socket (installed by `make test`), shared per session or private to one test."""

import os
import shutil
import subprocess
import tempfile
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

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
