"""A real radixkv daemon for the service tests: a subprocess on a temporary unix socket
(tests/support/daemon.py).

`daemon` yields the target of a fresh daemon ("unix:///tmp/rkv-.../radixkv.sock") and,
at teardown, stops it with SIGTERM and requires a clean exit (code 0, no traceback
logged). `daemon_factory` starts more (or differently configured) daemons the same way.
`buffers` gives two engines' worth of device buffers for tests that register by hand.
"""

import pytest
from radixkv.kvbuffers import ShmKvBuffers

from tests.support.daemon import DaemonProcess, stop_all
from tests.support.engine import LAYOUT

BUFFER_PAGES = 16  # device pages of each of `buffers`


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


@pytest.fixture
def buffers() -> list[ShmKvBuffers]:
    """Two sets of shared-memory device buffers of LAYOUT, BUFFER_PAGES pages each
    (two engines, or an engine and its replacement), freed after the test."""
    made = [ShmKvBuffers.create(LAYOUT, BUFFER_PAGES) for _ in range(2)]
    yield made
    for b in made:
        b.close()
