"""Events from the real core: a router index rebuilt from the published batches holds, per
tier, exactly the blocks the cache holds, after randomized walks with device and host
evictions, load-backs, prefetches and storage stores (the core's seam, issue #13)."""

import pathlib
import random
import sys

import pytest

from radixkv.routing import RoutingIndex, WorkerFeed
from radixkv.routing.blockhash import block_hashes
from radixkv.routing.wire import KVEventBatch, decode_batch
from radixkv_server.core import CacheConfig, HierarchicalCache
from radixkv_server.core.engine_tier import EngineTier
from radixkv_server.core.pages import pack
from radixkv_server.events import EventHub, EventsConfig, resident
from radixkv_server.events import hub as events_hub

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "core"))
from engine_machine import RankCopier  # noqa: E402  (tests/core's tensor-parallel ranks)
from harness import MemoryCopier  # noqa: E402
from machine import PAGE, CoreMachine, prompt_bytes, walk  # noqa: E402  (tests/core's engine model)

from .helpers import wait_for  # noqa: E402

NS = "m/tp0"


def node_hashes(node) -> set[int]:
    prompt = b"".join(n.key for n in reversed(node.path()))
    first = (len(prompt) - len(node.key)) // (4 * PAGE)
    return set(block_hashes(prompt, PAGE, extra_key=node.extra_key)[first:])


def cache_blocks(machine) -> dict[str, set[int]]:
    """What the cache holds, as block hashes: device pages, valid host copies, and what
    the storage tier holds (pages written there, whether or not still in the tree)."""
    out = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    for node in machine.cache.tree.iter_nodes():
        if node.full.device_pages is not None:
            out["GPU"] |= node_hashes(node)
        if node.full.host_valid:
            out["CPU"] |= node_hashes(node)
    for ident in machine.copier.storage.values():
        extra, _, prefix = ident.partition(b"|")
        out["STORAGE"].add(block_hashes(prefix, PAGE, extra_key=extra)[-1])
    return out


class Follower:
    """A router's view of one daemon, fed from the in-process fan-out."""

    def __init__(self, hub, flush=None):
        self.hub = hub
        self.flush = flush or hub.flush
        self.sub = hub.subscribe(from_seq=0)
        self.index = RoutingIndex(PAGE)
        self.feed = WorkerFeed("d0", self.index)

    def catch_up(self) -> None:
        def done():
            self.flush()
            for item in iter(self.sub.get_nowait, None):
                self.feed.on_live(item.topic, item.seq, item.payload, can_replay=False)
            return self.hub.drained and self.feed.last_seq == self.hub.next_seq - 1
        wait_for(done, 20, "events published")

    def blocks(self) -> dict[str, set[int]]:
        return {m: self.index.blocks("d0", NS, m) for m in ("GPU", "CPU", "STORAGE")}


@pytest.mark.parametrize("policy,storage", [
    ("write_through", "off"), ("write_back", "off"),
    ("write_through", "write_back"), ("write_back", "write_through")])
def test_rebuilt_index_equals_the_cache_per_tier(policy, storage):
    m, hub, _ = machine_with_events(policy, storage)
    try:
        follower = Follower(hub)
        rnd = random.Random(11)
        for _ in range(6):
            walk(m, rnd, 150)
            follower.catch_up()
            assert follower.blocks() == cache_blocks(m)
        m.teardown()
        follower.catch_up()
        final = follower.blocks()
        assert final == cache_blocks(m) and final["GPU"] == set()
        if storage != "off":
            assert final["STORAGE"], "the walk stored nothing: the storage check saw nothing"
        assert follower.feed.num_resets == 0 and follower.feed.num_gaps == 0
    finally:
        hub.close()


class StorageKnowledge:
    """What a router must know of the storage tier, from the core's own seam: since the
    last resync, every node the core holds as stored when that resync was taken (what it
    re-announces), plus every store completed after it (storage reports no removals)."""

    def __init__(self, hub, cache, listener):
        self.hub, self.cache, self.listener = hub, cache, listener
        self.blocks: set[int] = set()
        self.num_resyncs = 0
        self.num_announced = 0  # storage blocks the resyncs re-announced, summed

    def residency_changed(self, tier, change, node) -> None:
        self.listener.residency_changed(tier, change, node)
        if tier == "storage" and not self.hub.resync_pending:  # else the hub records nothing
            self.blocks |= node_hashes(node)

    def flush(self) -> None:
        due = self.hub.resync_pending
        self.hub.flush()
        if due and not self.hub.resync_pending:  # this flush queued the resync
            self.blocks = set().union(*(node_hashes(n) for n in self.cache.tree.iter_nodes()
                                        if n.full.stored))
            self.num_resyncs += 1
            self.num_announced += len(self.blocks)


@pytest.mark.parametrize("policy,storage", [  # pairs whose walks keep stored nodes in the tree
    ("write_back", "off"), ("write_back", "write_back"), ("write_through", "write_through"),
    ("write_back", "write_through")])
def test_dropped_batches_resync_to_the_cache_state(policy, storage):
    """A queue too small for the walk: batches are dropped, the namespace resyncs from
    the daemon's snapshot (`events.resident`), and the rebuilt index equals the cache on
    device and host, and on storage holds what the core knew at the resync plus what was
    stored since: never a page storage lacks."""
    m = type("M", (CoreMachine,), {"policy": policy, "storage": storage})()
    hub = EventHub(EventsConfig(queue_size=2, subscriber_buffer=100_000))
    try:
        listener = hub.attach(NS, PAGE, snapshot=lambda: resident(m.cache.tree))
        known = StorageKnowledge(hub, m.cache, listener)
        m.cache.residency_listener = known
        follower = Follower(hub, flush=known.flush)
        rnd = random.Random(5)
        for _ in range(300):
            walk(m, rnd, 2)
            known.flush()
        follower.catch_up()
        assert hub.stats()["dropped"] > 0 and known.num_resyncs > 0
        blocks, want = follower.blocks(), cache_blocks(m)
        assert blocks["GPU"] == want["GPU"] and blocks["CPU"] == want["CPU"]
        assert blocks["STORAGE"] == known.blocks and blocks["STORAGE"] <= want["STORAGE"]
        if storage != "off":
            assert known.num_announced, "no resync had stored pages to re-announce"
    finally:
        hub.close()


def machine_with_events(policy: str, storage: str = "off", **events):
    """A core machine (`policy`, `storage`) telling a fresh hub's listener (EventsConfig
    `events` besides a large subscriber buffer), which has the daemon's snapshot
    function: (machine, hub, listener). Close the hub."""
    m = type("M", (CoreMachine,), {"policy": policy, "storage": storage})()
    hub = EventHub(EventsConfig(subscriber_buffer=100_000, **events))
    listener = hub.attach(NS, PAGE, snapshot=lambda: resident(m.cache.tree))
    m.cache.residency_listener = listener
    return m, hub, listener


def test_a_resync_told_a_slice_per_turn_while_the_cache_changes_ends_where_the_cache_is(monkeypatch):
    """A resync tells the tree a slice per loop turn (RESYNC_SLICE pairs; 1 here, so that
    it takes many turns), with the engines' calls and their live events in between: nodes
    inserted, split, evicted and removed while it goes. The rebuilt index ends equal to
    the cache on device and host. The resync follows a batch that failed to build."""
    monkeypatch.setattr(events_hub, "RESYNC_SLICE", 1)
    turns = 0
    for seed in range(6):
        m, hub, listener = machine_with_events("write_through")
        try:
            follower = Follower(hub)
            rnd = random.Random(seed)
            for _ in range(1000):  # a tree of several (tier, node) pairs to tell
                walk(m, rnd, 1)
                if len(list(resident(m.cache.tree))) >= 8:
                    break
            follower.catch_up()
            good_build = listener.builder.build
            listener.builder.build = lambda records: 1 / 0  # the next batch is lost
            while not listener.pending:
                walk(m, rnd, 1)
            hub.flush()
            wait_for(lambda: hub.stats()["build_errors"] == 1 and hub.drained, what="the batch dropped")
            listener.builder.build = good_build
            hub.flush()  # the resync's first slice
            while listener.resyncing:
                walk(m, rnd, 1)  # the loop's other work between two slices
                hub.flush()
                turns += 1
            walk(m, rnd, 5)
            follower.catch_up()
            blocks, want = follower.blocks(), cache_blocks(m)
            assert (blocks["GPU"], blocks["CPU"]) == (want["GPU"], want["CPU"]), seed
        finally:
            hub.close()
    assert turns >= 20, f"the resyncs took {turns} turns in all: slices were not exercised"


def test_a_snapshot_made_slice_by_slice_while_the_tree_changes_ends_where_the_cache_is():
    """A WatchEvents snapshot is made a slice at a time, with the engines' calls between
    slices: nodes are inserted, split (a split changes no residency, so no live event
    tells of its new upper part), evicted and removed meanwhile. A reader that applies
    the snapshot, then the live batches from where it began, holds what the cache holds
    on device and host. Over many seeds, so that splits of listed nodes happen."""
    splits = 0
    for seed in range(40):
        m, hub, listener = machine_with_events("write_back")
        try:
            rnd = random.Random(seed)
            walk(m, rnd, 200)
            hub.flush()
            wait_for(lambda: hub.drained, what="the warm-up's events published")
            newest = m.cache.tree.newest_id()
            live = hub.subscribe()
            index = RoutingIndex(PAGE)
            for events, _ in listener.snapshot_slices(1):
                index.apply("d0", NS, KVEventBatch(ts=0.0, events=events))
                walk(m, rnd, 3)  # the loop's other work between two slices
                hub.flush()
            wait_for(lambda: hub.drained, what="the live events published")
            for item in iter(live.get_nowait, None):
                index.apply("d0", NS, decode_batch(item.payload))
            want = cache_blocks(m)
            assert {t: index.blocks("d0", NS, t) for t in ("GPU", "CPU")} == {t: want[t] for t in ("GPU", "CPU")}, seed
            splits += sum(1 for n in m.cache.tree.iter_nodes()
                          if n.id > newest and any(c.id <= newest for c in n.children.values()))
        finally:
            hub.close()
    assert splits, "no listed node was split during a snapshot: the case was not exercised"


def snapshot_blocks(cache) -> dict[str, set[int]]:
    """What a resync would announce now (the daemon's snapshot), per medium."""
    out = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    medium = {"device": "GPU", "host": "CPU", "storage": "STORAGE"}
    for tier, node in resident(cache.tree):
        out[medium[tier]] |= node_hashes(node)
    return out


def test_a_resync_of_an_engine_managed_namespace_says_what_its_live_events_said():
    """Tensor parallel 2, storage write-through: a prefix only one rank saved is on no
    tier for the live events nor for a resync; once both ranks saved it and its store
    finished, both say CPU and STORAGE."""
    copier = MemoryCopier()
    cache = HierarchicalCache(CacheConfig(page_size=PAGE, write_policy="write_back", storage="write_through",
                                          storage_salt=b"s"), copier, num_device_pages=0, host_pages=8)
    ranks = RankCopier()
    tier = EngineTier(cache.state, cache.host_space, ranks, 2)
    hub = EventHub(EventsConfig(subscriber_buffer=1000))
    try:
        cache.residency_listener = hub.attach(NS, PAGE)
        follower = Follower(hub)
        prompt = prompt_bytes([1, 2])
        tier.save(prompt, pack([0, 1]), b"", owner=0, rank=0)
        ranks.complete(tier, *ranks.pending, False)
        follower.catch_up()
        nothing = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        assert follower.blocks() == nothing and snapshot_blocks(cache) == nothing
        tier.save(prompt, pack([0, 1]), b"", owner=1, rank=1)
        ranks.complete(tier, *ranks.pending, False)
        copier.complete_all(cache)  # the write-through store
        follower.catch_up()
        blocks = follower.blocks()
        assert blocks["CPU"] and blocks["STORAGE"] == blocks["CPU"] and blocks == snapshot_blocks(cache)
    finally:
        hub.close()


@pytest.mark.parametrize("policy,storage", [("write_through", "write_through"), ("write_back", "off")])
def test_presence_events_hold_what_the_device_or_host_holds_after_every_step(policy, storage):
    """--kv-events-presence, for routers that ignore `medium`: after every step of a walk
    (splits of shared prefixes, device and host evictions, load-backs, fetches), the
    blocks a router holds from events without a medium are exactly those on the device
    or the host. A node split gives its upper part a new id that no record announced:
    deciding from what earlier records said, a device eviction of that part read as the
    block gone while its host copy stayed."""
    m, hub, _ = machine_with_events(policy, storage, presence=True)
    try:
        follower = Follower(hub)
        rnd = random.Random(5)
        for _ in range(300):
            walk(m, rnd, 1)
            follower.catch_up()
            held, cache = follower.blocks(), cache_blocks(m)
            assert held == {"GPU": cache["GPU"] | cache["CPU"], "CPU": set(), "STORAGE": set()}
        assert follower.feed.num_resets == 0 and follower.index.num_unknown_medium == 0
    finally:
        hub.close()
