"""Scattered-page copies on shared memory, byte for byte, in every buffer geometry.

The engine's segment is filled with random bytes; random (host, device) page lists are
stored and loaded back, and every byte of the host pool and of the whole segment
(pages copied, pages not copied, and the gaps between strided pages) is compared with
what a page-by-page reference copy gives. Sizes cover both copy strategies of
`shm.ShmDeviceBuffers` (slice copies per run, and index_select / index_copy_ for tiny
chunks), evenly spaced buffers (one stack) and buffers that are not (one stack each).
Shuffled lists with ascending and descending runs and repeated sources cover the ways
the page lists are split into single pages and runs.
"""

import mmap
import os
import random
import secrets

import pytest
import torch

from radixkv import KvLayout
from radixkv_server.core.pages import pack
from radixkv_server.datapath import BufferSpec, CopyError, HostPool, open_device_buffers

PAGES = 24
HOST_PAGES = 40


class Segment:
    """A POSIX shm segment of random bytes that the test owns (and unlinks)."""

    def __init__(self, size: int, rng: random.Random):
        self.name = f"radixkv_test_{os.getpid()}_{secrets.token_hex(4)}"
        fd = os.open(f"/dev/shm/{self.name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.map[:] = rng.randbytes(size)

    def read(self, start: int, n: int) -> bytes:
        return bytes(self.map[start:start + n])

    def close(self) -> None:
        self.map.close()
        os.unlink(f"/dev/shm/{self.name}")


def contiguous(lay: KvLayout):
    """The ShmKvBuffers layout: buffer b's pages back to back, buffers evenly spaced."""
    size = PAGES * lay.chunk_bytes
    return [(b * size, lay.chunk_bytes, 0) for b in range(lay.num_buffers)], lay.num_buffers * size, 0


def interleaved_kv(lay: KvLayout):
    """FlashInfer-like: per layer one region, page p holds K then V (page_stride 2 chunks),
    layers 64 bytes apart plus a gap, so the buffers are not evenly spaced."""
    c = lay.chunk_bytes
    layer = PAGES * 2 * c + 64
    specs = []
    for i in range(lay.num_layers):
        specs += [(i * layer, 2 * c, 0), (i * layer + c, 2 * c, 0)]
    return specs, lay.num_layers * layer, 0


def padded_blocks(lay: KvLayout):
    """vLLM-like: buffers described by page_bytes (one per layer: K and V chunks together),
    each page followed by padding (page_stride > page_bytes)."""
    pb = 2 * lay.chunk_bytes
    stride = pb + 48
    region = PAGES * stride + 16
    return [(i * region, stride, pb) for i in range(lay.num_layers)], lay.num_layers * region, pb


GEOMETRIES = {"contiguous": contiguous, "interleaved_kv": interleaved_kv, "padded_blocks": padded_blocks}
LAYOUTS = {  # chunk 8 bytes (indexed path), 4 KiB (slice path), 6 bytes (odd widths)
    "tiny": KvLayout(num_layers=3, num_kv_heads=1, head_dim=2, dtype="float16", page_size=2),
    "4k": KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16),
    "odd": KvLayout(num_layers=2, num_kv_heads=1, head_dim=3, dtype="bfloat16", page_size=1),
}


@pytest.fixture(params=[(g, lay) for g in GEOMETRIES for lay in LAYOUTS], ids=lambda p: f"{p[0]}-{p[1]}")
def rig(request):
    geometry, lname = request.param
    lay = LAYOUTS[lname]
    rng = random.Random(f"{geometry}-{lname}")
    placed, size, page_bytes = GEOMETRIES[geometry](lay)
    seg = Segment(size + 8, rng)
    chunk = page_bytes or lay.chunk_bytes
    specs = [BufferSpec(seg.name.encode(), off, (PAGES - 1) * (stride or chunk) + chunk, stride, pb)
             for off, stride, pb in placed]
    dev = open_device_buffers("shm", lay, PAGES, specs)
    pool = HostPool(lay, HOST_PAGES, pin="never")
    pool.tensor.copy_(torch.frombuffer(bytearray(rng.randbytes(pool.nbytes)), dtype=torch.uint8).view_as(pool.tensor))
    yield lay, seg, dev, pool, [(o, s or chunk) for o, s, _ in placed], chunk, rng
    dev.close()
    pool.close()
    seg.close()


def device_page(seg: Segment, placed, chunk: int, p: int) -> bytes:
    """What a host page holding device page p must hold: each buffer's chunk, in order."""
    return b"".join(seg.read(off + p * stride, chunk) for off, stride in placed)


def write_device_page(image: bytearray, placed, chunk: int, p: int, data: bytes) -> None:
    for b, (off, stride) in enumerate(placed):
        image[off + p * stride:off + p * stride + chunk] = data[b * chunk:(b + 1) * chunk]


def pages(rng: random.Random, limit: int, n: int) -> list[int]:
    """n distinct random pages below `limit`; from 6 on, positions 2..4 are a run of 3."""
    if n < 6:
        return rng.sample(range(limit), n)
    s = rng.randrange(limit - 2)
    rest = rng.sample([p for p in range(limit) if not s <= p < s + 3], n - 3)
    return rest[:2] + [s, s + 1, s + 2] + rest[2:]


def pairs(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    return pages(rng, HOST_PAGES, n), pages(rng, PAGES, n)


@pytest.mark.parametrize("n", [1, 7, PAGES])
def test_scattered_store_copies_every_byte_and_nothing_else(rig, n):
    lay, seg, dev, pool, placed, chunk, rng = rig
    for _ in range(3):
        hosts, devs = pairs(rng, n)
        expect = [pool.read_page(h) for h in range(HOST_PAGES)]
        for h, d in zip(hosts, devs):
            expect[h] = device_page(seg, placed, chunk, d)
        segment_before = seg.read(0, len(seg.map))
        dev.submit_store(pack(devs), pool, pack(hosts)).wait()
        assert [pool.read_page(h) for h in range(HOST_PAGES)] == expect
        assert seg.read(0, len(seg.map)) == segment_before  # a store never writes the engine's memory


@pytest.mark.parametrize("n", [1, 7, PAGES])
def test_scattered_load_copies_every_byte_and_nothing_else(rig, n):
    lay, seg, dev, pool, placed, chunk, rng = rig
    for _ in range(3):
        hosts, devs = pairs(rng, n)
        image = bytearray(seg.read(0, len(seg.map)))  # the whole segment: gaps and padding too
        for h, d in zip(hosts, devs):
            write_device_page(image, placed, chunk, d, pool.read_page(h))
        pool_before = [pool.read_page(h) for h in range(HOST_PAGES)]
        dev.submit_load(pool, pack(hosts), pack(devs)).wait()
        assert seg.read(0, len(seg.map)) == bytes(image)
        assert [pool.read_page(h) for h in range(HOST_PAGES)] == pool_before


def shuffled_blocks(rng: random.Random, shape: str, n: int, src_limit: int, dst_limit: int):
    """n (source, destination) page pairs: destinations distinct, sources possibly repeated.
    The destinations are blocks of consecutive pages in random order, some reversed; each
    block's sources are a run in the same direction (copied as one slice) or random
    pages, repeats allowed. shape "scattered": blocks of one page; "one_run": a single
    ascending run; "mixed": blocks of 1 to 5 pages, either kind."""
    base = rng.randrange(dst_limit - n + 1)
    dst_pages = list(range(base, base + n)) if shape != "scattered" else rng.sample(range(dst_limit), n)
    if shape == "one_run":
        start = rng.randrange(src_limit - n + 1)
        return list(range(start, start + n)), dst_pages
    blocks, i = [], 0
    while i < n:
        k = 1 if shape == "scattered" else rng.randint(1, 5)
        blocks.append(dst_pages[i:i + k])
        i += k
    rng.shuffle(blocks)
    src, dst = [], []
    for block in blocks:
        if rng.random() < 0.5:
            block.reverse()
        if len(block) > 1 and rng.random() < 0.6:
            start = rng.randrange(src_limit - len(block) + 1)
            run = list(range(start, start + len(block)))
            src += run if block[0] < block[-1] else run[::-1]
        else:
            src += [rng.randrange(src_limit) for _ in block]
        dst += block
    return src, dst


@pytest.mark.parametrize("shape", ["scattered", "one_run", "mixed"])
def test_random_permutations_with_repeated_sources_copy_byte_exact(rig, shape):
    """Loads and stores of shuffled, partly reversed pages whose sources repeat (a host
    page loaded into several device pages, a device page stored into several host
    pages): every destination page holds its source's bytes, nothing else changes."""
    lay, seg, dev, pool, placed, chunk, rng = rig
    for n in (1, 2, 9, PAGES):
        if shape == "one_run" and n == 1:
            continue
        hosts, devs = shuffled_blocks(rng, shape, n, HOST_PAGES, PAGES)
        image = bytearray(seg.read(0, len(seg.map)))
        for h, d in zip(hosts, devs):
            write_device_page(image, placed, chunk, d, pool.read_page(h))
        dev.submit_load(pool, pack(hosts), pack(devs)).wait()
        assert seg.read(0, len(seg.map)) == bytes(image), (hosts, devs)

        devs, hosts = shuffled_blocks(rng, shape, n, PAGES, HOST_PAGES)
        expect = [pool.read_page(h) for h in range(HOST_PAGES)]
        for h, d in zip(hosts, devs):
            expect[h] = device_page(seg, placed, chunk, d)
        dev.submit_store(pack(devs), pool, pack(hosts)).wait()
        assert [pool.read_page(h) for h in range(HOST_PAGES)] == expect, (hosts, devs)


def test_copies_with_a_closed_host_pool_fail_cleanly(rig):
    """The pool's chunk view is kept between copies; closing the pool drops it, so a
    later copy is refused (CopyError naming the closed pool) instead of touching freed memory."""
    lay, seg, dev, pool, placed, chunk, rng = rig
    dev.submit_store(pack([1, 0]), pool, pack([3, 5])).wait()
    pool.close()
    segment_before = seg.read(0, len(seg.map))
    with pytest.raises(CopyError, match="host pool is closed"):
        dev.submit_load(pool, pack([3]), pack([2]))
    with pytest.raises(CopyError, match="host pool is closed"):
        dev.submit_store(pack([2]), pool, pack([3]))
    assert seg.read(0, len(seg.map)) == segment_before


def test_split_into_runs_matches_page_runs():
    """The shm backend's run split (no Python work per page where it can) finds the same
    runs as `device.page_runs`, also on lists dense with near-runs, both directions,
    turns, and pages repeated on both sides."""
    from radixkv_server.core.pages import unpack
    from radixkv_server.datapath.device import page_runs
    from radixkv_server.datapath.shm import _runs

    rng = random.Random(15)
    for case in range(3000):
        n = rng.randint(1, 40)
        limit = rng.choice([3, 8, 64])
        if case % 3 == 0:
            hosts = [rng.randrange(limit) for _ in range(n)]
            devs = [rng.randrange(limit) for _ in range(n)]
        else:  # walks: mostly +-1 steps on both sides, sometimes a jump
            h, d, hosts, devs = rng.randrange(limit), rng.randrange(limit), [], []
            for _ in range(n):
                hosts.append(h)
                devs.append(d)
                step = rng.choice([1, -1])
                h, d = (h + step, d + step) if rng.random() < 0.7 else (rng.randrange(limit), rng.randrange(limit))
        host, dev = unpack(pack(hosts)), unpack(pack(devs))
        (sh, sd), runs = _runs(host, dev)
        got = sorted([(a, b, 1) for a, b in zip(sh, sd)] + runs)
        assert got == sorted(page_runs(host, dev)), (hosts, devs)
