"""HostPool: the daemon's host-memory KV pages (the L2 tier's bytes).

One allocation, a uint8 tensor [num_pages, page_bytes] in the page-first layout of
`radixkv.layout`: host page p is `tensor[p]`, the chunks of every buffer back to back.
Which pages are free is the core's business (`core.host_allocator`); this class only
owns the memory. Pinned (cudaHostRegister) when CUDA is present and `pin` allows, so
device copies run at full PCIe speed and CUDA kernels can read it directly. On a
machine with several NUMA nodes the pinned pool is placed on the engine GPU's node
(`numa.near`: the pages are faulted in by the pinning thread, moved to that node's CPUs).
An unpinned pool is faulted in as it is first used (each 4 KiB costs its first copy a
kernel fault and zeroing), or at once with `prefault`.
"""

import ctypes
import logging
import time

import torch

from radixkv.layout import KvLayout

from . import numa

log = logging.getLogger("radixkv.datapath")

PIN_MODES = ("auto", "always", "never")


class HostPool:
    """`num_pages` host pages for `layout`. `pin`: "auto" pins when CUDA is available
    and goes on unpinned (logging why) when pinning is refused, "always" pins or raises
    RuntimeError, "never" does not. `device` is the CUDA device
    whose context registers the memory (the engine's device; default the current one);
    when given, a pinned pool is allocated on that GPU's NUMA node where there are several.
    `prefault`: fault every page of an unpinned pool in now (pinning does already).
    Raises ValueError on a bad size or pin mode."""

    def __init__(self, layout: KvLayout, num_pages: int, pin: str = "auto", device: int | None = None,
                 prefault: bool = False):
        if pin not in PIN_MODES:
            raise ValueError(f"pin must be one of {PIN_MODES}, got {pin!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"host pool num_pages must be an int >= 0, got {num_pages!r}")
        self.layout = layout
        self.num_pages = num_pages
        self.pinned = False
        self.numa_node: int | None = None  # where the pool was placed, when chosen
        self._pinned_ptr = 0
        self._device = device
        self._chunk_views: dict = {}  # chunk bytes -> numpy view (`chunks`), dropped at close
        pin_it = pin != "never" and self.nbytes > 0
        node = self._gpu_node() if pin_it else None
        with numa.near(node) as moved:  # first touch (the pinning) happens on `node`
            self.numa_node = node if moved else None
            self.tensor: torch.Tensor | None = torch.empty((num_pages, layout.page_bytes), dtype=torch.uint8)
            if pin_it:
                self._pin(pin)
            if prefault and not self.pinned and self.nbytes:
                self._prefault()

    @staticmethod
    def pages_for_bytes(layout: KvLayout, nbytes: int) -> int:
        """Whole host pages that fit in `nbytes` bytes (a size given in bytes, e.g. `--host-bytes`)."""
        if nbytes < 0:
            raise ValueError(f"host pool size must be >= 0 bytes, got {nbytes}")
        return nbytes // layout.page_bytes

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.page_bytes

    @property
    def closed(self) -> bool:
        return self.tensor is None

    def _gpu_node(self) -> int | None:
        """The engine GPU's NUMA node when there is a choice to make (CUDA, a device, and
        several nodes); None otherwise."""
        from . import cuda
        if self._device is None or not cuda.cuda_available():
            return None
        return numa.gpu_node(self._device)

    def _pin(self, mode: str) -> None:
        from . import cuda, cuda_host
        if not cuda.cuda_available():
            if mode == "always":
                raise RuntimeError("host pool pin='always' but CUDA is not available")
            return
        ptr = self.tensor.data_ptr()
        try:
            cuda_host.pin_host(ptr, self.nbytes, self._device)
        except RuntimeError as e:  # e.g. RLIMIT_MEMLOCK in a container, or no room to lock
            log.warning(cuda_host.pin_refused(mode, e, self.nbytes))
            return
        self._pinned_ptr = ptr
        self.pinned = True
        where = "" if self.numa_node is None else f" on NUMA node {self.numa_node}"
        log.info("host pool: pinned %.2f GiB (%d pages)%s", self.nbytes / 2**30, self.num_pages, where)

    def _prefault(self) -> None:
        start = time.perf_counter()
        how = "madvise" if _populate_write(self.tensor.data_ptr(), self.nbytes) else "touch"
        if how == "touch":  # kernels before 5.14: write one byte of every 4 KiB
            self.tensor.view(-1)[::4096].zero_()
        log.info("host pool: faulted in %.2f GiB (%s) in %.0f ms", self.nbytes / 2**30, how,
                 (time.perf_counter() - start) * 1e3)

    def close(self) -> None:
        """Unregister the pinned memory and drop the allocation. Idempotent. Close the
        copy engine and device buffers that use this pool first (CUDA kernels address
        the pinned memory directly)."""
        if self.tensor is None:
            return
        if self.pinned:
            from . import cuda_host
            cuda_host.unpin_host(self._pinned_ptr, self._device)
            self.pinned = False
            log.info("host pool: unpinned %.2f GiB", self.nbytes / 2**30)
        self.tensor = None
        self._chunk_views = {}

    def chunks(self, chunk_bytes: int):
        """The pool as a numpy array [num_pages, page_bytes // chunk_bytes] whose elements
        are opaque `chunk_bytes`-byte chunks (numpy void): element [p, b] is buffer b's chunk
        of page p, and an assignment copies it with one memmove. Made once per chunk size
        and kept until `close` (copies on a CPU backend take it per transfer). ValueError
        when the pool is closed or `chunk_bytes` does not divide a page."""
        view = self._chunk_views.get(chunk_bytes)
        if view is None:
            if self.tensor is None:
                raise ValueError("host pool is closed")
            if chunk_bytes <= 0 or self.layout.page_bytes % chunk_bytes:
                raise ValueError(f"chunks of {chunk_bytes} bytes do not divide a {self.layout.page_bytes}-byte page")
            import numpy as np  # only the CPU data path needs it
            view = self.tensor.numpy().view(np.dtype((np.void, chunk_bytes)))
            self._chunk_views[chunk_bytes] = view
        return view

    # -- test and tooling helpers ----------------------------------------------------

    def read_page(self, page: int) -> bytes:
        """A copy of host page `page` (page_bytes bytes)."""
        return tensor_bytes(self._row(page))

    def write_page(self, page: int, data: bytes) -> None:
        """Overwrite host page `page` with exactly page_bytes bytes."""
        if len(data) != self.layout.page_bytes:
            raise ValueError(f"write_page: got {len(data)} bytes, a page is {self.layout.page_bytes}")
        self._row(page).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _row(self, page: int) -> torch.Tensor:
        if self.tensor is None:
            raise ValueError("host pool is closed")
        if not 0 <= page < self.num_pages:
            raise IndexError(f"host page {page} out of range 0..{self.num_pages - 1}")
        return self.tensor[page]

    def __repr__(self) -> str:
        return f"HostPool(pages={self.num_pages}, page_bytes={self.layout.page_bytes}, pinned={self.pinned})"


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, as a write would


def _populate_write(address: int, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) over the whole pages in [address, address + nbytes);
    False where the kernel or C library does not offer it."""
    page = 4096
    lo, hi = -(-address // page) * page, (address + nbytes) // page * page
    madvise = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if madvise is None or hi <= lo:
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(lo, hi - lo, MADV_POPULATE_WRITE) == 0


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor (numpy is not needed)."""
    t = t.contiguous().view(torch.uint8).reshape(-1)
    if t.numel() == 0:
        return b""
    buf = bytearray(t.numel())
    torch.frombuffer(buf, dtype=torch.uint8).copy_(t)
    return bytes(buf)


__all__ = ["HostPool", "PIN_MODES", "tensor_bytes"]
