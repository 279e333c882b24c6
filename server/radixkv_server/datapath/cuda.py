"""CudaDeviceBuffers: the engine's KV buffers opened through CUDA IPC. Every CUDA call
of the daemon lives in this module (host pinning included), and torch's CUDA side is
touched only when a function here runs, so the module imports on CPU-only machines.

Device choice: everything runs under `torch.cuda.device(engine_device)`; the daemon
never creates a context on another GPU.

Copies. The host pool is registered (cudaHostRegister) and so addressable from the
GPU; a CUDA view of it lets torch's gather/scatter kernels move whole pages straight
between host and device memory (zero-copy over PCIe), one gather and one scatter per
layer instead of one cudaMemcpy per (page, buffer). If that view cannot be made (pool
not pinned), pages move chunk by chunk with cudaMemcpyAsync.

Streams and events. Loads run on one stream, stores on another (backups never delay a
load-back). A load records one interprocess event per layer after that layer's pages
are in place; the engine opens the handles (`radixkv.kvbuffers.CudaKvBuffers`) and
waits on event i before reading layer i. Events come from a fixed ring, so the engine
opens each handle once. Reusing an event is safe: all loads share one stream, so a
later record of the same event completes only after the earlier copies did.

Ordering with the engine. Opening the buffers synchronizes once (torch's IPC open makes
only the current stream wait on the exporter's event). A copy given the engine's event
(`after`) makes its stream wait on it before its first kernel. A copy that fails while
being enqueued waits for what it already queued before it fails (`enqueue_or_drain`):
the transfer must not settle while kernels still write its pages. Scratch for the
gathers is preallocated, one buffer per stream (`SCRATCH_BYTES`), used under that
stream's lock, so a copy never allocates device memory beyond its index arrays.
"""

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from radixkv.layout import KvLayout

from . import cuda_devices, cuda_host
from .cuda_host import pin_host, unpin_host
from .device import (
    BufferSpec, CopyError, CopyJob, DeviceBuffers, DeviceOpenError, buffer_name, check_overlap, element_width,
)

log = logging.getLogger("radixkv.datapath")

EVENT_RING = 64            # load-backs whose events may be outstanding before reuse
SCRATCH_BYTES = 32 << 20   # preallocated device scratch per stream; bigger batches go in groups
MAX_ENGINE_EVENTS = 1024   # engine events kept open (an engine reuses a few)
T = TypeVar("T")


def _torch():
    import torch
    return torch


def cuda_available() -> bool:
    """Whether torch has CUDA and a device is visible (creates no context)."""
    torch = _torch()
    return torch.cuda.is_available()


def enqueue_or_drain(stream, enqueue: Callable[[], T]) -> T:
    """`enqueue()` (which queues kernels on `stream`) or, if it raises, wait for the
    stream to finish what was already queued, then raise CopyError: a failed transfer
    settles only once no kernel of it still writes its pages."""
    try:
        return enqueue()
    except Exception as e:
        try:
            stream.synchronize()
        except Exception as sync_error:  # a broken context runs no more kernels either
            log.warning("CUDA stream did not synchronize after a failed enqueue: %s", sync_error)
        raise CopyError(f"CUDA copy could not be enqueued: {type(e).__name__}: {e}") from e


class CudaDeviceBuffers(DeviceBuffers):
    """Open `specs` (handles from `radixkv.kvbuffers.CudaKvBuffers.export`) on the
    engine's GPU: `device_uuid` when given (found among this process's GPUs), else
    ordinal `device`. Raises DeviceOpenError when CUDA is missing, the GPU is not
    visible, a handle does not decode or open, a region is too small, or buffers overlap."""

    layer_events = True

    def __init__(self, layout: KvLayout, num_pages: int, specs: list[BufferSpec], device: int,
                 device_uuid: str = ""):
        torch = _torch()
        if not torch.cuda.is_available():
            raise DeviceOpenError("backend 'cuda' needs torch with CUDA and a visible GPU; use 'shm' on CPU machines")
        if device_uuid:
            device = cuda_devices.ordinal_for_uuid(device_uuid, cuda_devices.visible_uuids())
        elif not 0 <= device < torch.cuda.device_count():
            raise DeviceOpenError(f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)")
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        self.by_uuid = bool(device_uuid)
        self.device_uuid = cuda_devices.device_uuid(device)
        self._dev = torch.device("cuda", device)
        self._lock = threading.Lock()  # event ring and engine events: worker threads share them
        self._ring: list[tuple[list, list[bytes]]] = []
        self._next_slot = 0
        self._engine_events: dict[bytes, object] = {}
        self._host_views: dict[int, object] = {}  # host pool data_ptr -> CUDA view (or None)
        with torch.cuda.device(device):
            self._views = self._open(specs)
            try:
                torch.cuda.current_stream(device).synchronize()  # the open's wait on the exporter's event
                self._load_stream = torch.cuda.Stream(device, priority=-1)  # loads go first
                self._store_stream = torch.cuda.Stream(device)
                per = max(1, SCRATCH_BYTES // (layout.buffers_per_layer * layout.chunk_bytes))
                self._scratch = {  # stream -> (lock, [per, buffers per layer, cols]); see enqueue_or_drain
                    s: (threading.Lock(), torch.empty((per, layout.buffers_per_layer, self._cols), dtype=self._dtype,
                                                      device=self._dev))
                    for s in (self._load_stream, self._store_stream)}
            except RuntimeError as e:  # torch.OutOfMemoryError included: a full GPU is the engine's to size
                raise DeviceOpenError(f"cuda:{device}: cannot set up the daemon's two copy streams and their "
                                      f"{2 * SCRATCH_BYTES >> 20} MiB of scratch memory: {e}") from None

    def _open(self, specs: list[BufferSpec]) -> list:
        torch = _torch()
        need = self.layout.buffer_bytes(self.num_pages)
        storages: dict[bytes, object] = {}
        spans = []
        for i, spec in enumerate(specs):
            st = storages.get(spec.handle)
            if st is None:
                st = storages[spec.handle] = self._open_handle(spec.handle, f"buffer {i} ({buffer_name(self.layout, i)})")
            if spec.size < need or spec.offset + need > st.nbytes():
                raise DeviceOpenError(
                    f"buffer {i} ({buffer_name(self.layout, i)}): needs {need} bytes ({self.num_pages} pages x "
                    f"{self.layout.chunk_bytes}) at offset {spec.offset}; spec size {spec.size}, shared storage "
                    f"{st.nbytes()} bytes"
                )
            spans.append((st, spec.offset))
        addresses = [st.data_ptr() + off for st, off in spans]  # one address space: overlap is absolute
        check_overlap([(None, a, a + need) for a in addresses], self.layout, f"cuda:{self.device}")
        width = element_width(self.layout.chunk_bytes, *addresses)
        self._dtype = _wide(torch, width)
        self._cols = self.layout.chunk_bytes // width
        views = []
        for st, off in spans:
            t = torch.empty(0, dtype=torch.uint8, device=self._dev).set_(st, off, (need,))
            views.append(t.view(self._dtype).view(self.num_pages, self._cols))
        self._storages = list(storages.values())
        return views

    def _open_handle(self, handle: bytes, where: str):
        """One exported storage, opened on our device. Its ordinal is the exporter's own:
        with a UUID it may differ from ours (other CUDA_VISIBLE_DEVICES) and is replaced."""
        from radixkv.cuda_handle import decode_cuda_handle
        torch = _torch()
        try:
            args = decode_cuda_handle(handle)
        except ValueError as e:
            raise DeviceOpenError(f"{where}: {e}") from None
        if not self.by_uuid and args[0] != self.device:
            raise DeviceOpenError(f"{where}: exported from cuda:{args[0]}, but the engine's device is cuda:{self.device}")
        try:
            return torch.UntypedStorage._new_shared_cuda(self.device, *args[1:])
        except RuntimeError as e:
            raise DeviceOpenError(f"{where}: cannot open the CUDA IPC handle (engine gone, or another host?): {e}") from None

    # -- copies ------------------------------------------------------------------------

    def submit_load(self, host_pool, host_pages: bytes, device_pages: bytes, after: bytes = b"") -> CopyJob:
        return self._submit(host_pool, host_pages, device_pages, False, after)

    def submit_store(self, device_pages: bytes, host_pool, host_pages: bytes, after: bytes = b"") -> CopyJob:
        return self._submit(host_pool, host_pages, device_pages, True, after)

    def _submit(self, host_pool, host_pages: bytes, device_pages: bytes, to_host: bool, after: bytes) -> CopyJob:
        torch = _torch()
        views = self._views
        if views is None:
            raise CopyError("CUDA device buffers are closed")
        host, dev = self.check_pages(host_pool, host_pages, device_pages)
        if host_pool.tensor is None:
            raise CopyError("host pool is closed")
        if not host:
            return CopyJob()  # nothing to copy (and torch.frombuffer refuses empty buffers)
        stream = self._store_stream if to_host else self._load_stream
        events, handles = ([], []) if to_host else self._take_slot()
        lock, scratch = self._scratch[stream]

        def enqueue():
            if after:
                stream.wait_event(self._engine_event(after))
            h3 = self._host_view(host_pool)
            if h3 is None:
                self._copy_chunks(host_pool, host, dev, views, events, stream, to_host)
            elif to_host:
                store_pages(self.layout, h3, views, self._index(host_pages), self._index(device_pages), scratch)
            else:
                load_pages(self.layout, h3, views, self._index(host_pages), self._index(device_pages), scratch,
                           lambda layer: events[layer].record(stream))
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
            return done

        with lock, torch.cuda.device(self.device), torch.cuda.stream(stream):
            done = enqueue_or_drain(stream, enqueue)
        return CopyJob(list(handles), lambda: _synchronize(done, self.device))

    def _engine_event(self, handle: bytes):
        """The engine's interprocess event, opened once per handle (kept open, bounded)."""
        torch = _torch()
        with self._lock:
            ev = self._engine_events.get(handle)
            if ev is None:
                ev = torch.cuda.Event.from_ipc_handle(self.device, handle)
                if len(self._engine_events) >= MAX_ENGINE_EVENTS:
                    self._engine_events.pop(next(iter(self._engine_events)))
                self._engine_events[handle] = ev
            return ev

    def _copy_chunks(self, host_pool, host, dev, views, events, stream, to_host: bool) -> None:
        """Fallback without a device view of the host pool: one copy per (page, buffer)."""
        bpl = self.layout.buffers_per_layer
        h3 = host_pool.tensor.view(self._dtype).view(host_pool.num_pages, len(views), self._cols)
        for layer in range(self.layout.num_layers):
            for b in range(layer * bpl, layer * bpl + bpl):
                for h, d in zip(host, dev):
                    if to_host:
                        h3[h, b].copy_(views[b][d], non_blocking=True)
                    else:
                        views[b][d].copy_(h3[h, b], non_blocking=True)
            if events:
                events[layer].record(stream)

    def _index(self, pages: bytes):
        torch = _torch()
        idx = torch.frombuffer(bytearray(pages), dtype=torch.int32).long().pin_memory()
        return idx.to(self._dev, non_blocking=True)  # pinned: does not wait for the stream

    def _host_view(self, host_pool):
        """The host pool (or a rank's `HostShard` of one) as a CUDA tensor [pages,
        buffers, cols] at the device address the driver gives for the pool (zero-copy;
        a shard's is strided), or None (copy chunk by chunk)."""
        torch = _torch()
        pool = getattr(host_pool, "pool", host_pool)  # a HostShard's whole pool
        key = (pool.tensor.data_ptr(), getattr(host_pool, "rank", None))
        if key in self._host_views:
            return self._host_views[key]
        view = None
        if pool.pinned:
            can, driver_ptr = cuda_host.mapped_pointer(key[0], self.device)
            ptr = cuda_host.choose_device_pointer(key[0], can, driver_ptr)
            if ptr is None:
                log.warning("no device address for the pinned host pool (host pointer usable: %s); copying "
                            "chunk by chunk", can)
            else:
                try:
                    st = torch._C._construct_storage_from_data_pointer(ptr, self._dev, pool.nbytes)
                    flat = torch.empty(0, dtype=torch.uint8, device=self._dev).set_(st, 0, (pool.nbytes,))
                    view = host_pages_view(flat, host_pool, self.layout.num_buffers, self._cols, self._dtype)
                except (AttributeError, RuntimeError) as e:
                    log.warning("no device view of the host pool (%s); copying chunk by chunk", e)
        else:
            log.warning("host pool is not pinned; CUDA copies go chunk by chunk through pageable memory")
        self._host_views[key] = view
        return view

    def _take_slot(self) -> tuple[list, list[bytes]]:
        torch = _torch()
        with self._lock:
            slot = self._next_slot % EVENT_RING
            self._next_slot += 1
            if slot == len(self._ring):
                with torch.cuda.device(self.device):
                    evs = [torch.cuda.Event(interprocess=True) for _ in range(self.layout.num_layers)]
                    self._ring.append((evs, [bytes(e.ipc_handle()) for e in evs]))
            return self._ring[slot]

    def close(self) -> None:
        """Drop the IPC mappings and events (the engine's memory stays). Idempotent; no
        copy may be in flight."""
        if self._views is None:
            return
        torch = _torch()
        try:
            with torch.cuda.device(self.device):
                for s in (self._load_stream, self._store_stream):
                    s.synchronize()
        except RuntimeError as e:  # a broken context must not stop teardown
            log.warning("CUDA streams did not synchronize on close: %s", e)
        self._views = None
        self._storages = []
        self._host_views.clear()
        self._ring = []
        self._engine_events.clear()
        self._scratch = {}

    def __repr__(self) -> str:
        return f"CudaDeviceBuffers(device=cuda:{self.device}, pages={self.num_pages})"


def host_pages_view(flat, host_pool, num_buffers: int, cols: int, dtype):
    """`flat` (uint8, every byte of the pool `host_pool` is or belongs to) as [pages,
    buffers, cols] of `dtype`: the pool's pages, or a `HostShard`'s slice of each (its
    rank's part of a page of `tp_size` shards, so the page stride spans every shard).
    Device-agnostic (the CPU tests run it on the pool's own tensor)."""
    rank = getattr(host_pool, "rank", None)
    if rank is None:
        return flat.view(dtype).view(host_pool.num_pages, num_buffers, cols)
    return flat.view(dtype).view(host_pool.num_pages, host_pool.tp_size, num_buffers, cols)[:, rank]


def load_pages(layout: KvLayout, h3, views, hidx, didx, scratch, layer_done: Callable[[int], None]) -> None:
    """Host pages `hidx` of `h3` ([pages, buffers, cols]) into device pages `didx` of
    every buffer in `views`, layer by layer: one gather into `scratch` ([per, buffers per
    layer, cols]) and one scatter per buffer for each group of `per` pages, then
    `layer_done(layer)`. Device-agnostic (the CPU tests run it on CPU tensors)."""
    torch = _torch()
    bpl = layout.buffers_per_layer
    for layer in range(layout.num_layers):
        src_layer = h3.narrow(1, layer * bpl, bpl)
        for lo, hi in _groups(len(hidx), scratch.shape[0]):
            src = torch.index_select(src_layer, 0, hidx[lo:hi], out=scratch[:hi - lo])  # host pages over PCIe
            for j in range(bpl):
                views[layer * bpl + j].index_copy_(0, didx[lo:hi], src[:, j])
        layer_done(layer)


def store_pages(layout: KvLayout, h3, views, hidx, didx, scratch) -> None:
    """Device pages `didx` of every buffer into host pages `hidx` of `h3`: per group of
    pages, one gather per buffer into `scratch`, one scatter of whole pages to host."""
    torch = _torch()
    bpl = layout.buffers_per_layer
    for layer in range(layout.num_layers):
        dst_layer = h3.narrow(1, layer * bpl, bpl)
        for lo, hi in _groups(len(hidx), scratch.shape[0]):
            tmp = scratch[:hi - lo]
            for j in range(bpl):
                torch.index_select(views[layer * bpl + j], 0, didx[lo:hi], out=tmp[:, j])
            dst_layer.index_copy_(0, hidx[lo:hi], tmp)  # writes host pages over PCIe


def _groups(n: int, per: int) -> list[tuple[int, int]]:
    """[lo, hi) slices of n pages, at most `per` each (what one scratch buffer holds)."""
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


def _wide(torch, width: int):
    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]


def _synchronize(event, device: int) -> None:
    """Wait for `event` on the calling (wait) thread. The device guard matters: a CUDA
    runtime call on a thread with no current device would use (and create) a context on
    device 0, and the daemon must hold a context only on the engine's device."""
    torch = _torch()
    try:
        with torch.cuda.device(device):
            event.synchronize()
    except RuntimeError as e:
        raise CopyError(f"CUDA copy failed: {e}") from e


__all__ = ["CudaDeviceBuffers", "EVENT_RING", "SCRATCH_BYTES", "cuda_available", "enqueue_or_drain", "host_pages_view",
           "load_pages", "pin_host", "store_pages", "unpin_host"]
