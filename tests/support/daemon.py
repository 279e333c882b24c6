"""A real radixkv daemon for tests, and the bounded waits that go with it.

`DaemonProcess(*flags)` runs `python -m radixkv_server --listen unix://<tmp>/radixkv.sock`
with DEFAULT_FLAGS before `flags` (a later flag wins): /metrics off unless
`metrics=True` picks a free port, a 64 MiB host pool, info logs. `start()` waits
(bounded) until the gRPC health service reports the daemon ready, and fails showing the
log's tail when the daemon exits first or is not ready in time. `stop()` is SIGTERM and
the exit code, `kill()` SIGKILL; `start()` again reuses the socket, as a supervisor's
restart would. `stop_all` is the teardown the fixtures share: exit code 0 and no
traceback in the log.

Users: the fixtures of tests/service, tests/ops and tests/gpu, tests that manage a
daemon themselves, and the soak run (`python -m tests.soak`), which runs outside pytest.
Nothing here sleeps to synchronise: every wait polls a condition against a deadline.
Failures go through `fail`: pytest.fail (no Python traceback) under pytest,
RuntimeError elsewhere.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.client import Client
from radixkv.errors import Unavailable

from tests.support import forked

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
READINESS = "radixkv.v1.RadixKV"  # the health service name that means "ready" ("" = alive)
# Small host pools by default: a test that needs more passes host_pool_pages or flags.
DEFAULT_FLAGS = ("--host-pool-size", "64MiB", "--log-level", "info")
LOG_TAIL = 8000  # characters of a daemon's log shown with a failure


def fail(message: str) -> NoReturn:
    """Fail the running test with `message` (pytest.fail, no Python traceback); outside
    pytest (the soak run and its engine processes) raise RuntimeError(message)."""
    if "pytest" in sys.modules:
        import pytest
        pytest.fail(message, pytrace=False)
    raise RuntimeError(message)


def wait_for(condition, timeout: float, what: str, interval: float = 0.02):
    """Call `condition()` until it returns something truthy, and return that; fail after
    `timeout` seconds, naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            fail(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(interval)


class _MetricsPortTaken(Exception):
    """The daemon exited at start: its metrics port was taken meanwhile."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(target: str, service: str, timeout: float = 2.0) -> str:
    """The health status name of `service` (plaintext channel), or UNREACHABLE:<code>."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return f"UNREACHABLE:{e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


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


class DaemonProcess:
    """One `python -m radixkv_server`, run in its own temporary directory `dir`.

    flags          after DEFAULT_FLAGS (a later flag wins)
    metrics        serve /metrics on a free port of 127.0.0.1 (`metrics_port`,
                   `metrics_url`, `scrape()`); off (`metrics_port` 0) by default
    split_logs     the daemon's log (stderr) in `log_path` and its stdout apart in
                   `out_path`; by default both go to `log_path` (`out_path` is None)
    listen         the --listen target instead of unix://<dir>/radixkv.sock (TCP, or a
                   socket elsewhere)
    probe          Client arguments the readiness probe needs (tls=... on a TLS listener)
    env            the daemon's environment (default: this process's)
    start_timeout  how long start() waits for readiness
    launcher       the interpreter's arguments before the daemon's flags (default
                   `-m radixkv_server`; `-c <script>` runs the daemon from a script)
    fork           with the default launcher, fork the daemon from a process that
                   imported torch already (forked.py: a start takes a quarter of the
                   time); False starts a fresh interpreter, for tests of the start itself
    """

    def __init__(self, *flags: str, metrics: bool = False, split_logs: bool = False,
                 listen: str | None = None, probe: dict | None = None, env: dict | None = None,
                 start_timeout: float = START_TIMEOUT_S, launcher: tuple[str, ...] = ("-m", "radixkv_server"),
                 fork: bool = True):
        # mkdtemp under /tmp, not tmp_path: a unix socket path must stay under 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="rkv-d-")
        self.socket = os.path.join(self.dir, "radixkv.sock")
        self.target = listen or f"unix://{self.socket}"
        self.metrics_port = free_port() if metrics else 0
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics" if metrics else None
        self.log_path = os.path.join(self.dir, "stderr.log" if split_logs else "daemon.log")
        self.out_path = os.path.join(self.dir, "stdout.log") if split_logs else None
        self.flags = ("--metrics-port", str(self.metrics_port), *DEFAULT_FLAGS, *flags)
        self.probe = probe or {}
        self.env = env
        self.start_timeout = start_timeout
        self.launcher = launcher
        self.fork = fork and forked.usable(env) and launcher == ("-m", "radixkv_server")
        self.proc: subprocess.Popen | forked.ForkedProcess | None = None
        self.starts = 0
        self.killed = False  # the last run was ended by kill(), on purpose

    # -- running -----------------------------------------------------------------------

    def start(self, ready: bool = True) -> "DaemonProcess":
        """Start (again, on the same socket; the logs are appended to); with `ready`, wait
        until it is ready (see wait_ready). A metrics port another process took between
        choosing and binding it is chosen afresh (twice at most)."""
        for attempt in range(3):
            self._spawn()
            if not ready:
                return self
            try:
                self.wait_ready()
                return self
            except _MetricsPortTaken:
                if attempt == 2:
                    fail(f"the metrics port was taken three times:\n{self.tail()}")
                self.metrics_port = free_port()
                self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
                self.flags = ("--metrics-port", str(self.metrics_port), *self.flags[2:])
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        args = ["--listen", self.target, *self.flags]
        if self.fork:
            self.proc = forked.ForkedProcess(args, self.dir, self.env, self.out_path or self.log_path, self.log_path)
        else:
            with contextlib.ExitStack() as files:
                err = files.enter_context(open(self.log_path, "ab"))
                out = files.enter_context(open(self.out_path, "ab")) if self.out_path else err
                self.proc = subprocess.Popen([sys.executable, *self.launcher, *args], stdout=out, stderr=err,
                                             cwd=self.dir, env=self.env)
        self.starts += 1
        self.killed = False

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the health service reports READINESS SERVING. Fails (with the log's
        tail) when the daemon exits first, or, killing it, when it is not ready within
        `timeout` (default: start_timeout)."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with Client(self.target, timeout=5, reconnect=None, **self.probe) as probe:
            while True:
                if self.proc.poll() is not None:
                    if self.metrics_port and "cannot serve metrics" in self.tail():
                        raise _MetricsPortTaken()
                    fail(f"daemon exited with {self.proc.returncode} at start:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._sigkill()
                    fail(f"daemon did not become ready in {timeout}s:\n{self.tail()}")
                try:
                    probe.wait_ready(min(left, 1.0), service=READINESS)
                    return
                except Unavailable:
                    pass  # not yet: look whether it is still running, then ask again

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        """Resident memory of the running daemon (0 when not running)."""
        return rss_of(self.proc.pid) if self.alive else 0

    def scrape(self) -> str:
        """The text of one GET /metrics (needs metrics=True)."""
        assert self.metrics_url, "this daemon was started without metrics=True"
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    # -- logs --------------------------------------------------------------------------

    def log(self) -> str:
        """The whole log (stderr, and stdout unless split_logs) of every run so far."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:  # not started yet, or cleaned up
            return ""

    def tail(self, chars: int = LOG_TAIL) -> str:
        """The end of the log, as failure messages show it."""
        return self.log()[-chars:]

    # -- ending ------------------------------------------------------------------------

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Wait for the daemon to exit: its exit code. Fails (killing it, showing the log's
        tail) when it has not exited within `timeout`."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._sigkill()
            fail(f"daemon did not exit within {timeout}s:\n{self.tail()}")

    def stop(self) -> int:
        """SIGTERM and wait: the exit code; -9 when it had to be killed after STOP_TIMEOUT_S.
        When not running: the exit code of its last run (0 if it never ran)."""
        if not self.alive:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._sigkill()
            return -9

    def kill(self) -> None:
        """SIGKILL: no shutdown at all, as a crash or the OOM killer would. On purpose, so
        stop_all does not hold its exit code against it."""
        if self.alive:
            self.killed = True
        self._sigkill()

    def _sigkill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def restart(self, ready: bool = True) -> None:
        self.kill()
        self.start(ready)

    def cleanup(self) -> None:
        """Kill it if still running and remove its directory (socket, logs)."""
        self._sigkill()
        shutil.rmtree(self.dir, ignore_errors=True)


def stop_all(daemons) -> None:
    """The teardown of the daemons a test started: SIGTERM each one still running, which
    must exit 0; one that already ended must have exited 0 too, unless the test killed
    it (kill()); no log may hold a Python traceback. Every daemon is cleaned up; then the
    test fails listing every problem found."""
    failures = []
    for d in daemons:
        try:
            if d.alive:
                code = d.stop()
                if code != 0:
                    why = f" (killed: no exit within {STOP_TIMEOUT_S}s)" if code == -9 else ""
                    failures.append(f"daemon {d.target} exited with {code} on SIGTERM{why}:\n{d.tail()}")
            elif d.proc is not None and d.proc.returncode != 0 and not d.killed:
                failures.append(f"daemon {d.target} had exited with {d.proc.returncode}:\n{d.tail()}")
            log = d.log()
            if "Traceback" in log:
                at = log.index("Traceback")
                failures.append(f"daemon {d.target} logged a traceback:\n{log[max(0, at - 500):][:LOG_TAIL]}")
        finally:
            d.cleanup()
    if failures:
        fail("\n\n".join(failures))
