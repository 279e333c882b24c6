"""A real radixkv daemon for the service tests: a subprocess on a temporary unix socket.

`daemon` yields the target of a fresh daemon ("unix:///tmp/rkv-.../radixkv.sock") and,
at teardown, stops it with SIGTERM and requires a clean exit (code 0). `daemon_factory`
starts more (or differently configured) daemons the same way.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from radixkv.client import Client
from radixkv.errors import Unavailable

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
# Small host pools by default: a test that needs more passes host_pool_pages or flags.
DEFAULT_FLAGS = ("--metrics-port", "0", "--host-pool-size", "64MiB", "--log-level", "info")


class DaemonProcess:
    def __init__(self, *flags: str):
        # mkdtemp under /tmp, not tmp_path: a unix socket path must stay under 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="rkv-d-")
        self.socket = os.path.join(self.dir, "radixkv.sock")
        self.target = f"unix://{self.socket}"
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.flags = DEFAULT_FLAGS + flags
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "radixkv_server", "--listen", self.target, *self.flags],
                stdout=log, stderr=subprocess.STDOUT)
        with Client(self.target, timeout=5) as probe:
            try:
                probe.wait_ready(START_TIMEOUT_S)
            except Unavailable:
                self.kill()
                pytest.fail(f"daemon did not become ready in {START_TIMEOUT_S}s:\n{self.log()}", pytrace=False)
        return self.target

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-8000:]

    def stop(self) -> int:
        """SIGTERM and wait; the exit code (killed after STOP_TIMEOUT_S: -9)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def daemon_factory():
    """start(*flags) -> DaemonProcess, started and ready. Every daemon still running at
    teardown must stop cleanly on SIGTERM."""
    started: list[DaemonProcess] = []

    def start(*flags: str) -> DaemonProcess:
        d = DaemonProcess(*flags)
        started.append(d)
        d.start()
        return d

    yield start
    failures = []
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            code = d.stop()
            if code != 0:
                failures.append(f"daemon exited with {code} on SIGTERM:\n{d.log()}")
        d.cleanup()
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


@pytest.fixture
def daemon(daemon_factory) -> str:
    """The target of a fresh daemon, stopped with SIGTERM (exit code 0) afterwards."""
    return daemon_factory().target
