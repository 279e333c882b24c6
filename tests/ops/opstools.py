"""Helpers of the operability tests: a daemon subprocess, bounded polling, free ports,
running the real tools. Nothing here sleeps to synchronise: every wait polls a
condition against a deadline."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: grpcurl, hadolint, radixkv-health
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
READINESS = "radixkv.v1.RadixKV"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll `condition()` until it returns something truthy (returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}", pytrace=False)
        time.sleep(interval)


def health_status(target: str, service: str, timeout: float = 2.0) -> str:
    """The health status name of `service`, or UNREACHABLE."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return f"UNREACHABLE:{e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class Daemon:
    """One daemon process. Logs (stderr) go to `log_path`, stdout to `out_path`."""

    def __init__(self, *flags: str):
        # mkdtemp under /tmp, not tmp_path: a unix socket path must stay under 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="rkv-ops-")
        self.socket = os.path.join(self.dir, "radixkv.sock")
        self.target = f"unix://{self.socket}"
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = os.path.join(self.dir, "stderr.log")
        self.out_path = os.path.join(self.dir, "stdout.log")
        self.flags = ("--host-pool-size", "64MiB", *flags)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Daemon":
        with open(self.log_path, "wb") as err, open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "radixkv_server", "--listen", self.target,
                 "--metrics-port", str(self.metrics_port), *self.flags],
                stdout=out, stderr=err, cwd=self.dir)

        def ready():
            if self.proc.poll() is not None:
                pytest.fail(f"daemon exited with {self.proc.returncode} at start:\n{self.log()}", pytrace=False)
            return os.path.exists(self.socket) and health_status(self.target, READINESS, 1.0) == "SERVING"

        wait_for(ready, START_TIMEOUT_S, f"daemon readiness on {self.target}")
        return self

    def scrape(self) -> str:
        """The text of one GET /metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"daemon did not exit within {timeout}s of SIGTERM:\n{self.log()[-4000:]}", pytrace=False)

    def stop(self) -> int:
        """SIGTERM and wait; the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def stop_all(started: list[Daemon]) -> None:
    """SIGTERM every daemon still running; each must exit 0, and none may have logged a
    traceback."""
    failures = []
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            code = d.stop()
            if code != 0:
                failures.append(f"daemon exited with {code} on SIGTERM:\n{d.log()[-4000:]}")
        if d.proc is not None and "Traceback" in d.log():
            failures.append(f"daemon logged a traceback:\n{d.log()[-4000:]}")
        d.cleanup()
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


def run_tool(args: list[str], env: dict | None = None, timeout: float = 30.0, check: bool = True,
             **kwargs) -> subprocess.CompletedProcess:
    """Run a program; with `check`, fail the test (showing its output) unless it exits 0."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}",
                    pytrace=False)
    return done
