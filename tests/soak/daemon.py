"""DaemonProcess: a radixkv daemon in a subprocess on a temporary unix socket.

Unlike the service tests' fixture it can be SIGKILLed and started again on the same
socket (as a supervisor would restart it), and reports its resident memory.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from radixkv.client import Client
from radixkv.errors import Unavailable

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
DEFAULT_FLAGS = ("--metrics-port", "0", "--host-pool-size", "64MiB", "--log-level", "info")


class DaemonProcess:
    def __init__(self, *flags: str, env: dict | None = None, listen: str | None = None,
                 probe: dict | None = None):
        # mkdtemp under /tmp, not tmp_path: a unix socket path must stay under 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="rkv-f-")
        self.socket = os.path.join(self.dir, "radixkv.sock")
        self.target = listen or f"unix://{self.socket}"
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.flags = DEFAULT_FLAGS + flags
        self.env = env
        self.probe = probe or {}  # Client arguments the readiness probe needs (tls=...)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, ready: bool = True) -> str:
        """Start (again); with `ready`, wait until its health service is SERVING."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "radixkv_server", "--listen", self.target, *self.flags],
                stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.starts += 1
        if ready:
            self.wait_ready()
        return self.target

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        with Client(self.target, timeout=5, reconnect=None, **self.probe) as probe:
            try:
                probe.wait_ready(timeout)
            except Unavailable:
                self.kill()
                raise RuntimeError(f"daemon did not become ready in {timeout}s:\n{self.log()}") from None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self, tail: int = 8000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-tail:] if tail else f.read()

    def rss_bytes(self) -> int:
        """Resident memory of the running daemon (0 when not running)."""
        return rss_of(self.proc.pid) if self.alive else 0

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
        """SIGKILL: no shutdown at all, as a crash or the OOM killer would."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def restart(self, ready: bool = True) -> None:
        self.kill()
        self.start(ready)

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def rss_of(pid: int) -> int:
    """Resident memory of a process, bytes (0 when gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def poll(condition, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Call `condition` until it returns something truthy (returned); bounded."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {value!r})")
        time.sleep(interval)
