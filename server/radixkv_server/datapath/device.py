"""DeviceBuffers: the engine's KV buffers as the daemon sees them, and the copy contract.

A backend opens the engine's buffers (CUDA IPC or POSIX shared memory) from the
`BufferSpec`s the engine sent at Register, and copies whole pages between them and
the daemon's `HostPool`: device page `device_pages[i]` (every buffer) <-> host page
`host_pages[i]` (one contiguous run, see `radixkv.layout`).

Threads: `submit_load`, `submit_store` and `CopyJob.wait` run on the copy engine's
worker threads, several at once; backends keep no per-call state outside the job.
`close` runs once no copy is in flight (the copy engine drains first).

ENGINE EVENTS. On CUDA the engine's kernels run asynchronously, so a Register, Insert,
Evict or LoadBack may arrive while its stream still writes (or reads) the pages. The
engine then sends an interprocess event recorded on that stream (`after`, the IPC
handle bytes); the CUDA backend makes its copy stream wait on it before the copy's
first kernel. Shared memory accepts and ignores it: its copies run on the CPU after
the request arrived, when the engine's CPU writes are already done.
"""

import abc
from array import array
from typing import Callable

import numpy as np

from radixkv.kvbuffers import BufferSpec  # the engine's description, one definition
from radixkv.layout import KvLayout

from ..core.pages import unpack

MAX_BUFFER_BYTES = 1 << 48  # no device or shared-memory buffer is larger (strides past it overflowed int64)


class DeviceOpenError(Exception):
    """The engine's buffers cannot be opened as described; the message says what to fix."""


class SegmentNotYours(DeviceOpenError):
    """A shared-memory segment is not owned by the user the caller's token names."""


class CopyError(Exception):
    """A copy could not be started or did not complete; the message says which and why."""


class CopyJob:
    """One submitted copy. `events` holds one CUDA IPC event handle per layer for a
    load-back on CUDA (the engine may run layer i once event i has fired); it is empty
    for stores and on shared memory. `wait()` blocks until every byte is in place and
    raises CopyError if the copy failed. Call `wait()` once, from the worker thread."""

    __slots__ = ("events", "_wait")

    def __init__(self, events: list[bytes] | None = None, wait: Callable[[], None] | None = None):
        self.events = events if events is not None else []
        self._wait = wait

    @property
    def pending(self) -> bool:
        """Whether `wait` has anything to wait for (False: the bytes are in place)."""
        return self._wait is not None

    def wait(self) -> None:
        if self._wait is not None:
            self._wait()


class DeviceBuffers(abc.ABC):
    """The engine's `layout.num_buffers` KV buffers of `num_pages` pages each."""

    layout: KvLayout
    num_pages: int
    layer_events = False  # loads come with per-layer events for the engine to wait on (CUDA)

    @abc.abstractmethod
    def submit_load(self, host_pool, host_pages: bytes, device_pages: bytes, after: bytes = b"") -> CopyJob:
        """Start copying host page `host_pages[i]` to device page `device_pages[i]`, all
        buffers. `after`: the engine's interprocess event (see ENGINE EVENTS). Raises
        CopyError (nothing copied, nothing left running) on bad page lists, an event that
        does not open, or a closed backend."""

    @abc.abstractmethod
    def submit_store(self, device_pages: bytes, host_pool, host_pages: bytes, after: bytes = b"") -> CopyJob:
        """Start copying device page `device_pages[i]` (all buffers) to host page
        `host_pages[i]`. The engine must have finished writing those pages: on its stream
        before the event `after`, or on the CPU when `after` is empty. Raises CopyError."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the mapping of the engine's memory (never frees the engine's memory).
        Idempotent. No copy may be in flight."""

    def check_pages(self, host_pool, host_pages: bytes, device_pages: bytes) -> tuple[array, array]:
        """Unpacked (host, device) page indices; CopyError when the lists do not pair up,
        an index is out of range, or the host pool's layout differs from ours."""
        if host_pool.layout.page_bytes != self.layout.page_bytes:
            raise CopyError(
                f"host pool pages are {host_pool.layout.page_bytes} bytes, device pages "
                f"{self.layout.page_bytes} bytes: the pool was made for another layout"
            )
        if len(host_pages) % 4 or len(device_pages) % 4 or len(host_pages) != len(device_pages):
            raise CopyError(
                f"page lists do not pair up: {len(host_pages)} bytes of host pages, "
                f"{len(device_pages)} bytes of device pages (packed int32, equal counts)"
            )
        host, dev = unpack(host_pages), unpack(device_pages)
        _check_range(host, host_pool.num_pages, "host")
        _check_range(dev, self.num_pages, "device")
        return host, dev


def check_overlap(spans: list[tuple[object, int, int]], layout: KvLayout, where: str = "memory") -> None:
    """DeviceOpenError when two buffers share bytes. `spans[i]` is buffer i's
    (memory, start, end): byte range [start, end) inside `memory` (a segment name, or
    None for one address space). Both backends check their buffers with this."""
    order = sorted(range(len(spans)), key=lambda i: (str(spans[i][0]), spans[i][1]))
    for a, b in zip(order, order[1:]):
        (ma, sa, ea), (mb, sb, eb) = spans[a], spans[b]
        if ma == mb and sb < ea:
            inside = where if ma is None else f"{where} {ma!r}"
            raise DeviceOpenError(
                f"buffers {a} ({buffer_name(layout, a)}) and {b} ({buffer_name(layout, b)}) overlap "
                f"in {inside}: bytes {sa}..{ea} and {sb}..{eb}")


def check_page_overlap(placed: list[tuple[object, int, int]], num_pages: int, chunk: int, layout: KvLayout,
                       where: str = "memory") -> None:
    """DeviceOpenError when two buffers share a byte of their pages. `placed[i]` is
    buffer i's (memory, offset, page stride): its page p is bytes
    [offset + p * stride, + chunk) of `memory`. Interleaved buffers (FlashInfer's K and V
    pages alternate) pass when no page of one meets a page of the other; buffers whose
    spans meet are compared in closed form (one stride) or page by page (two)."""
    spans = [(m, off, off + (num_pages - 1) * stride + chunk) for m, off, stride in placed]
    order = sorted(range(len(spans)), key=lambda i: (str(spans[i][0]), spans[i][1]))
    for x, a in enumerate(order):
        for b in order[x + 1:]:
            if spans[b][0] != spans[a][0] or spans[b][1] >= spans[a][2]:
                break  # sorted by start: no later buffer of this memory begins inside a's span
            shared = _shared_page(placed[a][1:], placed[b][1:], num_pages, chunk)
            if shared is not None:
                (pa, sa), (pb, sb) = shared
                inside = where if placed[a][0] is None else f"{where} {placed[a][0]!r}"
                raise DeviceOpenError(
                    f"buffers {a} ({buffer_name(layout, a)}) and {b} ({buffer_name(layout, b)}) overlap in "
                    f"{inside}: page {pa} of one is bytes {sa}..{sa + chunk}, page {pb} of the other "
                    f"{sb}..{sb + chunk}")


def _shared_page(a: tuple[int, int], b: tuple[int, int], n: int, chunk: int):
    """((page, start) of a, (page, start) of b) for two pages of buffers a and b
    ((offset, stride) each, n pages of `chunk` bytes) that share bytes, or None."""
    (oa, sa), (ob, sb) = a, b
    if sa == sb:  # page p of a starts (oa - ob) + (p - q) * s after page q of b
        d = oa - ob
        for k in (-d // sa, -d // sa + 1):
            k = max(-(n - 1), min(n - 1, k))
            if abs(d + k * sa) < chunk:
                p = max(k, 0)
                return (p, oa + p * sa), (p - k, ob + (p - k) * sb)
        return None
    starts = np.concatenate([oa + np.arange(n, dtype=np.int64) * sa, ob + np.arange(n, dtype=np.int64) * sb])
    order = np.argsort(starts, kind="stable")
    close = np.flatnonzero(np.diff(starts[order]) < chunk)
    if not len(close):
        return None
    i, j = sorted((int(order[close[0]]), int(order[close[0] + 1])))  # one of a (< n), one of b
    return (i, int(starts[i])), (j - n, int(starts[j]))


def _check_range(pages: array, limit: int, what: str) -> None:
    if pages and (min(pages) < 0 or max(pages) >= limit):
        bad = min(pages) if min(pages) < 0 else max(pages)
        raise CopyError(f"{what} page {bad} out of range 0..{limit - 1}")


def page_runs(host: array, dev: array) -> list[tuple[int, int, int]]:
    """Split paired page lists into runs (h0, d0, n): host pages h0..h0+n-1 pair with
    device pages d0..d0+n-1. A run descending in both lists is returned ascending."""
    runs = []
    i, n = 0, len(host)
    while i < n:
        j = i + 1
        step = 0
        if j < n and host[j] - host[i] == dev[j] - dev[i] and abs(host[j] - host[i]) == 1:
            step = host[j] - host[i]
            while j < n and host[j] - host[j - 1] == step and dev[j] - dev[j - 1] == step:
                j += 1
        if step < 0:
            runs.append((host[j - 1], dev[j - 1], j - i))
        else:
            runs.append((host[i], dev[i], j - i))
        i = j
    return runs


def element_width(*sizes: int) -> int:
    """Widest element (8, 4, 2 or 1 bytes) dividing every size and offset given: copies
    move that many bytes per element, which makes torch's copy kernels much faster."""
    for w in (8, 4, 2):
        if all(s % w == 0 for s in sizes):
            return w
    return 1


def buffer_geometry(layout: KvLayout, specs: list[BufferSpec]) -> tuple[int, list[int]]:
    """(page bytes per buffer, page stride of each buffer) for `specs`. Without
    `page_bytes`, the layout's `num_buffers` buffers of `chunk_bytes` each; with it,
    any number of buffers of one `page_bytes`, adding up to the layout's page. A stride
    of 0 means contiguous pages. Raises DeviceOpenError saying what does not fit."""
    sizes = {s.page_bytes for s in specs}
    if sizes == {0} or not specs:
        if len(specs) != layout.num_buffers:
            raise DeviceOpenError(
                f"{len(specs)} buffers given, layout needs {layout.num_buffers} "
                f"({layout.num_layers} layers x {layout.buffers_per_layer} for {layout.kv_format!r}, "
                "layer-major: layer 0 K, layer 0 V, layer 1 K, ...), or buffers with page_bytes set")
        chunk = layout.chunk_bytes
    elif len(sizes) != 1 or 0 in sizes:
        raise DeviceOpenError(f"buffers give different page_bytes {sorted(sizes)}: set one page_bytes on every buffer")
    else:
        chunk = sizes.pop()
        if chunk * len(specs) != layout.page_bytes:
            raise DeviceOpenError(
                f"{len(specs)} buffers x page_bytes {chunk} = {chunk * len(specs)} bytes per page, but the "
                f"layout's page is {layout.page_bytes} bytes ({layout.num_buffers} x {layout.chunk_bytes})")
    strides = [s.page_stride or chunk for s in specs]
    for i, stride in enumerate(strides):
        if stride < chunk:
            raise DeviceOpenError(f"buffer {i}: page_stride {stride} is less than its page_bytes {chunk} (pages would overlap)")
        if stride > MAX_BUFFER_BYTES:
            raise DeviceOpenError(f"buffer {i}: page_stride {stride} is past any buffer (at most {MAX_BUFFER_BYTES} bytes)")
    return chunk, strides


def buffer_name(layout: KvLayout, index: int) -> str:
    """Human name of buffer `index`: "layer 3 K", "layer 3 V", "layer 3 KV" (mla);
    "buffer 7" past the layout's buffers (buffers described by page_bytes)."""
    if index >= layout.num_buffers:
        return f"buffer {index}"
    layer, j = divmod(index, layout.buffers_per_layer)
    part = "KV" if layout.buffers_per_layer == 1 else "KV"[j]
    return f"layer {layer} {part}"


__all__ = [
    "BufferSpec", "CopyError", "CopyJob", "DeviceBuffers", "DeviceOpenError",
    "buffer_geometry", "buffer_name", "check_overlap", "check_page_overlap", "element_width", "page_runs",
]
