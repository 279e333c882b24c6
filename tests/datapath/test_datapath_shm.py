"""The shared-memory data path, end to end on real POSIX shared memory.

The engine side (`radixkv.kvbuffers.ShmKvBuffers`) fills every (buffer, page) chunk with
recognizable bytes; the daemon side (`ShmDeviceBuffers`, `HostPool`, `CopyEngine`)
copies pages and the tests compare bytes exactly.
"""

import asyncio
import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from radixkv import KvLayout
from radixkv.kvbuffers import ShmKvBuffers
from radixkv_server.core.pages import pack
from radixkv_server.datapath import (
    BufferSpec, CopyEngine, CopyError, CopyJob, DeviceOpenError, HostPool, open_device_buffers,
)
from radixkv_server.datapath.device import page_runs
from radixkv_server.datapath.host_pool import tensor_bytes

MHA = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float16", page_size=2)
MLA = KvLayout(num_layers=4, num_kv_heads=1, head_dim=6, dtype="bfloat16", page_size=3, kv_format="mla")
PAGES = 16


def chunk(lay: KvLayout, b: int, p: int) -> bytes:
    """The recognizable bytes of buffer b, device page p."""
    return bytes((b * 37 + p * 11 + i * 3 + 1) % 251 for i in range(lay.chunk_bytes))


def fill(eng: ShmKvBuffers) -> None:
    for b in range(eng.layout.num_buffers):
        view = eng.page_view(b)
        for p in range(eng.num_pages):
            view[p].copy_(torch.frombuffer(bytearray(chunk(eng.layout, b, p)), dtype=torch.uint8))


def device_chunk(eng: ShmKvBuffers, b: int, p: int) -> bytes:
    return tensor_bytes(eng.page_view(b)[p])


@pytest.fixture(params=[MHA, MLA], ids=["mha", "mla"])
def setup(request):
    lay = request.param
    eng = ShmKvBuffers.create(lay, PAGES)
    fill(eng)
    dev = open_device_buffers("shm", lay, PAGES, eng.specs())
    pool = HostPool(lay, 2 * PAGES, pin="never")
    yield lay, eng, dev, pool
    dev.close()
    pool.close()
    eng.close()


PATTERNS = {  # (host pages, device pages): runs, descending runs, scattered (indexed path)
    "run": (list(range(4, 12)), list(range(2, 10))),
    "descending": (list(range(7, -1, -1)), list(range(15, 7, -1))),
    "mixed": ([9, 3, 4, 5, 20], [0, 7, 8, 9, 1]),
    "scattered": (random.Random(1).sample(range(2 * PAGES), PAGES), random.Random(2).sample(range(PAGES), PAGES)),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_store_then_load_moves_exact_bytes(setup, pattern):
    lay, eng, dev, pool = setup
    hosts, devs = PATTERNS[pattern]
    before = [pool.read_page(h) for h in range(pool.num_pages)]
    dev.submit_store(pack(devs), pool, pack(hosts)).wait()
    for h, d in zip(hosts, devs):  # a host page is that page's chunks in buffer order
        assert pool.read_page(h) == b"".join(chunk(lay, b, d) for b in range(lay.num_buffers))
    untouched = set(range(pool.num_pages)) - set(hosts)
    assert all(pool.read_page(h) == before[h] for h in untouched)

    # Load back into a permutation of the device pages: each lands byte-exact.
    targets = devs[1:] + devs[:1]
    dev.submit_load(pool, pack(hosts), pack(targets)).wait()
    for t, d in zip(targets, devs):
        for b in range(lay.num_buffers):
            assert device_chunk(eng, b, t) == chunk(lay, b, d)
    for p in set(range(PAGES)) - set(targets):
        assert device_chunk(eng, 0, p) == chunk(lay, 0, p)


def pack_array(values):
    from radixkv_server.core.pages import unpack
    return unpack(pack(values))


def test_page_runs_split_and_reverse():
    runs = page_runs(pack_array([5, 6, 7, 3, 2, 9]), pack_array([1, 2, 3, 8, 7, 0]))
    assert runs == [(5, 1, 3), (2, 7, 2), (9, 0, 1)]


def test_buffers_in_any_order_and_segments(setup):
    """Specs need not be evenly spaced: hand the daemon the engine's buffers reversed."""
    lay, eng, _, pool = setup
    dev = open_device_buffers("shm", lay, PAGES, list(reversed(eng.specs())))
    try:
        dev.submit_store(pack([3, 4]), pool, pack([0, 1])).wait()
        last = lay.num_buffers - 1
        assert pool.read_page(1) == b"".join(chunk(lay, last - b, 4) for b in range(lay.num_buffers))
    finally:
        dev.close()


def test_store_to_a_pool_of_another_layout_is_refused(setup):
    lay, eng, dev, _ = setup
    other = HostPool(KvLayout(1, 1, 1, "uint8", 1), 4, pin="never")
    with pytest.raises(CopyError, match="another layout"):
        dev.submit_store(pack([0]), other, pack([0]))


@pytest.mark.parametrize("hosts,devs,match", [
    ([0, 1], [0], "pair up"),
    ([0], [PAGES], f"device page {PAGES} out of range"),
    ([2 * PAGES], [0], f"host page {2 * PAGES} out of range"),
    ([-1], [0], "host page -1"),
])
def test_bad_page_lists_raise_copy_error_and_copy_nothing(setup, hosts, devs, match):
    lay, eng, dev, pool = setup
    before = pool.read_page(0)
    with pytest.raises(CopyError, match=match):
        dev.submit_store(pack(devs), pool, pack(hosts))
    assert pool.read_page(0) == before


# -- opening ---------------------------------------------------------------------------


def test_missing_segment_names_it():
    specs = [BufferSpec(b"radixkv_no_such_segment", i * 1024, 1024) for i in range(MHA.num_buffers)]
    with pytest.raises(DeviceOpenError, match="radixkv_no_such_segment.*not found"):
        open_device_buffers("shm", MHA, 4, specs)


def test_too_small_names_sizes():
    eng = ShmKvBuffers.create(MHA, 4)
    try:
        need = MHA.buffer_bytes(8)
        with pytest.raises(DeviceOpenError, match=rf"{eng.name}.*{need}") as info:
            open_device_buffers("shm", MHA, 8, eng.specs())
        assert "buffer 0 (layer 0 K)" in str(info.value)
        # A spec pointing past the end of the segment.
        specs = eng.specs()
        specs[-1] = BufferSpec(specs[-1].handle, eng.nbytes, specs[-1].size)
        with pytest.raises(DeviceOpenError, match=rf"layer 2 V.*only {eng.nbytes} bytes"):
            open_device_buffers("shm", MHA, 4, specs)
    finally:
        eng.close()


def test_wrong_buffer_count_and_bad_handles():
    eng = ShmKvBuffers.create(MHA, 4)
    try:
        with pytest.raises(DeviceOpenError, match=r"5 buffers given, layout needs 6"):
            open_device_buffers("shm", MHA, 4, eng.specs()[:5])
        with pytest.raises(DeviceOpenError, match="unknown device backend 'nvlink'"):
            open_device_buffers("nvlink", MHA, 4, eng.specs())
        bad = [BufferSpec(b"\xff\xfe", 0, 1)] + eng.specs()[1:]
        with pytest.raises(DeviceOpenError, match="utf-8"):
            open_device_buffers("shm", MHA, 4, bad)
        bad = [BufferSpec(b"../etc/passwd", 0, 1)] + eng.specs()[1:]
        with pytest.raises(DeviceOpenError, match="segment name"):
            open_device_buffers("shm", MHA, 4, bad)
        overlap = eng.specs()
        overlap[1] = overlap[0]
        with pytest.raises(DeviceOpenError, match="overlap"):
            open_device_buffers("shm", MHA, 4, overlap)
    finally:
        eng.close()


CHILD = textwrap.dedent("""
    import sys
    from multiprocessing import resource_tracker
    from radixkv import KvLayout
    from radixkv.kvbuffers import ShmKvBuffers
    from radixkv_server.datapath import HostPool, open_device_buffers
    from radixkv_server.core.pages import pack
    lay = KvLayout(3, 2, 4, "float16", 2)
    name = sys.argv[1]
    att = ShmKvBuffers.attach(lay, 16, name)
    dev = open_device_buffers("shm", lay, 16, att.specs())
    pool = HostPool(lay, 1, pin="never")
    dev.submit_store(pack([5]), pool, pack([0])).wait()
    sys.stdout.write(pool.read_page(0).hex())
    dev.close(); att.close()
    # Run the resource tracker's exit cleanup now, so a wrongly tracked segment is
    # unlinked before the parent looks.
    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()
""")


def test_segment_survives_daemon_close_and_a_child_attaching():
    eng = ShmKvBuffers.create(MHA, PAGES)
    fill(eng)
    path = f"/dev/shm/{eng.name}"
    try:
        dev = open_device_buffers("shm", MHA, PAGES, eng.specs())
        dev.close()
        dev.close()  # idempotent
        with pytest.raises(CopyError, match="closed"):
            dev.submit_store(pack([0]), HostPool(MHA, 1, pin="never"), pack([0]))
        assert os.path.exists(path)
        out = subprocess.run([sys.executable, "-c", CHILD, eng.name], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert bytes.fromhex(out.stdout) == b"".join(chunk(MHA, b, 5) for b in range(MHA.num_buffers))
        assert os.path.exists(path), "a process that only attached unlinked the engine's segment"
        assert device_chunk(eng, 1, 3) == chunk(MHA, 1, 3)
    finally:
        eng.close()
        eng.close()
    assert not os.path.exists(path), "the engine's close must unlink its segment"


def test_engine_views_and_specs():
    eng = ShmKvBuffers.create(MHA, 4)
    try:
        k = eng.k(1)
        assert k.shape == (4 * MHA.page_size, MHA.num_kv_heads, MHA.head_dim) and k.dtype == torch.float16
        k[2].fill_(1.5)  # token 2 is in page 1 of buffer 2 (layer 1 K)
        assert tensor_bytes(eng.page_view(2)[1])[: MHA.token_bytes] == tensor_bytes(torch.full((8,), 1.5, dtype=torch.float16))
        assert eng.v(1).data_ptr() - eng.k(1).data_ptr() == eng.stride
        assert [s.offset for s in eng.specs()] == [b * eng.stride for b in range(MHA.num_buffers)]
        with pytest.raises(ValueError, match="kv_format 'mla'.*use k"):
            eng.kv(0)
    finally:
        eng.close()


# -- host pool -------------------------------------------------------------------------


def test_host_pool_basics():
    assert HostPool.pages_for_bytes(MHA, 10 * MHA.page_bytes + 5) == 10
    pool = HostPool(MHA, 3, pin="auto")
    assert pool.nbytes == 3 * MHA.page_bytes and pool.pinned is torch.cuda.is_available()
    data = bytes(range(256)) * (MHA.page_bytes // 256) + bytes(MHA.page_bytes % 256)
    pool.write_page(2, data)
    pool.write_page(1, bytes(MHA.page_bytes))
    assert pool.read_page(2) == data and pool.read_page(1) == bytes(MHA.page_bytes)
    with pytest.raises(ValueError, match="bytes"):
        pool.write_page(0, b"short")
    with pytest.raises(IndexError):
        pool.read_page(3)
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(ValueError, match="pin"):
        HostPool(MHA, 1, pin="yes")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            HostPool(MHA, 1, pin="always")


# -- copy engine -----------------------------------------------------------------------


class GatedBuffers:
    """Real shm copies, held up on purpose: a load's completion waits for `load_gate`
    (like a CUDA copy in flight); a store's submit waits for `store_gate` (like a long
    shm copy occupying its thread)."""

    def __init__(self, inner):
        self.inner = inner
        self.load_gate, self.store_gate = threading.Event(), threading.Event()
        self.layout, self.num_pages = inner.layout, inner.num_pages

    def submit_load(self, pool, hosts, devs):
        self.inner.submit_load(pool, hosts, devs)
        return CopyJob([b"ev"], lambda: _gate(self.load_gate))

    def submit_store(self, devs, pool, hosts):
        _gate(self.store_gate)
        return self.inner.submit_store(devs, pool, hosts)


def _gate(event):
    if not event.wait(10):
        raise CopyError("gate timeout")


def run_engine(setup, body, gated=False):
    lay, eng, dev, pool = setup

    async def main():
        loop = asyncio.get_running_loop()
        done = []
        buffers = GatedBuffers(dev) if gated else dev
        ce = CopyEngine(loop, buffers, pool, lambda t, e: done.append((t, e, threading.get_ident())))
        try:
            await body(ce, done, buffers)
        finally:
            await ce.drain()
            ce.close()
            ce.close()
    asyncio.run(main())


def test_copy_engine_reports_on_the_loop_never_inline(setup):
    lay, eng, dev, pool = setup

    async def body(ce, done, _):
        ce.backup(1, pack([3, 4]), pack([10, 11]))
        assert done == []  # never from inside backup()
        assert await ce.submitted(1) == []
        assert await ce.wait(1) is None
        assert done == [(1, None, threading.get_ident())]
        assert pool.read_page(11) == b"".join(chunk(lay, b, 4) for b in range(lay.num_buffers))
        ce.load(2, pack([11]), pack([0]))
        await ce.drain()
        assert done[-1][:2] == (2, None) and device_chunk(eng, 0, 0) == chunk(lay, 0, 4)
        assert (ce.num_backups, ce.num_loads, ce.num_failed) == (1, 1, 0)
        assert ce.backup_bytes == 2 * lay.page_bytes and ce.load_bytes == lay.page_bytes
        assert ce.load_seconds > 0 and ce.backup_seconds > 0
        assert await ce.wait(99) is None and await ce.submitted(99) == []
    run_engine(setup, body)


def test_copy_engine_failure_becomes_error_string(setup):
    async def body(ce, done, _):
        ce.load(7, pack([0]), pack([PAGES + 5]))
        finished = ce.wait(7)  # looked up now, awaited later
        with pytest.raises(CopyError, match="out of range"):
            await ce.submitted(7)
        err = await finished
        assert "CopyError" in err and "out of range" in err
        assert done[0][:2] == (7, err) and ce.num_failed == 1
        ce.backup(8, pack([1]), pack([1]))  # the engine still works afterwards
        assert await ce.wait(8) is None
    run_engine(setup, body)


def test_copy_engine_submitted_before_done_and_drain(setup):
    async def body(ce, done, buffers):
        for t in range(5):
            ce.load(t, pack([t]), pack([t]))
        with pytest.raises(ValueError, match="already"):
            ce.load(0, pack([1]), pack([1]))
        assert await ce.submitted(3) == [b"ev"]
        assert ce.num_in_flight == 5 and done == []
        waiter = asyncio.ensure_future(ce.drain())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        buffers.load_gate.set()
        await asyncio.wait_for(waiter, 10)
        assert sorted(t for t, e, _ in done) == list(range(5)) and ce.num_in_flight == 0
    run_engine(setup, body, gated=True)


def test_loads_do_not_queue_behind_backups(setup):
    lay, eng, dev, pool = setup

    async def body(ce, done, buffers):
        buffers.load_gate.set()
        for t in range(4):  # more backups than backup threads, all stuck
            ce.backup(t, pack([t]), pack([t]))
        ce.load(10, pack([20]), pack([15]))
        assert await asyncio.wait_for(ce.wait(10), 5) is None
        assert [t for t, _, _ in done] == [10] and ce.num_in_flight == 4
        buffers.store_gate.set()
        await asyncio.wait_for(ce.drain(), 10)
        assert pool.read_page(3) == b"".join(chunk(lay, b, 3) for b in range(lay.num_buffers))
    run_engine(setup, body, gated=True)


def test_on_done_raising_does_not_break_the_engine(setup):
    lay, eng, dev, pool = setup

    async def main():
        calls = []

        def on_done(t, e):
            calls.append(t)
            raise RuntimeError("boom")
        ce = CopyEngine(asyncio.get_running_loop(), dev, pool, on_done)
        ce.backup(1, pack([0]), pack([0]))
        assert await ce.wait(1) is None
        ce.backup(2, pack([1]), pack([1]))
        await ce.drain()
        ce.close()
        ce.load(3, pack([0]), pack([0]))  # after close: reported as an error, later
        assert calls == [1, 2]
        assert "closed" in await ce.wait(3)
        assert calls == [1, 2, 3]
    asyncio.run(main())
