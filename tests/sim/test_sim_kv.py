"""The simulator's deterministic KV and page accounting, without a daemon."""

import pytest
import torch

from radixkv.layout import KvLayout
from radixkv.sim.kv import KvPattern, page_keys
from radixkv.sim.pages import PagePool
from radixkv.sim.workload import MultiTurn, SharedPrefix
from radixkv.types import pack

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
NUM_PAGES = 16


def make_pattern(layout=LAYOUT):
    buffers = [torch.zeros(NUM_PAGES * layout.page_size, layout.num_kv_heads, layout.head_dim,
                           dtype=getattr(torch, layout.dtype)) for _ in range(layout.num_buffers)]
    return KvPattern(layout, buffers, NUM_PAGES), buffers


def test_page_keys_name_whole_prefixes():
    a = pack(range(1, 11))  # 2 whole pages + 2 tokens
    b = pack([1, 2, 3, 4, 5, 6, 7, 8, 99, 98])
    ka, kb = page_keys(a, 4), page_keys(b, 4)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert page_keys(pack([9, 2, 3, 4, 5, 6, 7, 8]), 4)[1] != ka[1]  # page 1 depends on page 0
    assert page_keys(a, 4, b"lora")[0] != ka[0]


def test_written_pages_verify_clean():
    kv, _ = make_pattern()
    keys = page_keys(pack(range(12)), 4)
    kv.write([5, 2, 9], keys)
    assert kv.mismatches([5, 2, 9], keys) == (0, 0)


def test_swapped_pages_are_detected():
    kv, _ = make_pattern()
    keys = page_keys(pack(range(12)), 4)
    kv.write([5, 2, 9], keys)
    bad_bytes, bad_chunks = kv.mismatches([2, 5, 9], keys)
    assert bad_chunks == 2 * LAYOUT.num_buffers and bad_bytes > 0


def test_swapped_layers_are_detected():
    kv, buffers = make_pattern()
    keys = page_keys(pack(range(8)), 4)
    kv.write([0, 1], keys)
    k0, k1 = LAYOUT.buffer_index(0, 0), LAYOUT.buffer_index(1, 0)
    saved = buffers[k0].clone()
    buffers[k0].copy_(buffers[k1])
    buffers[k1].copy_(saved)
    assert kv.mismatches([0, 1], keys)[1] == 4  # 2 pages x 2 buffers


def test_k_and_v_of_one_layer_differ():
    kv, buffers = make_pattern()
    keys = page_keys(pack(range(4)), 4)
    kv.write([3], keys)
    buffers[LAYOUT.buffer_index(0, 1)].copy_(buffers[LAYOUT.buffer_index(0, 0)])
    assert kv.mismatches([3], keys)[1] == 1


def test_shifted_bytes_and_single_flips_are_detected():
    kv, buffers = make_pattern()
    keys = page_keys(pack(range(4)), 4)
    kv.write([7], keys)
    flat = buffers[0].view(-1).view(torch.uint8)
    chunk = LAYOUT.chunk_bytes
    page = flat[7 * chunk:8 * chunk]
    page.copy_(torch.roll(page.clone(), 8))  # one int64 word off
    assert kv.mismatches([7], keys)[0] > 0
    kv.write([7], keys)
    flat[7 * chunk + 5] ^= 1
    assert kv.mismatches([7], keys) == (1, 1)


def test_chunks_not_a_multiple_of_eight_bytes():
    odd = KvLayout(num_layers=1, num_kv_heads=1, head_dim=3, dtype="int8", page_size=1, kv_format="mla")
    kv, _ = make_pattern(odd)
    keys = page_keys(pack(range(3)), 1)
    kv.write([0, 1, 2], keys)
    assert kv.mismatches([0, 1, 2], keys) == (0, 0)
    assert kv.mismatches([1, 0, 2], keys)[1] == 2


def test_page_pool_accounts_every_page():
    pool = PagePool(10)
    a = pool.allocate(4)
    pool.to_cache(a[:3], "insert")
    pool.free(a[3:], "tail")
    assert (pool.num_free, pool.num_in_use, pool.num_cached) == (7, 0, 3)
    assert pool.all_cached(a[:3], "match") and pool.cached() == sorted(a[:3])
    pool.from_cache(a[:1], "evict")
    assert pool.check(expect_in_use=0) == [] and pool.errors == 0
    assert not pool.can_allocate(11)
    with pytest.raises(ValueError):
        pool.allocate(11)


def test_page_pool_counts_wrong_moves_without_changing_state():
    pool = PagePool(4)
    a = pool.allocate(2)
    pool.from_cache(a, "evict of pages never cached")  # 2 errors
    pool.to_cache([a[0], a[0]], "twice")                # 1 error (duplicate)
    pool.free([99], "out of range")                     # 1 error
    assert not pool.all_cached([a[1]], "match")         # 1 error
    assert pool.errors == 5 and len(pool.messages) == 5
    assert (pool.num_free, pool.num_in_use, pool.num_cached) == (2, 1, 1)
    assert pool.check() == []
    assert pool.check(expect_in_use=0) == ["1 pages in use, expected 0"]


def test_multiturn_extends_each_conversation():
    w = MultiTurn(6, seed=1, clients=2, system_tokens=8, turn_tokens=(4, 4), answer_tokens=(4, 4))
    first = w.take(0, 10)
    assert [r.client for r in first] == [0, 1] and not w.take(0, 10)
    w.finish(first[0], 0)
    [second] = w.take(1, 10)
    assert second.client == 0 and second.tokens.startswith(first[0].tokens)
    assert second.prompt_tokens == first[0].num_tokens + 4 and second.num_tokens == second.prompt_tokens + 4


def test_workloads_are_seeded():
    def tokens(w):
        return [r.tokens for r in w.take(1e9, 1000)]
    assert tokens(SharedPrefix(20, seed=3)) == tokens(SharedPrefix(20, seed=3))
    assert tokens(SharedPrefix(20, seed=3)) != tokens(SharedPrefix(20, seed=4))
    assert tokens(MultiTurn(5, seed=3, rate=0.5)) == tokens(MultiTurn(5, seed=3, rate=0.5))


def test_shared_prefix_requests_share_system_prompts():
    w = SharedPrefix(40, seed=0, groups=2, system_tokens=32)
    reqs = w.take(0, 100)
    assert len(reqs) == 40 and len({r.tokens[:128] for r in reqs}) == 2
    for r in reqs:
        w.finish(r, 0)
    assert w.done


def test_report_fails_on_any_defect_and_ends_with_the_mismatch_line():
    from radixkv.sim.report import Report

    assert Report().ok and Report().summary()[-1] == "0 byte mismatches"
    for defect in ({"byte_mismatches": 3}, {"accounting_errors": 1}, {"protocol_errors": 1},
                   {"violations": ["x"]}, {"stalled": True}):
        r = Report(**defect)
        assert not r.ok
    assert Report(byte_mismatches=3).summary()[-1] == "3 byte mismatches"
