"""The cache core's behaviour, one scenario at a time (SGLang HiCache seed cases included)."""

import pytest
from radixkv_server.core import NotReady, UnknownTransfer
from radixkv_server.core.pages import pack, unpack

from harness import Engine, make_cache, tokens


def clean(cache):
    assert cache.check_invariants() == []


def host_only_tree(policy):
    """root -> shared (2 pages) -> {a, b} (1 page each), every node on host only."""
    cache, copier = make_cache(policy)
    eng = Engine(cache, copier)
    a = tokens(1, 2, 3, 4, 5, 6)
    b = tokens(1, 2, 3, 4, 7, 8)
    eng.insert(a)
    eng.insert(b)
    copier.complete_all(cache)  # backups
    while cache.device.num_held:  # evict everything, waiting for write-backs
        eng.give(cache.evict_device(100).freed_pages)
        for outcome in copier.complete_all(cache).values():
            eng.give(outcome.freed_pages)
    m = cache.match(a)
    assert (m.device_tokens, m.host_tokens) == (0, 6)
    clean(cache)
    return cache, copier, eng, a, b


def node_of(cache, prompt, depth):
    m = cache.match(prompt)
    node = cache.node(m.host_node)
    path = list(reversed(node.path()))
    return path[depth]


def test_match_returns_inserted_pages_and_ignores_partial_tail():
    cache, copier = make_cache(page_size=4)
    eng = Engine(cache, copier)
    prompt = tokens(*range(12))
    r = eng.insert(prompt)
    assert r.cached_tokens == 0
    m = cache.match(tokens(*range(14)))  # 3 whole pages + a partial one
    assert m.device_tokens == 12 and m.host_tokens == 0
    assert eng.verify(prompt, b"", m.device_pages) == []
    clean(cache)


def test_diverging_prompt_splits_the_node_and_shares_the_prefix():
    cache, copier = make_cache(page_size=2)
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4, 5, 6))
    r = eng.insert(tokens(1, 2, 3, 4, 9, 9))
    assert r.cached_tokens == 4
    m = cache.match(tokens(1, 2, 3, 4, 9, 9))
    assert m.device_tokens == 6
    assert len(cache.tree.nodes) == 1 + 3  # root, shared prefix, two leaves
    clean(cache)


def test_page_size_one():
    cache, copier = make_cache(page_size=1)
    eng = Engine(cache, copier)
    eng.insert(tokens(5, 6, 7))
    m = cache.match(tokens(5, 6, 8))
    assert m.device_tokens == 2
    assert eng.verify(tokens(5, 6, 8), b"", m.device_pages) == []
    clean(cache)


def test_extra_key_separates_equal_prompts():
    cache, copier = make_cache()
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4), b"lora-a")
    assert cache.match(tokens(1, 2, 3, 4), b"lora-b").device_tokens == 0
    assert cache.match(tokens(1, 2, 3, 4), b"lora-a").device_tokens == 4


def test_insert_returns_the_callers_duplicate_pages_as_redundant():
    cache, copier = make_cache(policy="write_back")
    eng = Engine(cache, copier)
    prompt = tokens(1, 2, 3, 4)
    eng.insert(prompt)
    theirs = eng.alloc(2)  # computed again without matching first
    r = cache.insert(prompt, pack(theirs))
    assert r.cached_tokens == 4 and list(unpack(r.redundant_pages)) == theirs
    eng.give(r.redundant_pages)
    # Re-inserting the cache's own pages is not redundant.
    m = cache.match(prompt)
    assert cache.insert(prompt, m.device_pages).redundant_pages == b""
    clean(cache)


def test_write_through_backs_up_and_blocks_eviction_until_done():
    cache, copier = make_cache("write_through")
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4))
    assert len(copier.pending) == 1
    assert cache.evict_device(2).freed_pages == b""  # backup in flight
    copier.complete_all(cache)
    r = cache.evict_device(2)
    assert len(r.freed_pages) == 8 and r.pending == ()  # host copy exists: no write-back
    m = cache.match(tokens(1, 2, 3, 4))
    assert (m.device_tokens, m.host_tokens) == (0, 4)
    clean(cache)


def test_write_through_selective_backs_up_at_the_threshold():
    cache, copier = make_cache("write_through_selective", threshold=2)
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4))
    assert not copier.pending
    eng.insert(tokens(1, 2, 3, 4))  # second hit, chunked or not
    assert len(copier.pending) == 1
    clean(cache)


def test_write_back_eviction_returns_pages_after_the_copy_and_load_back_restores_bytes():
    cache, copier = make_cache("write_back")
    eng = Engine(cache, copier)
    prompt = tokens(1, 2, 3, 4, 5, 6)
    eng.insert(prompt)
    assert not copier.pending
    r = cache.evict_device(3)
    assert r.freed_pages == b"" and len(r.pending) == 1
    clean(cache)
    outcome = copier.complete(cache, r.pending[0])
    assert len(unpack(outcome.freed_pages)) == 3
    eng.give(outcome.freed_pages)
    m = cache.match(prompt)
    assert (m.device_tokens, m.host_tokens) == (0, 6)
    pages = eng.alloc(4)
    lb = cache.load_back(m.host_node, pack(pages))
    assert lb.loaded_tokens == 6 and len(unpack(lb.unused_pages)) == 1
    eng.give(lb.unused_pages)
    copier.complete(cache, lb.transfer)
    assert cache.finish_load_back(lb.transfer).error is None
    assert eng.verify(prompt, b"", lb.device_pages) == []
    clean(cache)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_seed_two_anchors_over_one_shared_node(policy):
    """SGLang asserted here in write_back (two anchors pinning one node). radixkv plans the
    second load against the first: it loads only its own leaf, depends on the first, and
    pins the shared node too; after both ACKs no pin is left and the duplicate is tracked."""
    cache, copier, eng, a, b = host_only_tree(policy)
    shared = node_of(cache, a, 0)
    la = cache.load_back(cache.match(a).host_node, pack(eng.alloc(3)))
    lb = cache.load_back(cache.match(b).host_node, pack(eng.alloc(3)))
    assert la.loaded_tokens == 6 and lb.loaded_tokens == 2
    assert lb.depends_on == (la.transfer,)
    assert shared.full.pins == {la.transfer, lb.transfer}
    eng.give(lb.unused_pages)
    clean(cache)
    # A reader of the shared node waits for the load that fills it, not for b's leaf
    # load, which only relies on it; so may an Insert over it, once a's copy is done.
    assert cache.match(tokens(1, 2, 3, 4, 9, 9)).depends_on == (la.transfer,)
    copier.complete(cache, la.transfer)
    assert cache.match(tokens(1, 2, 3, 4, 9, 9)).depends_on == ()
    copier.complete_all(cache)
    cache.finish_load_back(la.transfer)
    assert shared.full.pins == {lb.transfer} and shared not in cache.duplicates
    cache.finish_load_back(lb.transfer)
    assert shared.full.pins == set()
    assert shared in cache.duplicates
    assert eng.verify(b, b"", lb.device_pages) == []
    clean(cache)


def test_seed_write_back_pin_blocks_reclaim_until_ack():
    cache, copier, eng, a, b = host_only_tree("write_back")
    shared = node_of(cache, a, 0)
    la = cache.load_back(cache.match(a).host_node, pack(eng.alloc(3)))
    copier.complete_all(cache)
    cache.evict_host(1000)
    assert shared.full.host_pages is not None  # pinned: its host copy stays
    cache.finish_load_back(la.transfer)
    assert shared in cache.duplicates
    cache.evict_host(1000)
    assert shared.full.host_pages is None and shared.full.device_pages is not None
    assert cache.counters.reclaimed_duplicate_tokens >= 4
    clean(cache)


@pytest.mark.parametrize("reverse", [False, True])
def test_write_back_overlapping_anchors_reclaim_only_after_both_acks(reverse):
    cache, copier, eng, a, b = host_only_tree("write_back")
    shared = node_of(cache, a, 0)
    la = cache.load_back(cache.match(a).host_node, pack(eng.alloc(3)))
    lb = cache.load_back(cache.match(b).host_node, pack(eng.alloc(1)))
    copier.complete_all(cache)
    first, second = (lb, la) if reverse else (la, lb)
    cache.finish_load_back(first.transfer)
    cache.evict_host(1000)
    assert shared.full.host_pages is not None, "reclaimed while a load still pins it"
    cache.finish_load_back(second.transfer)
    cache.evict_host(1000)
    assert shared.full.host_pages is None
    clean(cache)


def test_ack_of_unknown_or_repeated_transfer_is_refused():
    cache, copier, eng, a, b = host_only_tree("write_back")
    with pytest.raises(UnknownTransfer):
        cache.finish_load_back(999)
    la = cache.load_back(cache.match(a).host_node, pack(eng.alloc(3)))
    with pytest.raises(NotReady) as e:
        cache.finish_load_back(la.transfer)
    assert e.value.transfers == (la.transfer,)
    copier.complete_all(cache)
    cache.finish_load_back(la.transfer)
    with pytest.raises(UnknownTransfer):
        cache.finish_load_back(la.transfer)
    clean(cache)


def test_failed_load_cascades_and_returns_pages_at_ack():
    cache, copier, eng, a, b = host_only_tree("write_through")
    la = cache.load_back(cache.match(a).host_node, pack(eng.alloc(3)))
    lb = cache.load_back(cache.match(b).host_node, pack(eng.alloc(1)))
    copier.complete(cache, la.transfer, fail=True)
    m = cache.match(b)
    assert m.device_tokens == 0, "pages of a failed load must not be handed out"
    clean(cache)
    copier.complete(cache, lb.transfer)
    fa = cache.finish_load_back(la.transfer)
    fb = cache.finish_load_back(lb.transfer)
    assert fa.error and "copy failed" in fa.error and len(unpack(fa.failed_pages)) == 3
    assert fb.error and "depends on failed transfer" in fb.error and len(unpack(fb.failed_pages)) == 1
    eng.give(fa.failed_pages)
    eng.give(fb.failed_pages)
    clean(cache)
    assert cache.match(a).host_tokens == 6  # host copies kept; a new load can retry


def test_insert_under_a_prefix_still_loading_must_wait():
    cache, copier, eng, a, b = host_only_tree("write_through")
    la = cache.load_back(cache.match(a).host_node, pack(eng.alloc(3)))
    longer = a + tokens(9, 9)
    m = cache.match(longer)
    with pytest.raises(NotReady) as e:
        cache.insert(longer, m.device_pages + pack(eng.alloc(1)))
    assert e.value.transfers == (la.transfer,)
    clean(cache)


def test_write_through_never_starves_the_host_pool():
    """Host pool of 4 pages: new backups reclaim host copies of settled duplicates."""
    cache, copier = make_cache("write_through", host_pages=4, device_pages=64)
    eng = Engine(cache, copier)
    for i in range(10):
        eng.insert(tokens(100 + i, 1, 2, 3))
        copier.complete_all(cache)
    assert cache.counters.skipped_backup_tokens == 0
    assert cache.counters.reclaimed_duplicate_tokens > 0
    clean(cache)


@pytest.mark.parametrize("policy,victim", [("lru", 1), ("lfu", 2)])
def test_eviction_order_follows_the_strategy(policy, victim):
    cache, copier = make_cache("write_through", eviction=policy)
    eng = Engine(cache, copier)
    p1, p2 = tokens(1, 1), tokens(2, 2)
    eng.insert(p1)
    eng.insert(p1)  # p1 hit twice
    eng.insert(p2)  # p2 inserted last
    copier.complete_all(cache)
    cache.evict_device(1)
    evicted = 1 if cache.match(p1).device_tokens == 0 else 2
    assert evicted == victim


def test_write_back_without_host_room_drops_the_node_and_counts_it():
    cache, copier = make_cache("write_back", host_pages=0)
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4))
    r = cache.evict_device(2)
    assert len(unpack(r.freed_pages)) == 2 and r.pending == ()
    assert cache.counters.dropped_write_back_tokens == 4
    assert cache.match(tokens(1, 2, 3, 4)).host_tokens == 0
    clean(cache)


def test_leases_protect_from_device_and_host_eviction():
    cache, copier = make_cache("write_through")
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4))
    copier.complete_all(cache)
    m = cache.match(tokens(1, 2, 3, 4))
    cache.lock(m.host_node)
    assert cache.evict_device(10).freed_pages == b""
    cache.evict_host(10)  # may reclaim the host duplicate: the device copy stays
    assert cache.match(tokens(1, 2, 3, 4)).device_tokens == 4
    cache.unlock(m.host_node)
    r = cache.evict_device(10)
    outcome = copier.complete(cache, r.pending[0])  # written back: no host copy was left
    assert len(unpack(outcome.freed_pages)) == 2
    clean(cache)


def test_split_during_backup_settles_both_halves():
    cache, copier = make_cache("write_through")
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4, 5, 6))
    cache.match(tokens(1, 2, 9, 9))  # splits the node while its backup is in flight
    clean(cache)
    copier.complete_all(cache)
    assert len(cache.duplicates) == 2
    clean(cache)


def test_drop_device_keeps_host_copies_and_forgets_device_only_nodes():
    cache, copier = make_cache("write_through_selective")
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4))
    eng.insert(tokens(1, 2, 3, 4))  # backed up (2 hits)
    eng.insert(tokens(7, 7))         # device only
    copier.complete_all(cache)
    dropped = cache.drop_device(32)
    assert dropped == 2
    m = cache.match(tokens(1, 2, 3, 4))
    assert (m.device_tokens, m.host_tokens) == (0, 4)
    assert cache.match(tokens(7, 7)).host_tokens == 0
    assert cache.device.num_pages == 32
    clean(cache)


def test_match_keeps_a_node_whose_write_back_is_in_flight():
    cache, copier = make_cache("write_back")
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2))
    r = cache.evict_device(1)
    assert cache.match(tokens(1, 2)).device_tokens == 2  # touched: keep it
    outcome = copier.complete(cache, r.pending[0])
    assert outcome.freed_pages == b""
    assert cache.match(tokens(1, 2)).device_tokens == 2
    clean(cache)
