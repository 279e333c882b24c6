"""Events from the real core: a router index rebuilt from the published batches holds, per
tier, exactly the blocks the cache holds, after randomized walks with device and host
evictions, load-backs, prefetches and storage stores (the core's seam, issue #13)."""

import pathlib
import random
import sys

import pytest

from radixkv.routing import RoutingIndex, WorkerFeed
from radixkv.routing.blockhash import block_hashes
from radixkv_server.events import EventHub, EventsConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "core"))
from machine import PAGE, CoreMachine, walk  # noqa: E402  (tests/core's engine model)

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

    def __init__(self, hub):
        self.hub = hub
        self.sub = hub.subscribe(from_seq=0)
        self.index = RoutingIndex(PAGE)
        self.feed = WorkerFeed("d0", self.index)

    def catch_up(self) -> None:
        def done():
            self.hub.flush()
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
    m = type("M", (CoreMachine,), {"policy": policy, "storage": storage})()
    hub = EventHub(EventsConfig(subscriber_buffer=100_000))
    try:
        m.cache.residency_listener = hub.attach(NS, PAGE)
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


def test_dropped_batches_resync_to_the_cache_state():
    """A queue too small for the walk: batches are dropped, the namespace resyncs from
    the core's snapshot, and the rebuilt index still equals the cache."""
    m = type("M", (CoreMachine,), {"policy": "write_back", "storage": "off"})()
    hub = EventHub(EventsConfig(queue_size=2, subscriber_buffer=100_000))

    def resident():
        for node in m.cache.tree.iter_nodes():
            if node.full.device_pages is not None:
                yield "device", node
            if node.full.host_valid:
                yield "host", node
    try:
        m.cache.residency_listener = hub.attach(NS, PAGE, snapshot=resident)
        follower = Follower(hub)
        rnd = random.Random(5)
        for _ in range(300):
            walk(m, rnd, 2)
            hub.flush()
        follower.catch_up()
        assert hub.stats()["dropped"] > 0
        blocks, want = follower.blocks(), cache_blocks(m)
        assert blocks["GPU"] == want["GPU"] and blocks["CPU"] == want["CPU"]
    finally:
        hub.close()
