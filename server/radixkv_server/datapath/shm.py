"""ShmDeviceBuffers: engine KV buffers in POSIX shared memory (machines without a GPU).

The engine creates the segments and owns them (it unlinks them). The daemon maps
`/dev/shm/<name>` with os.open + mmap and never unlinks: Python < 3.13's
`multiprocessing.shared_memory.SharedMemory` registers even a segment it merely
attached to with the resource tracker, which unlinks it when the daemon exits and so
destroys the engine's KV cache. Each segment is mapped once, however many buffers
name it.

Copies move whole pages: each run of consecutive pages (a scattered page is a run of
one) becomes one numpy slice assignment per group of evenly spaced buffers ("stack"),
on numpy views of the same memory: a numpy call costs about a microsecond, a torch
slice-and-copy_ several (four tensor views and a TensorIterator per page), which
dominated scattered 64 KiB pages. Only when per-call copies would be tiny do scattered
pages use index_select / index_copy_ per buffer. Both release the GIL for copies of more
than a few hundred elements, so copy workers run in parallel.
"""

import mmap
import os

import torch

from radixkv.layout import KvLayout

from .device import (
    BufferSpec, CopyError, CopyJob, DeviceBuffers, DeviceOpenError, buffer_geometry, buffer_name,
    check_overlap, element_width, page_runs,
)

SHM_DIR = "/dev/shm"
RUN_COPY_MIN_BYTES = 4 << 10  # below this per slice copy, index_select/index_copy_ is faster
_WIDE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class ShmDeviceBuffers(DeviceBuffers):
    """Open `specs` (handle = segment name, utf-8) as `layout.num_buffers` buffers of
    `num_pages` pages. Raises DeviceOpenError naming the segment and the sizes
    expected and found. Copies complete inside `submit_*`; `CopyJob.wait` is a no-op.
    An engine event (`after`) is accepted and ignored: nothing runs asynchronously here."""

    def __init__(self, layout: KvLayout, num_pages: int, specs: list[BufferSpec]):
        self.layout = layout
        self.num_pages = num_pages
        self._maps: dict[str, mmap.mmap] = {}
        self._views: list[torch.Tensor] | None = None
        self._stacks: list[tuple[int, torch.Tensor]] | None = None
        self._np_stacks: list | None = None
        try:
            self._open(specs)
        except BaseException:
            self.close()
            raise

    def _open(self, specs: list[BufferSpec]) -> None:
        chunk, strides = buffer_geometry(self.layout, specs)
        placed = []  # (segment name, offset, page stride) per buffer
        for i, spec in enumerate(specs):
            name = _segment_name(spec.handle, i, self.layout)
            if name not in self._maps:
                self._maps[name] = _map_segment(name)
            have = len(self._maps[name])
            need = (self.num_pages - 1) * strides[i] + chunk
            where = f"buffer {i} ({buffer_name(self.layout, i)}) in segment {name!r}"
            if spec.size < need:
                raise DeviceOpenError(
                    f"{where}: spec size {spec.size} bytes, need {need} "
                    f"({self.num_pages} pages of {chunk} bytes, {strides[i]} bytes apart)"
                )
            if spec.offset + need > have:
                raise DeviceOpenError(
                    f"{where}: needs bytes {spec.offset}..{spec.offset + need} but the segment "
                    f"is only {have} bytes"
                )
            placed.append((name, spec.offset, strides[i]))
        # Buffers of contiguous pages must not share bytes; strided ones interleave by
        # design (FlashInfer's K and V pages alternate): their description is trusted.
        dense = [(n, off, off + self.num_pages * chunk) if stride == chunk else (i, 0, 0)
                 for i, (n, off, stride) in enumerate(placed)]
        check_overlap(dense, self.layout, "segment")
        width = element_width(chunk, *(off for _, off, _ in placed), *strides)
        self._dtype = _WIDE[width]
        self._width = width
        segs = {n: _segment_tensor(m, width) for n, m in self._maps.items()}
        cols = chunk // width
        self._views = [
            segs[n].as_strided((self.num_pages, cols), (stride // width, 1), off // width)
            for n, off, stride in placed
        ]
        self._stacks = _stacks(placed, segs, self.num_pages, cols, width)
        # [num_pages, m, cols] numpy views of the stacks (page first, like the host pool).
        self._np_stacks = [(b0, st.transpose(0, 1).numpy()) for b0, st in self._stacks]

    # -- copies ------------------------------------------------------------------------

    def submit_load(self, host_pool, host_pages: bytes, device_pages: bytes, after: bytes = b"") -> CopyJob:
        self._copy(host_pool, host_pages, device_pages, to_host=False)
        return CopyJob()

    def submit_store(self, device_pages: bytes, host_pool, host_pages: bytes, after: bytes = b"") -> CopyJob:
        self._copy(host_pool, host_pages, device_pages, to_host=True)
        return CopyJob()

    def _copy(self, host_pool, host_pages: bytes, device_pages: bytes, to_host: bool) -> None:
        views, stacks = self._views, self._np_stacks
        if views is None or stacks is None:
            raise CopyError("shared-memory device buffers are closed")
        host, dev = self.check_pages(host_pool, host_pages, device_pages)
        if not host:
            return
        pool = host_pool.tensor
        if pool is None:
            raise CopyError("host pool is closed")
        h3 = pool.view(self._dtype).view(host_pool.num_pages, len(views), -1)
        runs = page_runs(host, dev)
        calls = len(runs) * len(stacks)
        try:
            # Runs cost one slice copy per (run, stack), scattered pages two index
            # passes per buffer. Slice copies win unless they are many and small.
            if calls <= 2 * len(views) or len(host) * host_pool.layout.page_bytes >= calls * RUN_COPY_MIN_BYTES:
                _copy_runs(h3, stacks, runs, to_host)
            else:
                _copy_indexed(h3, views, _index(host_pages), _index(device_pages), to_host)
        except RuntimeError as e:
            raise CopyError(f"shared-memory copy failed: {e}") from e

    def close(self) -> None:
        """Unmap the segments (the engine's segments stay). Idempotent."""
        self._views = self._stacks = self._np_stacks = None
        maps, self._maps = self._maps, {}
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a view escaped; the mapping goes when it is collected
                pass

    def __repr__(self) -> str:
        return f"ShmDeviceBuffers(segments={sorted(self._maps)}, pages={self.num_pages})"


def _copy_runs(h3, stacks, runs, to_host: bool) -> None:
    """Per stack (b0, [num_pages, m, cols] numpy view), one slice assignment per run:
    host pages h0..h0+n-1, buffers b0..b0+m-1 <-> device pages d0..d0+n-1."""
    hn = h3.numpy()
    for b0, dn in stacks:
        hs = hn[:, b0:b0 + dn.shape[1]]
        if to_host:
            for h0, d0, n in runs:
                hs[h0:h0 + n] = dn[d0:d0 + n]
        else:
            for h0, d0, n in runs:
                dn[d0:d0 + n] = hs[h0:h0 + n]


def _copy_indexed(h3, views, hidx, didx, to_host: bool) -> None:
    for b, v in enumerate(views):
        if to_host:
            h3[:, b].index_copy_(0, hidx, v.index_select(0, didx))
        else:
            v.index_copy_(0, didx, h3[:, b].index_select(0, hidx))


def _index(pages: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(pages), dtype=torch.int32).long()


def _segment_name(handle: bytes, index: int, layout: KvLayout) -> str:
    what = f"buffer {index} ({buffer_name(layout, index)})"
    try:
        name = bytes(handle).decode("utf-8")
    except UnicodeDecodeError:
        raise DeviceOpenError(f"{what}: handle is not a utf-8 shared-memory segment name: {bytes(handle)[:64]!r}") from None
    name = name[1:] if name.startswith("/") else name
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise DeviceOpenError(f"{what}: {name!r} is not a shared-memory segment name (no '/', not empty)")
    return name


def _map_segment(name: str) -> mmap.mmap:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise DeviceOpenError(
            f"shared-memory segment {name!r} not found ({path}): the engine must create it on "
            "this host and keep it until it unregisters"
        ) from None
    except OSError as e:
        raise DeviceOpenError(f"cannot open shared-memory segment {name!r} ({path}): {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise DeviceOpenError(f"shared-memory segment {name!r} ({path}) is empty (0 bytes)")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _segment_tensor(m: mmap.mmap, width: int) -> torch.Tensor:
    usable = len(m) - len(m) % width
    return torch.frombuffer(m, dtype=torch.uint8, count=usable).view(_WIDE[width])


def _stacks(placed, segs, num_pages: int, cols: int, width: int) -> list[tuple[int, torch.Tensor]]:
    """Group consecutive buffers that sit in one segment at one fixed distance (and one
    page stride) into one [m, num_pages, cols] view, so a run of pages copies all of
    them in one call."""
    groups: list[list[int]] = []
    for i, (name, off, pstride) in enumerate(placed):
        g = groups[-1] if groups else None
        if g is not None and placed[g[0]][0] == name and placed[g[0]][2] == pstride:
            stride = off - placed[g[-1]][1]
            first = placed[g[1]][1] - placed[g[0]][1] if len(g) > 1 else stride
            if stride > 0 and stride == first:
                g.append(i)
                continue
        groups.append([i])
    out = []
    for g in groups:
        name, off0, pstride = placed[g[0]]
        stride = (placed[g[1]][1] - off0) // width if len(g) > 1 else num_pages * cols
        st = segs[name].as_strided((len(g), num_pages, cols), (stride, pstride // width, 1), off0 // width)
        out.append((g[0], st))
    return out


__all__ = ["SHM_DIR", "ShmDeviceBuffers"]
