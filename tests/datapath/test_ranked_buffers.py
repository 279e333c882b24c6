"""RankedBuffers: the buffers of every tensor-parallel rank copied as one device, on real
shared memory. A host page holds each rank's shard in rank order; a copy is done on
every rank or fails whole, naming the rank that failed."""

import pytest
import torch

from radixkv import KvLayout
from radixkv.kvbuffers import ShmKvBuffers
from radixkv_server.core.pages import pack
from radixkv_server.datapath import CopyError, HostPool, HostShard, RankedBuffers, open_device_buffers
from radixkv_server.datapath.host_pool import tensor_bytes
from radixkv_server.service.namespace_config import host_layout

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16", page_size=2)
PAGES, TP = 8, 3


def chunk(rank: int, b: int, p: int) -> bytes:
    """The recognizable bytes of rank `rank`'s buffer b, device page p."""
    return bytes((rank * 101 + b * 37 + p * 11 + i * 3 + 1) % 251 for i in range(LAYOUT.chunk_bytes))


@pytest.fixture
def ranks():
    engines = [ShmKvBuffers.create(LAYOUT, PAGES) for _ in range(TP)]
    for r, eng in enumerate(engines):
        for b in range(LAYOUT.num_buffers):
            for p in range(PAGES):
                eng.page_view(b)[p].copy_(torch.frombuffer(bytearray(chunk(r, b, p)), dtype=torch.uint8))
    devices = [open_device_buffers("shm", LAYOUT, PAGES, eng.specs()) for eng in engines]
    pool = HostPool(host_layout(LAYOUT, TP), PAGES, pin="never")
    yield engines, RankedBuffers(devices, LAYOUT), pool
    for d in devices:
        d.close()
    pool.close()
    for eng in engines:
        eng.close()


def test_a_store_fills_each_ranks_shard_and_a_load_gives_each_rank_its_own_bytes(ranks):
    engines, ranked, pool = ranks
    ranked.submit_store(pack([1, 2]), pool, pack([5, 6])).wait()
    for r in range(TP):
        shard = HostShard(pool, LAYOUT, r, TP)
        for host, dev in ((5, 1), (6, 2)):
            assert shard.read_page(host) == b"".join(chunk(r, b, dev) for b in range(LAYOUT.num_buffers))
    ranked.submit_load(pool, pack([5, 6]), pack([7, 0])).wait()
    for r, eng in enumerate(engines):
        for b in range(LAYOUT.num_buffers):
            assert tensor_bytes(eng.page_view(b)[7]) == chunk(r, b, 1), f"rank {r} buffer {b}"
            assert tensor_bytes(eng.page_view(b)[0]) == chunk(r, b, 2), f"rank {r} buffer {b}"


def test_a_copy_one_rank_cannot_make_fails_whole_and_names_the_rank(ranks):
    engines, ranked, pool = ranks
    ranked.ranks[1].close()  # rank 1's mapping is gone: its copies cannot start
    with pytest.raises(CopyError, match="^rank 1: "):
        ranked.submit_load(pool, pack([0]), pack([3]))
    with pytest.raises(CopyError, match="^rank 1: "):
        ranked.submit_store(pack([3]), pool, pack([0]))


def test_ranks_must_hold_one_page_table():
    engines = [ShmKvBuffers.create(LAYOUT, n) for n in (PAGES, PAGES // 2)]
    devices = [open_device_buffers("shm", LAYOUT, e.num_pages, e.specs()) for e in engines]
    try:
        with pytest.raises(ValueError, match="different page counts"):
            RankedBuffers(devices, LAYOUT)
    finally:
        for d, e in zip(devices, engines):
            d.close()
            e.close()


def test_the_cuda_gather_and_scatter_reach_each_ranks_slice_of_the_host_pages():
    """The CUDA backend's zero-copy path over a rank's HostShard (its view of the pool,
    then one gather and one scatter per layer), run here on CPU tensors: what each
    rank stores lands in its own slice of the pages, and each rank loads its own back."""
    from radixkv_server.datapath.cuda import host_pages_view, load_pages, store_pages
    cols = LAYOUT.chunk_bytes // 2  # float16 pages move as int16 columns
    pool = HostPool(host_layout(LAYOUT, TP), PAGES, pin="never")
    try:
        views = [[torch.stack([torch.frombuffer(bytearray(chunk(r, b, p)), dtype=torch.int16)
                               for p in range(PAGES)]) for b in range(LAYOUT.num_buffers)] for r in range(TP)]
        h3s = [host_pages_view(pool.tensor.view(-1), HostShard(pool, LAYOUT, r, TP), LAYOUT.num_buffers, cols,
                               torch.int16) for r in range(TP)]
        scratch = torch.empty((2, LAYOUT.buffers_per_layer, cols), dtype=torch.int16)
        host, dev = torch.tensor([5, 1, 6]), torch.tensor([1, 2, 3])
        for r in range(TP):
            store_pages(LAYOUT, h3s[r], views[r], host, dev, scratch)
        for r in range(TP):
            shard = HostShard(pool, LAYOUT, r, TP)
            for h, d in zip(host.tolist(), dev.tolist()):
                assert shard.read_page(h) == b"".join(chunk(r, b, d) for b in range(LAYOUT.num_buffers))
        for r in range(TP):
            load_pages(LAYOUT, h3s[r], views[r], host, torch.tensor([7, 0, 4]), scratch, lambda layer: None)
            for b in range(LAYOUT.num_buffers):
                for d_new, d_old in ((7, 1), (0, 2), (4, 3)):
                    assert views[r][b][d_new].numpy().tobytes() == chunk(r, b, d_old), f"rank {r} buffer {b}"
    finally:
        pool.close()
