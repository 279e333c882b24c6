"""Engine side of the data path: hand the engine's KV buffers to the daemon.

The daemon copies KV pages itself, so at Register the engine describes where each of
its `layout.num_buffers` buffers lives (layer-major: layer 0 K, layer 0 V, layer 1 K,
...), one `BufferSpec` per buffer:

- `ShmKvBuffers` (machines without a GPU, tests, the simulator): the engine creates one
  POSIX shared-memory segment holding every buffer back to back; handle = segment name.
- `CudaKvBuffers` (GPU): the engine's own CUDA tensors, exported as CUDA IPC handles
  (`radixkv.cuda_handle`). Load-back replies carry one IPC event per layer; `wait_events`
  turns them into events a stream can wait on.

The engine owns the memory: it keeps the buffers alive while the daemon may copy
(until it unregisters) and frees them itself. Nothing here imports the daemon.
"""

import errno
import mmap
import os
import secrets
from multiprocessing import shared_memory
from typing import NamedTuple

import numpy as np
import torch

from .cuda_handle import encode_cuda_handle
from .layout import KvLayout

SHM_DIR = "/dev/shm"
ALIGN = 64  # each buffer starts on a 64-byte boundary inside the segment


class BufferSpec(NamedTuple):
    """Where one buffer lives: `handle` names the memory (shm segment name in utf-8, or an
    encoded CUDA IPC handle), the buffer starts `offset` bytes into it and spans `size`
    bytes. Page p of the buffer is the `page_bytes` bytes at `offset + p * page_stride`
    (0: the layout's per-buffer chunk, and contiguous pages), so any engine layout is
    described as whole opaque pages. The daemon uses this same class (it may import
    `radixkv`, never the reverse)."""

    handle: bytes
    offset: int
    size: int
    page_stride: int = 0
    page_bytes: int = 0


def torch_dtype(layout: KvLayout) -> torch.dtype:
    """The torch dtype named by `layout.dtype`."""
    return getattr(torch, layout.dtype)


class ShmKvBuffers:
    """All KV buffers of one engine in one POSIX shared-memory segment.

    Buffer b occupies bytes [b * stride, b * stride + buffer_bytes) with `stride` the
    buffer size rounded up to 64 bytes. Use `create` (the engine: owns and unlinks the
    segment) or `attach` (another process: maps it, never unlinks it)."""

    def __init__(self, layout: KvLayout, num_pages: int, name: str, buf, owner, mapping):
        self.layout = layout
        self.num_pages = num_pages
        self.name = name
        self.stride = _round_up(layout.buffer_bytes(num_pages), ALIGN)
        self._owner = owner        # the (closed) SharedMemory when we created it: unlinks
        self._mapping = mapping    # our own mmap of the segment
        self._bytes: torch.Tensor | None = exporting_bytes(buf, self.nbytes)

    @classmethod
    def create(cls, layout: KvLayout, num_pages: int, name: str | None = None) -> "ShmKvBuffers":
        """Create a zero-filled segment for `num_pages` pages of every buffer, its memory
        committed here (charged to this process, the engine: left sparse, the daemon's
        mapping would leave it uncommitted and each first copy into a page would fault).
        `name` defaults to a fresh "radixkv_<pid>_<random>". Raises ValueError on a bad
        size, FileExistsError if the name is taken, OSError (ENOSPC) when /dev/shm has
        no room for it."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        size = layout.num_buffers * _round_up(layout.buffer_bytes(num_pages), ALIGN)
        name = name or f"radixkv_{os.getpid()}_{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        try:  # map it ourselves: SharedMemory.close() fails while tensors view its buffer
            _commit(shm.name, size)
            m = _map(shm.name, size)
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close()
        return cls(layout, num_pages, shm.name, m, shm, m)

    @classmethod
    def attach(cls, layout: KvLayout, num_pages: int, name: str) -> "ShmKvBuffers":
        """Map an existing segment without taking ownership: `close` unmaps, never unlinks
        (unlike SharedMemory on Python < 3.13, whose resource tracker would unlink it at
        exit). Raises FileNotFoundError, or ValueError when the segment is too small."""
        name = name.lstrip("/")
        m = _map(name, layout.num_buffers * _round_up(layout.buffer_bytes(num_pages), ALIGN))
        return cls(layout, num_pages, name, m, None, m)

    @property
    def nbytes(self) -> int:
        """Bytes of the segment that hold buffers."""
        return self.layout.num_buffers * self.stride

    # -- views of the engine's buffers ------------------------------------------------

    def buffer(self, index: int) -> torch.Tensor:
        """Buffer `index` as [num_pages * page_size, num_kv_heads, head_dim] of the layout's dtype."""
        lay = self.layout
        return self._raw(index).view(torch_dtype(lay)).view(
            self.num_pages * lay.page_size, lay.num_kv_heads, lay.head_dim)

    def k(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K buffer (mha)."""
        return self.buffer(self._index(layer, 0, "k", "mha"))

    def v(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s V buffer (mha)."""
        return self.buffer(self._index(layer, 1, "v", "mha"))

    def kv(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s only buffer (mla)."""
        return self.buffer(self._index(layer, 0, "kv", "mla"))

    def page_view(self, index: int) -> torch.Tensor:
        """Buffer `index` as uint8 [num_pages, chunk_bytes]: row p is device page p."""
        return self._raw(index).view(self.num_pages, self.layout.chunk_bytes)

    def specs(self) -> list[BufferSpec]:
        """One BufferSpec per buffer, layer-major, for Register."""
        handle = self.name.encode()
        size = self.layout.buffer_bytes(self.num_pages)
        return [BufferSpec(handle, b * self.stride, size) for b in range(self.layout.num_buffers)]

    def close(self) -> None:
        """Drop this process's mapping; the creator also unlinks the segment (a daemon
        that still maps it keeps its mapping). Idempotent. Tensors handed out earlier
        keep the memory mapped until they are freed."""
        if self._bytes is None:
            return
        self._bytes = None
        if self._owner is not None:
            try:
                self._owner.unlink()
            except FileNotFoundError:
                pass
        _close_quietly(self._mapping)

    def _raw(self, index: int) -> torch.Tensor:
        if self._bytes is None:
            raise ValueError(f"shared-memory KV buffers {self.name!r} are closed")
        if not 0 <= index < self.layout.num_buffers:
            raise IndexError(f"buffer {index} out of range 0..{self.layout.num_buffers - 1}")
        start = index * self.stride
        return self._bytes[start:start + self.layout.buffer_bytes(self.num_pages)]

    def _index(self, layer: int, j: int, what: str, fmt: str) -> int:
        if self.layout.kv_format != fmt:
            other = "kv(layer)" if fmt == "mha" else "k(layer) / v(layer)"
            raise ValueError(f"{what}(layer) needs kv_format {fmt!r}; this layout is {self.layout.kv_format!r}: use {other}")
        return self.layout.buffer_index(layer, j)

    def __repr__(self) -> str:
        return f"ShmKvBuffers(name={self.name!r}, pages={self.num_pages}, nbytes={self.nbytes})"


class CudaKvBuffers:
    """Export CUDA tensors the engine allocated, and wait on load-back events."""

    @staticmethod
    def num_pages(layout: KvLayout, tensors: list[torch.Tensor]) -> int:
        """Whole pages every tensor holds (the smallest, when they differ)."""
        if not tensors:
            raise ValueError("no tensors given")
        return min(t.numel() * t.element_size() for t in tensors) // layout.chunk_bytes

    @staticmethod
    def export(layout: KvLayout, tensors: list[torch.Tensor], device: int) -> "CudaExport":
        """BufferSpecs for `tensors`, one per buffer in layer-major order, each a contiguous
        CUDA tensor on `device` with the layout's dtype, token-major. The handle shares the
        tensor's storage through CUDA IPC; every export is one consumer reference, which
        torch counts, so each Register needs its own: the client re-exports the returned
        list (`CudaExport.fresh`) for every automatic re-registration, and an engine that
        registers again itself calls `export` again. Raises ValueError naming the bad tensor."""
        return CudaExport(layout, tensors, device)

    @staticmethod
    def _specs(layout: KvLayout, tensors: list[torch.Tensor], device: int) -> list[BufferSpec]:
        if len(tensors) != layout.num_buffers:
            raise ValueError(f"{len(tensors)} tensors given, layout needs {layout.num_buffers} (layer-major)")
        dtype = torch_dtype(layout)
        specs = []
        handles: dict[int, bytes] = {}  # storage -> handle: views of one storage share it
        for i, t in enumerate(tensors):
            if t.device.type != "cuda" or t.device.index != device:
                raise ValueError(f"tensor {i} is on {t.device}, expected cuda:{device}")
            if t.dtype != dtype:
                raise ValueError(f"tensor {i} has dtype {t.dtype}, layout says {layout.dtype}")
            if not t.is_contiguous():
                raise ValueError(f"tensor {i} is not contiguous; pages must be token-major runs")
            if t.numel() * t.element_size() < layout.chunk_bytes:
                raise ValueError(f"tensor {i} holds {t.numel() * t.element_size()} bytes, less than one page ({layout.chunk_bytes})")
            storage = t.untyped_storage()
            handle = handles.get(storage.data_ptr())
            if handle is None:
                handle = handles[storage.data_ptr()] = encode_cuda_handle(storage._share_cuda_())
            specs.append(BufferSpec(handle, t.storage_offset() * t.element_size(), t.numel() * t.element_size()))
        return specs

    @staticmethod
    def record_event(stream: "torch.cuda.Stream | None" = None) -> "torch.cuda.Event":
        """Record an interprocess event on `stream` (default: the current stream) and
        return it, to pass as `engine_event` to insert, evict or load_back: the daemon's
        copy waits for it on the GPU, so nothing need be synchronized on the CPU. Record
        it after the last kernel that writes (insert) or reads (load_back, evict) the
        pages. Events come from a ring of `ENGINE_EVENT_RING` per device, kept alive for
        the process (the daemon opens each handle once); re-recording one only makes a
        late copy wait a little longer, never less."""
        stream = stream if stream is not None else torch.cuda.current_stream()
        device = stream.device.index
        ring, at = _ENGINE_EVENTS.setdefault(device, ([], [0]))
        if len(ring) < ENGINE_EVENT_RING:
            with torch.cuda.device(device):
                ring.append(torch.cuda.Event(interprocess=True))
        ev = ring[at[0] % len(ring)]
        at[0] += 1
        ev.record(stream)
        return ev

    @staticmethod
    def events(handles: list[bytes], device: int) -> list["torch.cuda.Event"]:
        """The daemon's per-layer IPC events as events of this process (opened once per
        handle and cached: the daemon recycles a fixed set)."""
        out = []
        for h in handles:
            key = (device, bytes(h))
            ev = _OPENED_EVENTS.get(key)
            if ev is None:
                ev = torch.cuda.Event.from_ipc_handle(device, bytes(h))
                if len(_OPENED_EVENTS) >= _MAX_OPENED_EVENTS:
                    _OPENED_EVENTS.pop(next(iter(_OPENED_EVENTS)))
                _OPENED_EVENTS[key] = ev
            out.append(ev)
        return out

    @staticmethod
    def forget_events() -> None:
        """Drop the cache of opened events. Call when registering with a daemon (a new
        daemon, or a re-registration, has a new event ring): a cached event opened from
        an earlier daemon's handle must not stand in for a new event whose handle bytes
        happen to be equal."""
        _OPENED_EVENTS.clear()

    @staticmethod
    def wait_events(handles: list[bytes], stream: "torch.cuda.Stream") -> list["torch.cuda.Event"]:
        """Make `stream` wait for every event of a load-back (all layers); returns the
        events so an engine that overlaps layers can instead wait on `events[layer]`
        before reading that layer. Call right after the LoadBack reply arrives."""
        events = CudaKvBuffers.events(handles, stream.device.index)
        for ev in events:
            stream.wait_event(ev)
        return events


class CudaExport(list):
    """The BufferSpecs of one export (a list), able to export the same tensors again
    (`fresh`): the client calls it for each re-registration. Holds the tensors."""

    def __init__(self, layout: KvLayout, tensors: list[torch.Tensor], device: int):
        super().__init__(CudaKvBuffers._specs(layout, tensors, device))
        self._args = (layout, list(tensors), device)

    def fresh(self) -> list[BufferSpec]:
        """New BufferSpecs for the same tensors: a new IPC reference each."""
        return CudaKvBuffers._specs(*self._args)


def device_uuid(device: int) -> str:
    """"GPU-<uuid>" of this process's cuda:`device`, or "" without CUDA (the daemon then
    takes the ordinal). The daemon maps it to its own ordinal (which differs when the
    two processes see different CUDA_VISIBLE_DEVICES)."""
    if not torch.cuda.is_available() or not 0 <= device < torch.cuda.device_count():
        return ""
    uuid = str(torch.cuda.get_device_properties(device).uuid).lower()
    return uuid if uuid.startswith("gpu-") else "GPU-" + uuid


_OPENED_EVENTS: dict[tuple[int, bytes], "torch.cuda.Event"] = {}
_MAX_OPENED_EVENTS = 65536
ENGINE_EVENT_RING = 32
_ENGINE_EVENTS: dict[int, tuple[list, list[int]]] = {}  # device -> (events, [next slot])

def _commit(name: str, size: int) -> None:
    """Allocate every page of /dev/shm/<name> now (tmpfs fills them with zeros)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        free = os.statvfs(SHM_DIR)
        raise OSError(errno.ENOSPC, f"{SHM_DIR} has no room for a {size}-byte KV segment "
                      f"({free.f_bavail * free.f_frsize} bytes free of {free.f_blocks * free.f_frsize}); a "
                      "container's default is 64 MiB: give it more (docker run --shm-size, a memory-backed "
                      "emptyDir at /dev/shm)") from None
    finally:
        os.close(fd)


def _map(name: str, need: int) -> mmap.mmap:
    """Map /dev/shm/<name> read-write; ValueError when it holds fewer than `need` bytes."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        have = os.fstat(fd).st_size
        if have < need:
            raise ValueError(f"segment {name!r} holds {have} bytes, this layout and page count need {need}")
        return mmap.mmap(fd, have)
    finally:
        os.close(fd)


def exporting_bytes(buf, count: int) -> torch.Tensor:
    """The first `count` bytes of `buf` (an mmap) as a uint8 tensor that holds a buffer
    export on it for as long as the tensor or any view of it lives: `buf.close()` then
    raises BufferError instead of unmapping memory a tensor still points at (which
    `torch.frombuffer`, holding no export, allowed: a later read crashed the process)."""
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=count))


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _close_quietly(obj) -> None:
    try:
        obj.close()
    except BufferError:  # tensors still view the memory; it is unmapped when they go
        pass


__all__ = [
    "BufferSpec", "CudaExport", "CudaKvBuffers", "ShmKvBuffers", "device_uuid", "exporting_bytes", "torch_dtype",
]
