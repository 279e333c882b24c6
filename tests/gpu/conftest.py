"""GPU tests: skipped on machines without CUDA (every test in this directory).

Fixtures: `device` (the CUDA ordinal the engines use: $RADIXKV_TEST_DEVICE, else the
last visible GPU, so that a daemon context on GPU 0 would show on a multi-GPU machine)
and `gpu_daemon` (start(*flags) -> GpuDaemon: a real daemon subprocess on a temporary
unix socket, stopped with SIGTERM at teardown, which must exit 0). Each daemon's log is
appended to $RADIXKV_GPU_DAEMON_LOGS when set (scripts/gpu-check.sh brings it back).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from radixkv.client import Client
from radixkv.errors import Unavailable

START_TIMEOUT_S = 60.0  # torch with CUDA imports slowly on a cold machine
STOP_TIMEOUT_S = 30.0
FLAGS = ("--metrics-port", "0", "--host-pool-size", "64MiB", "--log-level", "info")


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")


@pytest.fixture
def device() -> int:
    return int(os.environ.get("RADIXKV_TEST_DEVICE", torch.cuda.device_count() - 1))


class GpuDaemon:
    """One `python -m radixkv_server` on a private socket; `pid`, `log()`, `stop()`."""

    def __init__(self, *flags: str):
        self.dir = tempfile.mkdtemp(prefix="rkv-g-")  # short: unix socket paths stay < 108 bytes
        self.target = f"unix://{os.path.join(self.dir, 'radixkv.sock')}"
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.proc: subprocess.Popen | None = None
        self.flags = FLAGS + flags

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "GpuDaemon":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "radixkv_server", "--listen", self.target, *self.flags],
                                         stdout=log, stderr=subprocess.STDOUT)
        with Client(self.target, timeout=5) as probe:
            try:
                probe.wait_ready(START_TIMEOUT_S)
            except Unavailable:
                self.kill()
                pytest.fail(f"daemon not ready in {START_TIMEOUT_S}s:\n{self.log()}", pytrace=False)
        return self

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> int:
        """SIGTERM and wait: the exit code (-9 when it had to be killed)."""
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

    def cleanup(self, test: str) -> None:
        self.kill()
        keep = os.environ.get("RADIXKV_GPU_DAEMON_LOGS")
        if keep and os.path.exists(self.log_path):
            with open(keep, "a") as f:
                f.write(f"===== daemon of {test} (pid {self.proc.pid if self.proc else '-'})\n{self.log()}\n")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def gpu_daemon(request):
    started: list[GpuDaemon] = []

    def start(*flags: str) -> GpuDaemon:
        started.append(GpuDaemon(*flags))
        return started[-1].start()

    yield start
    failures = []
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            code = d.stop()
            if code != 0:
                failures.append(f"daemon exited with {code} on SIGTERM:\n{d.log()[-8000:]}")
        d.cleanup(request.node.nodeid)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
