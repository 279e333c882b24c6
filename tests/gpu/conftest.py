"""GPU tests: skipped on machines without CUDA (every test in this directory).

Fixtures: `device` (the CUDA ordinal the engines use: $RADIXKV_TEST_DEVICE, else the
last visible GPU, so that a daemon context on GPU 0 would show on a multi-GPU machine)
and `gpu_daemon` (start(*flags) -> GpuDaemon: a real daemon subprocess on a temporary
unix socket (tests/support/daemon.py), stopped with SIGTERM at teardown, which must
exit 0 and log no traceback). Each daemon's log is appended to $RADIXKV_GPU_DAEMON_LOGS
when set (scripts/gpu-check.sh brings it back).

Every test is bounded: past $RADIXKV_GPU_TEST_TIMEOUT seconds (default 120; 0: none)
every thread's stack is printed and the run ends (`faulthandler`, no plugin needed: a
hung CUDA call cannot be interrupted from Python anyway). gpu-check.sh then kills what
the run left (daemons, engine processes: its process group).
"""

import faulthandler
import os

import pytest
import torch

from tests.support.daemon import DaemonProcess, stop_all

START_TIMEOUT_S = 60.0  # torch with CUDA imports slowly on a cold machine
TEST_TIMEOUT_S = float(os.environ.get("RADIXKV_GPU_TEST_TIMEOUT", "120"))


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")


@pytest.fixture(autouse=True)
def _bounded(_needs_cuda):
    if TEST_TIMEOUT_S > 0:
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def device() -> int:
    return int(os.environ.get("RADIXKV_TEST_DEVICE", torch.cuda.device_count() - 1))


class GpuDaemon(DaemonProcess):
    """A DaemonProcess of the test `test` whose log outlives it in $RADIXKV_GPU_DAEMON_LOGS."""

    def __init__(self, *flags: str, test: str):
        super().__init__(*flags, start_timeout=START_TIMEOUT_S)
        self.test = test

    def cleanup(self) -> None:
        self._sigkill()
        keep = os.environ.get("RADIXKV_GPU_DAEMON_LOGS")
        if keep and os.path.exists(self.log_path):
            with open(keep, "a") as f:
                f.write(f"===== daemon of {self.test} (pid {self.proc.pid if self.proc else '-'})\n{self.log()}\n")
        super().cleanup()


@pytest.fixture
def gpu_daemon(request):
    started: list[GpuDaemon] = []

    def start(*flags: str) -> GpuDaemon:
        started.append(GpuDaemon(*flags, test=request.node.nodeid))
        return started[-1].start()

    yield start
    stop_all(started)
