"""The CUDA data path across two processes, as in production.

An engine process allocates CUDA KV tensors, fills each (buffer, page) chunk with a
recognizable pattern and exports them (`CudaKvBuffers.export`). This process plays the
daemon: it opens them with `CudaDeviceBuffers`, stores pages into a pinned `HostPool`,
loads them back to other pages, and the engine checks the bytes after waiting on the
per-layer IPC events of the load. Also prints copy bandwidth next to one contiguous
pinned cudaMemcpyAsync of the same bytes (no timing asserts).

RADIXKV_TEST_DEVICE picks the GPU (default 0); RADIXKV_BENCH_OUT, if set, names a file
the bandwidth lines are appended to.
"""

import os
import random
import time

import pytest
import torch

from radixkv import KvLayout
from radixkv_server.core.pages import pack
from radixkv_server.datapath import CopyError, HostPool, open_device_buffers

from ipc_engine import IpcEngine, host_pattern

pytestmark = pytest.mark.gpu

DEVICE = int(os.environ.get("RADIXKV_TEST_DEVICE", "0"))
SMALL_MHA = dict(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
SMALL_MLA = dict(num_layers=2, num_kv_heads=1, head_dim=72, dtype="float16", page_size=2, kv_format="mla")
BIG = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)  # 2 MiB pages


@pytest.fixture
def engine_factory():
    engines = []

    def make(layout_kwargs, num_pages, one_storage=False):
        engines.append(IpcEngine(DEVICE))
        engines[-1].alloc(layout_kwargs, num_pages, one_storage)
        return engines[-1]
    yield make
    for e in engines:
        e.close()


@pytest.mark.parametrize("kwargs", [SMALL_MHA, SMALL_MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("pin", ["auto", "never"], ids=["pinned", "pageable"])
@pytest.mark.parametrize("one_storage", [False, True], ids=["tensors", "one_storage"])
def test_store_and_load_back_bytes(engine_factory, kwargs, pin, one_storage):
    lay, num_pages = KvLayout(**kwargs), 64
    eng = engine_factory(kwargs, num_pages, one_storage)
    assert len({s.handle for s in eng.specs}) == (1 if one_storage else lay.num_buffers)
    dev = open_device_buffers("cuda", lay, num_pages, eng.specs, DEVICE)
    pool = HostPool(lay, 128, pin=pin, device=DEVICE)
    try:
        assert pool.pinned is (pin == "auto")
        rng = random.Random(0)
        devs = list(range(8, 24)) + rng.sample(range(24, 64), 10)
        hosts = list(range(40, 56)) + rng.sample(range(60, 128), 10)
        job = dev.submit_store(pack(devs), pool, pack(hosts))
        assert job.events == []
        job.wait()
        expected = host_pattern(lay, torch.tensor(devs))
        assert torch.equal(pool.tensor[torch.tensor(hosts)], expected)

        targets = list(range(len(hosts)))  # load into device pages 0..25
        job = dev.submit_load(pool, pack(hosts), pack(targets))
        assert len(job.events) == lay.num_layers and len(set(job.events)) == lay.num_layers
        assert eng.expect(job.events, targets, devs) == 0  # engine waits on the events only
        job.wait()
        with pytest.raises(CopyError, match="out of range"):
            dev.submit_load(pool, pack([0]), pack([num_pages]))
        empty = dev.submit_load(pool, b"", b"")  # nothing to copy: no events, nothing to wait for
        assert empty.events == [] and not empty.pending
    finally:
        dev.close()
        dev.close()
        pool.close()


def test_event_handles_are_recycled(engine_factory):
    from radixkv_server.datapath.cuda import EVENT_RING
    lay = KvLayout(**SMALL_MHA)
    eng = engine_factory(SMALL_MHA, 16)
    dev = open_device_buffers("cuda", lay, 16, eng.specs, DEVICE)
    pool = HostPool(lay, 16, device=DEVICE)
    try:
        seen = set()
        for i in range(EVENT_RING + 1):
            job = dev.submit_load(pool, pack([i % 16]), pack([i % 16]))
            job.wait()
            seen.add(tuple(job.events))
        assert len(seen) == EVENT_RING
    finally:
        dev.close()
        pool.close()


def test_a_full_gpu_is_a_clear_error_at_open(engine_factory):
    """The daemon's copy streams and scratch memory do not fit: DeviceOpenError naming
    them (Register's INVALID_ARGUMENT), not a RuntimeError (INTERNAL)."""
    from radixkv_server.datapath import DeviceOpenError
    lay = KvLayout(**SMALL_MHA)
    eng = engine_factory(SMALL_MHA, 16)
    free, _ = torch.cuda.mem_get_info(DEVICE)
    ballast = []
    try:
        for size in (free - (16 << 20), 8 << 20, 4 << 20, 2 << 20):
            try:
                ballast.append(torch.empty(size, dtype=torch.uint8, device=f"cuda:{DEVICE}"))
            except torch.OutOfMemoryError:
                pass
        with pytest.raises(DeviceOpenError, match="scratch memory"):
            open_device_buffers("cuda", lay, 16, eng.specs, DEVICE)
    finally:
        ballast.clear()
        torch.cuda.empty_cache()


def _seconds(fn, reps=5):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_bandwidth_vs_contiguous_memcpy(engine_factory, capsys):
    lay, num_pages, n = KvLayout(**BIG), 1024, 512  # 2 GiB engine KV, 1 GiB batches
    eng = engine_factory(BIG, num_pages)
    dev = open_device_buffers("cuda", lay, num_pages, eng.specs, DEVICE)
    pool = HostPool(lay, n, device=DEVICE)
    nbytes = n * lay.page_bytes
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    rng = random.Random(0)
    patterns = {
        "runs": (list(range(n)), list(range(n, 2 * n))),
        "random": (rng.sample(range(n), n), rng.sample(range(num_pages), n)),
    }
    lines = []
    try:
        def h2d():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(DEVICE)

        def d2h():
            src.copy_(dst, non_blocking=True)
            torch.cuda.synchronize(DEVICE)
        lines.append(f"contiguous pinned memcpy {nbytes >> 20} MiB: H2D {nbytes / _seconds(h2d) / 1e9:.1f} GB/s, "
                     f"D2H {nbytes / _seconds(d2h) / 1e9:.1f} GB/s")
        for name, (hosts, devs) in patterns.items():
            hp, dp = pack(hosts), pack(devs)
            store = _seconds(lambda: dev.submit_store(dp, pool, hp).wait())
            load = _seconds(lambda: dev.submit_load(pool, hp, dp).wait())
            start = time.perf_counter()
            job = dev.submit_load(pool, hp, dp)
            enqueue = time.perf_counter() - start
            job.wait()
            lines.append(f"radixkv {name}: {n} pages x {lay.page_bytes >> 20} MiB: load {nbytes / load / 1e9:.1f} GB/s, "
                         f"store {nbytes / store / 1e9:.1f} GB/s, load enqueue {enqueue * 1e3:.2f} ms")
        # Stored from devs and loaded back to devs: the engine's pages are intact.
        assert eng.expect(job.events, devs, devs) == 0
    finally:
        dev.close()
        pool.close()
    out = os.environ.get("RADIXKV_BENCH_OUT")
    if out:
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
