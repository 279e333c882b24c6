"""Fixtures of the operability tests: the real daemon as a subprocess, driven by the real tools.

`daemon` starts `python -m radixkv_server` (tests/support/daemon.py) on a temporary unix
socket and a free TCP metrics port, its log (stderr) and stdout kept apart, waits
(bounded) for gRPC readiness, and at teardown stops it with SIGTERM and requires exit
code 0 and no traceback logged. `daemon_factory(*flags)` starts differently configured ones.
Every daemon here is a real interpreter (not forked, tests/support/forked.py): starts,
signals, exit codes and shutdown are what these tests look at.
"""

import os

import pytest

from opstools import BIN
from tests.support import forked
from tests.support.daemon import DaemonProcess, stop_all


@pytest.fixture(scope="module", autouse=True)
def real_interpreters():
    """The daemons of tests/ops start as `python -m radixkv_server` does, whole."""
    enabled, forked.ENABLED = forked.ENABLED, False
    yield
    forked.ENABLED = enabled


@pytest.fixture
def daemon_factory():
    """start(*flags) -> a ready DaemonProcess, checked by `stop_all` at teardown."""
    started: list[DaemonProcess] = []

    def start(*flags: str) -> DaemonProcess:
        d = DaemonProcess(*flags, metrics=True, split_logs=True)
        started.append(d)
        return d.start()

    yield start
    stop_all(started)


@pytest.fixture(scope="module")
def module_daemon() -> DaemonProcess:
    """One daemon on defaults shared by a module's tests (which must not depend on each
    other's state), checked like `daemon` at the module's end."""
    d = DaemonProcess(metrics=True, split_logs=True)
    try:
        yield d.start()
    finally:
        stop_all([d])


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """A fresh daemon on defaults (text logs at info), stopped with SIGTERM (exit 0) afterwards."""
    return daemon_factory()


@pytest.fixture
def tool_env() -> dict:
    """The environment with the venv's bin (grpcurl, hadolint) first on PATH."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
