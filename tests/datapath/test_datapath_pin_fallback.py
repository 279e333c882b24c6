"""HostPool's pin modes when cudaHostRegister answers (issue 19 point 4): pin="auto"
goes on with an unpinned, usable pool and says so in one log line when pinning is
refused (RLIMIT_MEMLOCK in a container, no room to lock); pin="always" makes the
refusal an error; a pool that did pin unpins exactly once at close.

No GPU here: CUDA's availability and the register/unregister calls
(`cuda_host.pin_host` / `unpin_host`) are replaced; everything else is the real
HostPool (allocation, the decision, logging, teardown). On a GPU the real calls run in
tests/gpu.
"""

import logging

import pytest

from radixkv.layout import KvLayout
from radixkv_server.datapath import HostPool, cuda, cuda_host

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
PAGES = 8
REFUSAL = "cudaHostRegister of 4096 bytes failed: CUDA error 2 (out of memory)"
POOL_LOG = "radixkv.datapath"


class Driver:
    """The CUDA runtime as HostPool sees it: whether a GPU is visible, and what
    cudaHostRegister answers (`refuse`: raise as the real `pin_host` does)."""

    def __init__(self, monkeypatch, available: bool = True, refuse: bool = False):
        self.pins: list[tuple] = []
        self.unpins: list[tuple] = []
        self.refuse = refuse
        monkeypatch.setattr(cuda, "cuda_available", lambda: available)
        monkeypatch.setattr(cuda_host, "pin_host", self._pin)
        monkeypatch.setattr(cuda_host, "unpin_host", lambda ptr, device=None: self.unpins.append((ptr, device)))

    def _pin(self, ptr: int, nbytes: int, device=None) -> None:
        self.pins.append((ptr, nbytes, device))
        if self.refuse:
            raise RuntimeError(REFUSAL)


def pool_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == POOL_LOG and r.levelno >= logging.WARNING]


def test_auto_goes_on_unpinned_with_one_log_line_when_pinning_is_refused(monkeypatch, caplog):
    driver = Driver(monkeypatch, refuse=True)
    caplog.set_level(logging.INFO, logger=POOL_LOG)
    pool = HostPool(LAYOUT, PAGES, pin="auto")
    try:
        assert driver.pins == [(pool.tensor.data_ptr(), PAGES * LAYOUT.page_bytes, None)]  # it did ask
        assert not pool.pinned
        [line] = pool_warnings(caplog)
        assert "refused" in line and "going on unpinned" in line and "CUDA error 2" in line
        # The pool is there and holds what is written to it.
        page = bytes(range(256)) * (LAYOUT.page_bytes // 256)
        pool.write_page(PAGES - 1, page)
        assert pool.read_page(PAGES - 1) == page
    finally:
        pool.close()
    assert driver.unpins == []  # nothing was registered, so nothing is unregistered
    assert pool.closed


def test_always_fails_when_pinning_is_refused_or_cuda_is_absent(monkeypatch):
    driver = Driver(monkeypatch, refuse=True)
    with pytest.raises(RuntimeError, match=r"pin='always' but pinning \d+ bytes failed: .*CUDA error 2"):
        HostPool(LAYOUT, PAGES, pin="always")
    assert len(driver.pins) == 1 and driver.unpins == []
    Driver(monkeypatch, available=False)
    with pytest.raises(RuntimeError, match="pin='always' but CUDA is not available"):
        HostPool(LAYOUT, PAGES, pin="always")


def test_auto_without_cuda_and_never_do_not_try_to_pin(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=POOL_LOG)
    no_gpu = Driver(monkeypatch, available=False)
    quiet = HostPool(LAYOUT, PAGES, pin="auto")
    assert not quiet.pinned and no_gpu.pins == []
    quiet.close()
    gpu = Driver(monkeypatch)
    never = HostPool(LAYOUT, PAGES, pin="never")
    assert not never.pinned and gpu.pins == []
    never.close()
    assert pool_warnings(caplog) == []


def test_a_pinned_pool_unpins_once_at_close(monkeypatch):
    driver = Driver(monkeypatch)
    pool = HostPool(LAYOUT, PAGES, pin="auto")
    ptr = pool.tensor.data_ptr()
    assert pool.pinned and driver.pins == [(ptr, PAGES * LAYOUT.page_bytes, None)]
    pool.close()
    pool.close()  # idempotent: the second close unregisters nothing
    assert driver.unpins == [(ptr, None)] and not pool.pinned
