"""A real radixkv daemon for the service tests: a subprocess on a temporary unix socket
(tests/support/daemon.py).

`daemon` yields the target of a fresh daemon ("unix:///tmp/rkv-.../radixkv.sock") and,
at teardown, stops it with SIGTERM and requires a clean exit (code 0, no traceback
logged). `daemon_factory` starts more (or differently configured) daemons the same way.
"""

import pytest

from tests.support.daemon import DaemonProcess, stop_all


@pytest.fixture
def daemon_factory():
    """start(*flags, **options) -> DaemonProcess (options as DaemonProcess takes them),
    started and ready. At teardown every daemon still running must stop cleanly on
    SIGTERM (see `stop_all`)."""
    started: list[DaemonProcess] = []

    def start(*flags: str, **options) -> DaemonProcess:
        d = DaemonProcess(*flags, **options)
        started.append(d)
        return d.start()

    yield start
    stop_all(started)


@pytest.fixture
def daemon(daemon_factory) -> str:
    """The target of a fresh daemon, stopped with SIGTERM (exit code 0) afterwards."""
    return daemon_factory().target
