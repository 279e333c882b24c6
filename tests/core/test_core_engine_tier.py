"""Engine-managed namespaces in the core: saves, loads and tensor-parallel shards
(randomized sequences: engine_machine.py), and the rules a user notices directly."""

import random

import pytest
from hypothesis import HealthCheck, settings
from radixkv_server.core import CacheConfig, HierarchicalCache, InvalidRequest, NotReady
from radixkv_server.core.engine_tier import EngineTier
from radixkv_server.core.pages import pack, unpack

from engine_machine import PAGE, EngineTierMachine, RankCopier, ShardStore, prompt_bytes, shard, walk
from harness import MemoryCopier

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def machine(tp, storage="off"):
    """The hypothesis test case for `tp` ranks; bound only to a `Test*` name at module
    level, so pytest collects each machine once."""
    case = type(f"EngineTierMachine_tp{tp}_{storage}", (EngineTierMachine,), {"tp": tp, "storage": storage}).TestCase
    case.settings = SETTINGS
    return case


TestEngineTier = machine(2)
TestEngineTierStorage = machine(2, "write_back")
TestEngineTierStorageThrough = machine(2, "write_through")
TestEngineTierOneRank = machine(1, "write_back")
TestEngineTierThreeRanks = machine(3, "write_back")
TestEngineTierThreeRanksStorageThrough = machine(3, "write_through")


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("storage", ["off", "write_back", "write_through"])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_engine_tier_runs_long_sequences(tp, storage, seed):
    """Long seeded walks per rank count and storage policy, beyond what the shrinking
    examples cover: every rank saving the same prompts, and the store losing everything
    with fetches that read it before still in flight."""
    m = type("M", (EngineTierMachine,), {"tp": tp, "storage": storage})()
    walk(m, random.Random(seed), 1500)
    m.teardown()


def make(tp=2, host_pages=8):
    cache = HierarchicalCache(CacheConfig(page_size=PAGE, write_policy="write_back"), MemoryCopier(),
                              num_device_pages=0, host_pages=host_pages)
    copier = RankCopier()
    return cache, EngineTier(cache.state, cache.host_space, copier, tp), copier


def test_a_prefix_matches_only_once_every_rank_saved_it():
    cache, tier, copier = make(tp=2)
    prompt = prompt_bytes([1, 2])
    saved = tier.save(prompt, pack([0, 1]), b"", owner="r0", rank=0)
    node, t0 = saved.node, saved.transfer
    copier.complete(tier, t0, False)
    assert tier.complete_tokens(cache.match(prompt).host_node) == 0, "rank 1's shard is missing"
    again = tier.save(prompt, pack([5, 6]), b"", owner="r0", rank=0).transfer
    assert again == 0, "rank 0's shard is on host already: nothing to copy"
    t1 = tier.save(prompt, pack([0, 1]), b"", owner="r1", rank=1).transfer
    copier.complete(tier, t1, False)
    assert tier.complete_tokens(cache.match(prompt).host_node) == 4
    assert tier.check_invariants() == []


def test_a_failed_load_returns_its_pages_and_ranks_ack_their_own():
    cache, tier, copier = make(tp=1)
    prompt = prompt_bytes([1, 2, 3])
    t = tier.save(prompt, pack([0, 1, 2]), b"", owner="a", rank=0).transfer
    copier.complete(tier, t, False)
    tier.finish(t, owner="a")
    node = cache.match(prompt).host_node
    r = tier.load(node, pack([7, 8, 9]), 1, owner="b")
    assert (r.loaded_tokens, r.unused_pages) == (4, pack([9]))
    with pytest.raises(NotReady):
        tier.finish(r.transfer, owner="b")
    copier.complete(tier, r.transfer, True)
    done = tier.finish(r.transfer, owner="b")
    assert done.error and done.failed_pages == pack([7, 8])
    assert tier.check_invariants() == []


def test_bad_requests_change_nothing():
    cache, tier, _ = make(tp=2)
    with pytest.raises(InvalidRequest):
        tier.save(prompt_bytes([1]), pack([0]), b"", owner="x", rank=2)
    with pytest.raises(InvalidRequest):
        tier.save(prompt_bytes([1, 2]), pack([0]), b"", owner="x", rank=0)
    assert len(cache.tree.nodes) == 0 and tier.check_invariants() == []


def test_a_load_from_past_the_path_is_refused_not_answered_with_tokens_it_lacks():
    """A load from the path's end loads nothing and says the engine holds the path; one
    from further on once answered OK with made-up tokens (4000 for an 8-token path), or
    INTERNAL once the count passed 32 bits."""
    cache, tier, copier = make(tp=1)
    prompt = prompt_bytes([1, 2])
    t = tier.save(prompt, pack([0, 1]), b"", owner="a", rank=0).transfer
    copier.complete(tier, t, False)
    tier.finish(t, owner="a")
    node = cache.match(prompt).host_node
    at_end = tier.load(node, pack([5]), 2, owner="b")
    assert (at_end.transfer, at_end.device_tokens, at_end.loaded_tokens) == (0, 2 * PAGE, 0)
    for start in (3, 1000, 2**32 - 1):
        with pytest.raises(InvalidRequest, match=f"start_page {start} is past node {node}'s path \\(2 pages\\)"):
            tier.load(node, pack([5]), start, owner="b")
    assert tier.check_invariants() == []


def test_host_pressure_stores_complete_nodes_and_drops_incomplete_ones():
    cache = HierarchicalCache(CacheConfig(page_size=PAGE, write_policy="write_back", storage="write_back",
                                          storage_salt=b"s"), MemoryCopier(), num_device_pages=0, host_pages=4)
    copier = RankCopier()
    tier = EngineTier(cache.state, cache.host_space, copier, 2)
    whole, half = prompt_bytes([1, 2]), prompt_bytes([3, 2])
    for rank in (0, 1):
        copier.complete(tier, tier.save(whole, pack([0, 1]), b"", owner=rank, rank=rank).transfer, False)
    copier.complete(tier, tier.save(half, pack([2, 3]), b"", owner=0, rank=0).transfer, False)
    cache.evict_host(4)
    stores = [t for t in cache.transfers.values() if t.kind.value == "store"]
    assert [n.key for t in stores for n in t.nodes] == [whole], "only the complete prefix goes to storage"
    assert cache.match(half).host_tokens == 0, "the incomplete node left without being stored"
    assert tier.check_invariants() == []


def test_storage_write_through_stores_a_node_once_every_rank_saved_it():
    cache = HierarchicalCache(CacheConfig(page_size=PAGE, write_policy="write_back", storage="write_through",
                                          storage_salt=b"s"), MemoryCopier(), num_device_pages=0, host_pages=4)
    copier = RankCopier()
    tier = EngineTier(cache.state, cache.host_space, copier, 2)
    prompt = prompt_bytes([1, 2])
    copier.complete(tier, tier.save(prompt, pack([0, 1]), b"", owner=0, rank=0).transfer, False)
    assert not any(t.kind.value == "store" for t in cache.transfers.values()), "rank 1's shard is missing"
    copier.complete(tier, tier.save(prompt, pack([0, 1]), b"", owner=1, rank=1).transfer, False)
    assert [t.kind.value for t in cache.transfers.values()].count("store") == 1
    assert tier.check_invariants() == []


def test_a_node_one_rank_saved_again_is_completed_from_every_shard_storage_holds():
    """A prefix stored whole and gone from host; one rank saves it again (the others have
    not yet): storage is still asked for it, and a prefetch completes the node with the
    stored page of every rank instead of leaving it half there."""
    copier = RankCopier()
    store = ShardStore(copier)
    cache = HierarchicalCache(CacheConfig(page_size=PAGE, write_policy="write_back", storage="write_through",
                                          storage_salt=b"s"), store, num_device_pages=0, host_pages=4)
    tier = EngineTier(cache.state, cache.host_space, copier, 2)
    prompt = prompt_bytes([1, 2])
    ends = [prompt[:(i + 1) * PAGE * 4] for i in range(2)]
    for rank in (0, 1):
        for page, end in zip((0, 1), ends):
            copier.device[(rank, page)] = shard(end, b"", rank)
        copier.complete(tier, tier.save(prompt, pack([0, 1]), b"", owner=rank, rank=rank).transfer, False)
    store.complete_all(cache)  # written through
    cache.evict_host(4)
    assert cache.match(prompt).host_tokens == 0 and len(store.storage) == 2
    copier.complete(tier, tier.save(prompt, pack([0, 1]), b"", owner=0, rank=0).transfer, False)
    assert tier.complete_tokens(cache.match(prompt).host_node) == 0, "rank 1's shard is missing"
    start, keys = cache.storage_tier.probe(prompt)
    assert (start, len(keys)) == (0, 2), "storage is asked for the pages of the half-saved node"
    assert cache.start_prefetch(prompt, b"", 8)
    store.complete_all(cache)
    node = cache.tree.get(cache.match(prompt).host_node)
    assert tier.complete_tokens(node.id) == 4
    for host_page, end in zip(unpack(node.full.host_pages), ends):
        assert [copier.host[(host_page, rank)] for rank in (0, 1)] == [shard(end, b"", rank) for rank in (0, 1)]
    assert tier.check_invariants() == [] and cache.host.num_used == 2, "the half copy's pages were freed"


class Recorder:
    """A residency listener that keeps every (tier, change, node id) it is told."""

    def __init__(self):
        self.changes = []

    def residency_changed(self, tier, change, node) -> None:
        self.changes.append((tier, change, node.id))


def test_a_half_saved_node_leaving_the_host_is_never_said_removed():
    """Only a node every rank saved is told stored on host; one that leaves before that
    was never announced, so its removal is not told either (a router would drop blocks
    it never had, or another engine's same blocks)."""
    cache, tier, copier = make(tp=2, host_pages=4)
    cache.state.listener = recorder = Recorder()
    whole, half = prompt_bytes([1, 2]), prompt_bytes([3, 2])
    for rank in (0, 1):
        copier.complete(tier, tier.save(whole, pack([0, 1]), b"", owner=rank, rank=rank).transfer, False)
    copier.complete(tier, tier.save(half, pack([2, 3]), b"", owner=0, rank=0).transfer, False)
    whole_id, half_id = cache.match(whole).host_node, cache.match(half).host_node
    cache.evict_host(4)
    assert [c for c in recorder.changes if c[2] == half_id] == []
    assert [c[:2] for c in recorder.changes if c[2] == whole_id] == [("host", "stored"), ("host", "removed")]
    assert tier.check_invariants() == []
