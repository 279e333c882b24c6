"""ShmDeviceBuffers: engine KV buffers in POSIX shared memory (machines without a GPU).

The engine creates the segments and owns them (it unlinks them). The daemon maps
`/dev/shm/<name>` with os.open + mmap and never unlinks: Python < 3.13's
`multiprocessing.shared_memory.SharedMemory` registers even a segment it merely
attached to with the resource tracker, which unlinks it when the daemon exits and so
destroys the engine's KV cache. Each segment is mapped once, however many buffers
name it.

Copies move whole pages. The page lists split into single pages and runs of
consecutive pages without Python work per page in the common shapes (all scattered,
one run); then every page or run is one numpy assignment per group of evenly spaced
buffers ("stack"), on numpy views of the same memory whose elements are whole chunks
(numpy void, one memmove each): under a microsecond of call overhead, where a torch
slice-and-copy_ costs several. The host side is the pool's cached chunk view
(`HostPool.chunks`). A vectorized gather then scatter (index_select + index_copy_, numpy
take + fancy assignment, structured dtypes with one field per page) moves every byte
twice through a temporary or pays per-field setup, and measured slower from 16 KiB
pages up. Only when per-call copies would be tiny do scattered pages use index_select /
index_copy_ per buffer. Both release the GIL for copies of more than a few hundred
bytes, so copy workers run in parallel.
"""

import errno
import mmap
import os
import stat
from array import array
from itertools import compress, islice
from operator import eq, sub

import numpy as np
import torch

from radixkv.kvbuffers import exporting_bytes
from radixkv.layout import KvLayout

from .device import (
    BufferSpec, CopyError, CopyJob, DeviceBuffers, DeviceOpenError, SegmentNotYours, buffer_geometry, buffer_name,
    check_page_overlap, element_width,
)

SHM_DIR = "/dev/shm"
RUN_COPY_MIN_BYTES = 4 << 10  # below this per slice copy, index_select/index_copy_ is faster
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
_WIDE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class ShmDeviceBuffers(DeviceBuffers):
    """Open `specs` (handle = segment name, utf-8) as `layout.num_buffers` buffers of
    `num_pages` pages. Raises DeviceOpenError naming the segment and the sizes
    expected and found; SegmentNotYours for a segment not owned by `owner_uid` (when given). Copies complete inside `submit_*`; `CopyJob.wait` is a no-op.
    An engine event (`after`) is accepted and ignored: nothing runs asynchronously here."""

    def __init__(self, layout: KvLayout, num_pages: int, specs: list[BufferSpec], owner_uid: int | None = None):
        self.layout = layout
        self.num_pages = num_pages
        self._maps: dict[str, mmap.mmap] = {}
        self._fds: dict[str, int] = {}  # kept open to see a segment shrink (see _check_sizes)
        self._views: list[torch.Tensor] | None = None
        self._stacks: list[tuple[int, torch.Tensor]] | None = None
        self._np_stacks: list | None = None
        try:
            self._open(specs, owner_uid)
        except BaseException:
            self.close()
            raise

    def _open(self, specs: list[BufferSpec], owner_uid: int | None) -> None:
        chunk, strides = buffer_geometry(self.layout, specs)
        placed = []  # (segment name, offset, page stride) per buffer
        for i, spec in enumerate(specs):
            name = _segment_name(spec.handle, i, self.layout)
            if name not in self._maps:
                self._fds[name], self._maps[name] = _map_segment(name, owner_uid)
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
        check_page_overlap(placed, self.num_pages, chunk, self.layout, "segment")
        width = element_width(chunk, *(off for _, off, _ in placed), *strides)
        self._dtype = _WIDE[width]
        self._width = width
        self._chunk = chunk
        segs = {n: _segment_tensor(m, width) for n, m in self._maps.items()}
        cols = chunk // width
        self._views = [
            segs[n].as_strided((self.num_pages, cols), (stride // width, 1), off // width)
            for n, off, stride in placed
        ]
        self._stacks = _stacks(placed, segs, self.num_pages, cols, width)
        # [num_pages, m] numpy views of the stacks, page first like the host pool, each
        # element one buffer chunk (void).
        self._np_stacks = [(b0, _void(st.transpose(0, 1).numpy())) for b0, st in self._stacks]

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
        self._check_sizes()
        try:
            hn = host_pool.chunks(self._chunk)
        except ValueError as e:
            raise CopyError(str(e)) from None
        singles, runs = _runs(host, dev)
        calls = (len(singles[0]) + len(runs)) * len(stacks)
        try:
            # Runs cost one slice copy per (run, stack), scattered pages two index
            # passes per buffer. Slice copies win unless they are many and small.
            if calls <= 2 * len(views) or len(host) * host_pool.layout.page_bytes >= calls * RUN_COPY_MIN_BYTES:
                _copy_runs(hn, stacks, singles, runs, to_host)
            else:
                h3 = host_pool.tensor.view(self._dtype).view(host_pool.num_pages, len(views), -1)
                _copy_indexed(h3, views, _index(host_pages), _index(device_pages), to_host)
        except RuntimeError as e:
            raise CopyError(f"shared-memory copy failed: {e}") from e

    def _check_sizes(self) -> None:
        """CopyError when a segment is smaller than when it was mapped: touching its
        mapping past the new end would kill the daemon (SIGBUS). A segment that shrinks
        while a copy runs still does: docs/reliability.md, tenant model."""
        for name, fd in self._fds.items():
            try:
                size = os.fstat(fd).st_size
            except OSError as e:
                raise CopyError(f"shared-memory segment {name!r}: {e.strerror}") from None
            if size < len(self._maps[name]):
                raise CopyError(f"shared-memory segment {name!r} shrank from {len(self._maps[name])} to {size} bytes "
                                "since Register: the engine must keep its segments whole while registered")

    def close(self) -> None:
        """Unmap the segments (the engine's segments stay). Idempotent."""
        self._views = self._stacks = self._np_stacks = None
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
        maps, self._maps = self._maps, {}
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a copy still holds a view: unmapped when the last view goes
                pass

    def __repr__(self) -> str:
        return f"ShmDeviceBuffers(segments={sorted(self._maps)}, pages={self.num_pages})"


def _runs(host: array, dev: array) -> tuple[tuple[array, array], list[tuple[int, int, int]]]:
    """Split checked, paired page lists into single pages ((host pages, device pages))
    and runs of more than one [(h0, d0, n)] exactly as `device.page_runs` does (host pages
    h0..h0+n-1 pair with device pages d0..d0+n-1; a run descending in both lists is
    returned ascending), without Python work per page: neighbours can only continue a
    run where they keep one host - device offset (compared with `map`), and only those
    candidates, usually none or few in scattered lists, are looked at one by one. One
    ascending run is recognised whole."""
    n = len(host)
    if n < 2:
        return (host, dev), []
    off = list(map(sub, host, dev))
    same = list(map(eq, islice(off, 1, None), off))  # True at i: pages i, i+1 may run on
    if not any(same):
        return (host, dev), []
    h0 = host[0]
    if all(same) and host[-1] - h0 == n - 1 and host.tobytes() == array("i", range(h0, h0 + n)).tobytes():
        return (array("i"), array("i")), [(h0, dev[0], n)]
    spans = []  # [first page index, last page index, step] of each run, in order
    for i in compress(range(n - 1), same):
        step = host[i + 1] - host[i]
        if step not in (1, -1):
            continue
        last = spans[-1] if spans else None
        if last is not None and last[1] == i and last[2] == step:
            last[1] = i + 1  # the run goes on
        elif last is None or last[1] < i:  # page i is free (greedy: an earlier run did not end on it)
            spans.append([i, i + 1, step])
    if not spans:
        return (host, dev), []
    hosts, devs, runs, prev = array("i"), array("i"), [], 0
    for first, end, step in spans:
        hosts += host[prev:first]
        devs += dev[prev:first]
        at = first if step > 0 else end
        runs.append((host[at], dev[at], end - first + 1))
        prev = end + 1
    hosts += host[prev:]
    devs += dev[prev:]
    return (hosts, devs), runs


def _copy_runs(hn, stacks, singles, runs, to_host: bool) -> None:
    """Per stack (b0, [num_pages, m] numpy view of chunk-sized void elements), one
    assignment per single page and per run: host pages h0..h0+n-1 (`hn`, the pool's
    chunks), buffers b0..b0+m-1 <-> device pages d0..d0+n-1."""
    hosts, devs = singles
    for b0, dn in stacks:
        hs = hn[:, b0:b0 + dn.shape[1]]
        if to_host:
            for h, d in zip(hosts, devs):
                hs[h] = dn[d]
            for h0, d0, n in runs:
                hs[h0:h0 + n] = dn[d0:d0 + n]
        else:
            for h, d in zip(hosts, devs):
                dn[d] = hs[h]
            for h0, d0, n in runs:
                dn[d0:d0 + n] = hs[h0:h0 + n]


def _void(a: np.ndarray) -> np.ndarray:
    """`a` ([..., cols], last axis contiguous) with each last-axis row one opaque element
    of cols * itemsize bytes: numpy copies each with one memmove."""
    return a.view(np.dtype((np.void, a.shape[-1] * a.itemsize)))[..., 0]


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


def _map_segment(name: str, owner_uid: int | None) -> tuple[int, mmap.mmap]:
    """(an open descriptor, a shared read-write mapping of the whole segment)."""
    path = os.path.join(SHM_DIR, name)
    try:
        # Not through a link: /dev/shm is writable by everyone, and a link planted there
        # would make the daemon write KV bytes into any file it may write.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DeviceOpenError(
            f"shared-memory segment {name!r} not found ({path}): the engine must create it on "
            "this host and keep it until it unregisters"
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DeviceOpenError(f"{path} is a symbolic link, not a shared-memory segment") from None
        raise DeviceOpenError(f"cannot open shared-memory segment {name!r} ({path}): {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_dev != os.stat(SHM_DIR).st_dev:
            raise DeviceOpenError(f"{path} is not a shared-memory segment (a regular file of {SHM_DIR}'s filesystem)")
        if owner_uid is not None and st.st_uid != owner_uid:
            raise SegmentNotYours(f"shared-memory segment {name!r} belongs to uid {st.st_uid}; this token's engines "
                                  f"may name only segments of uid {owner_uid} (uid= in the token file)")
        size = st.st_size
        if size == 0:
            raise DeviceOpenError(f"shared-memory segment {name!r} ({path}) is empty (0 bytes)")
        # Populated when the engine committed the whole segment: the daemon's page tables
        # are made here, once, not by a page fault per 4 KiB on the first copy into each
        # block (3.75 MiB of fresh blocks took 3.1 ms to load instead of 0.8 ms). A sparse
        # segment is mapped as it is: populating it would allocate the engine's KV memory
        # on the daemon's behalf, charged to the daemon's cgroup (a sidecar sized for its
        # host pool was killed by an engine's untouched KV).
        committed = st.st_blocks * 512 >= size
        flags = mmap.MAP_SHARED | (_MAP_POPULATE if committed else 0)
        return fd, mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


def _segment_tensor(m: mmap.mmap, width: int) -> torch.Tensor:
    usable = len(m) - len(m) % width
    return exporting_bytes(m, usable).view(_WIDE[width])


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
