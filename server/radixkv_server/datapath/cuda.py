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
"""

import logging
import threading

from radixkv.layout import KvLayout

from .device import BufferSpec, CopyError, CopyJob, DeviceBuffers, DeviceOpenError, buffer_name, element_width

log = logging.getLogger(__name__)

_HOST_REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
EVENT_RING = 64          # load-backs whose events may be outstanding before reuse
MAX_TEMP_BYTES = 256 << 20  # device scratch per layer step; bigger batches go in groups


def _torch():
    import torch
    return torch


def cuda_available() -> bool:
    """Whether torch has CUDA and a device is visible (creates no context)."""
    torch = _torch()
    return torch.cuda.is_available()


def pin_host(ptr: int, nbytes: int, device: int | None = None) -> None:
    """Page-lock [ptr, ptr + nbytes) (cudaHostRegister, portable and mapped) under
    `device`'s context. Raises RuntimeError with the CUDA error code on failure."""
    torch = _torch()
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_FLAGS)
    if _code(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error {_code(err)} ({err})")


def unpin_host(ptr: int, device: int | None = None) -> None:
    """Undo `pin_host`. Logs (does not raise) a failure: teardown must go on."""
    torch = _torch()
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if _code(err) != 0:
        log.warning("cudaHostUnregister failed: CUDA error %s", _code(err))


def _code(err) -> int:
    return int(err)  # a cudaError enum from torch's cudart bindings


class CudaDeviceBuffers(DeviceBuffers):
    """Open `specs` (handles from `radixkv.kvbuffers.CudaKvBuffers.export`) on CUDA
    device `device`. Raises DeviceOpenError when CUDA is missing, a handle does not
    decode or open, or a region is too small."""

    def __init__(self, layout: KvLayout, num_pages: int, specs: list[BufferSpec], device: int):
        torch = _torch()
        if not torch.cuda.is_available():
            raise DeviceOpenError("backend 'cuda' needs torch with CUDA and a visible GPU; use 'shm' on CPU machines")
        if not 0 <= device < torch.cuda.device_count():
            raise DeviceOpenError(f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)")
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        self._dev = torch.device("cuda", device)
        self._lock = threading.Lock()  # event ring: worker threads take slots concurrently
        self._ring: list[tuple[list, list[bytes]]] = []
        self._next_slot = 0
        self._host_views: dict[int, object] = {}  # host pool data_ptr -> CUDA view (or None)
        with torch.cuda.device(device):
            self._views = self._open(specs)
            self._load_stream = torch.cuda.Stream(device, priority=-1)  # loads go first
            self._store_stream = torch.cuda.Stream(device)

    def _open(self, specs: list[BufferSpec]) -> list:
        from radixkv.kvbuffers import decode_cuda_handle
        torch = _torch()
        need = self.layout.buffer_bytes(self.num_pages)
        storages: dict[bytes, object] = {}
        spans = []
        for i, spec in enumerate(specs):
            where = f"buffer {i} ({buffer_name(self.layout, i)})"
            st = storages.get(spec.handle)
            if st is None:
                try:
                    args = decode_cuda_handle(spec.handle)
                except ValueError as e:
                    raise DeviceOpenError(f"{where}: {e}") from None
                if args[0] != self.device:
                    raise DeviceOpenError(f"{where}: exported from cuda:{args[0]}, but the engine's device is cuda:{self.device}")
                try:
                    st = torch.UntypedStorage._new_shared_cuda(*args)
                except RuntimeError as e:
                    raise DeviceOpenError(f"{where}: cannot open the CUDA IPC handle (engine gone, or another host?): {e}") from None
                storages[spec.handle] = st
            if spec.size < need or spec.offset + need > st.nbytes():
                raise DeviceOpenError(
                    f"{where}: needs {need} bytes ({self.num_pages} pages x {self.layout.chunk_bytes}) at offset "
                    f"{spec.offset}; spec size {spec.size}, shared storage {st.nbytes()} bytes"
                )
            spans.append((st, spec.offset))
        width = element_width(self.layout.chunk_bytes, *(off + st.data_ptr() for st, off in spans))
        self._dtype = _wide(torch, width)
        self._cols = self.layout.chunk_bytes // width
        views = []
        for st, off in spans:
            t = torch.empty(0, dtype=torch.uint8, device=self._dev).set_(st, off, (need,))
            views.append(t.view(self._dtype).view(self.num_pages, self._cols))
        self._storages = list(storages.values())
        return views

    # -- copies ------------------------------------------------------------------------

    def submit_load(self, host_pool, host_pages: bytes, device_pages: bytes) -> CopyJob:
        return self._submit(host_pool, host_pages, device_pages, to_host=False)

    def submit_store(self, device_pages: bytes, host_pool, host_pages: bytes) -> CopyJob:
        return self._submit(host_pool, host_pages, device_pages, to_host=True)

    def _submit(self, host_pool, host_pages: bytes, device_pages: bytes, to_host: bool) -> CopyJob:
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
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                h3 = self._host_view(host_pool)
                if h3 is None:
                    self._copy_chunks(host_pool, host, dev, views, events, stream, to_host)
                else:
                    hidx, didx = self._index(host_pages), self._index(device_pages)
                    if to_host:
                        self._store(h3, views, hidx, didx)
                    else:
                        self._load(h3, views, hidx, didx, events, stream)
                done = torch.cuda.Event(blocking=True)
                done.record(stream)
        except RuntimeError as e:
            raise CopyError(f"CUDA copy could not be enqueued: {e}") from e
        return CopyJob(list(handles), lambda: _synchronize(done, self.device))

    def _load(self, h3, views, hidx, didx, events, stream) -> None:
        bpl = self.layout.buffers_per_layer
        for layer in range(self.layout.num_layers):
            src_layer = h3.narrow(1, layer * bpl, bpl)
            for lo, hi in self._groups(len(hidx), bpl):
                src = src_layer.index_select(0, hidx[lo:hi])  # reads host pages over PCIe
                for j in range(bpl):
                    views[layer * bpl + j].index_copy_(0, didx[lo:hi], src[:, j])
            events[layer].record(stream)

    def _store(self, h3, views, hidx, didx) -> None:
        torch = _torch()
        bpl = self.layout.buffers_per_layer
        for layer in range(self.layout.num_layers):
            dst_layer = h3.narrow(1, layer * bpl, bpl)
            for lo, hi in self._groups(len(hidx), bpl):
                tmp = torch.stack([views[layer * bpl + j].index_select(0, didx[lo:hi]) for j in range(bpl)], dim=1)
                dst_layer.index_copy_(0, hidx[lo:hi], tmp)  # writes host pages over PCIe

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

    def _groups(self, n: int, bpl: int):
        per = max(1, MAX_TEMP_BYTES // (bpl * self.layout.chunk_bytes))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    def _index(self, pages: bytes):
        torch = _torch()
        idx = torch.frombuffer(bytearray(pages), dtype=torch.int32).long().pin_memory()
        return idx.to(self._dev, non_blocking=True)  # pinned: does not wait for the stream

    def _host_view(self, host_pool):
        """The host pool as a CUDA tensor [pages, buffers, cols] (zero-copy), or None."""
        torch = _torch()
        key = host_pool.tensor.data_ptr()
        if key in self._host_views:
            return self._host_views[key]
        view = None
        if host_pool.pinned:
            try:
                st = torch._C._construct_storage_from_data_pointer(key, self._dev, host_pool.nbytes)
                flat = torch.empty(0, dtype=torch.uint8, device=self._dev).set_(st, 0, (host_pool.nbytes,))
                view = flat.view(self._dtype).view(host_pool.num_pages, self.layout.num_buffers, self._cols)
            except (AttributeError, RuntimeError) as e:
                log.warning("no device view of the host pool (%s); copying page by page", e)
        else:
            log.warning("host pool is not pinned; CUDA copies go page by page through pageable memory")
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

    def __repr__(self) -> str:
        return f"CudaDeviceBuffers(device=cuda:{self.device}, pages={self.num_pages})"


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


__all__ = ["CudaDeviceBuffers", "EVENT_RING", "cuda_available", "pin_host", "unpin_host"]
