"""EvictableSet: pop-min in strategy order, with a structure that history cannot grow.

Each strategy's key only grows (an access sets `last_access` to the newest time, LFU
also counts hits). The set is checked against a brute-force reference under random
adds, discards, accesses and pops, and its size against its membership after many
accesses (the lazy heap it replaced for LRU grew stale entries that the first eviction
after a burst of matches had to wade through).
"""

import random

import pytest
from radixkv_server.core.evictable import EvictableSet, strategy
from radixkv_server.core.node import Node


class Clock:
    def __init__(self):
        self.now = 0

    def touch(self, node: Node, members: EvictableSet, hit: bool = False) -> None:
        """What the cache state does on an access: newest time, then tell the set."""
        self.now += 1
        node.last_access = self.now
        node.hit_count += hit
        members.touched(node)


def make_nodes(n: int) -> list[Node]:
    return [Node(i + 1, None, b"", b"") for i in range(n)]


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo"])
def test_pop_is_the_smallest_current_key_under_random_operations(name):
    order = strategy(name)
    rnd = random.Random(name)
    clock = Clock()
    nodes = make_nodes(60)
    for n in nodes:  # old, scattered access times: members join out of key order
        n.last_access = rnd.randrange(1000)
    clock.now = 1000
    members = EvictableSet(order)
    reference: set[int] = set()
    for _ in range(20000):
        node = rnd.choice(nodes)
        op = rnd.randrange(5)
        if op == 0:
            members.add(node)
            reference.add(node.id)
        elif op == 1:
            members.discard(node)
            reference.discard(node.id)
        elif op == 2:
            clock.touch(node, members, hit=rnd.random() < 0.5)
        elif op == 3:
            got = members.pop()
            if not reference:
                assert got is None
                continue
            best = min(order.key(nodes[i - 1]) for i in reference)
            assert got is not None and got.id in reference and order.key(got) == best
            reference.discard(got.id)
        assert members.ids() == reference and len(members) == len(reference)


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo"])
def test_structure_stays_bounded_by_members_after_100k_accesses(name):
    clock = Clock()
    nodes = make_nodes(500)
    members = EvictableSet(strategy(name))
    for n in nodes:
        clock.touch(n, members)
        members.add(n)
    rnd = random.Random(5)
    for i in range(100_000):
        node = rnd.choice(nodes)
        clock.touch(node, members, hit=True)
        if i % 100 == 0:  # churn: leave and rejoin, as nodes do when locked and unlocked
            members.discard(node)
            members.add(node)
    assert len(members) == len(nodes)
    assert members.num_entries() <= 2 * len(members) + 64
    if strategy(name).recency:
        assert members.num_entries() == len(members)  # accesses add no entries at all


def test_lru_evicts_in_access_order_after_many_accesses():
    """The least recently accessed member goes first, however many accesses came since."""
    clock = Clock()
    nodes = make_nodes(1000)
    members = EvictableSet(strategy("lru"))
    for n in nodes:
        clock.touch(n, members)
        members.add(n)
    rnd = random.Random(9)
    for _ in range(50_000):
        clock.touch(rnd.choice(nodes), members)
    expected = sorted(nodes, key=lambda n: n.last_access)
    assert [members.pop() for _ in nodes] == expected
    assert members.pop() is None


class CountingLRU:
    """LRU that counts how often the set reads a key: the work one pop does."""

    name = "lru"
    recency = True

    def __init__(self):
        self.reads = 0

    def key(self, node: Node):
        self.reads += 1
        return node.last_access


def test_lru_pop_reads_a_few_keys_however_many_accesses_came_before():
    order = CountingLRU()
    clock = Clock()
    nodes = make_nodes(2000)
    members = EvictableSet(order)
    for n in nodes:
        clock.touch(n, members)
        members.add(n)
    rnd = random.Random(3)
    for _ in range(100_000):
        clock.touch(rnd.choice(nodes), members)
    order.reads = 0
    victim = members.pop()
    assert victim is min(nodes, key=lambda n: n.last_access)
    assert order.reads <= 4  # a lazy heap re-keys every member accessed since it was pushed


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo"])
def test_no_operation_rebuilds_the_heap_after_many_members_leave_it(name):
    """Members that joined out of key order live in the heap; touching (LRU) or
    discarding them leaves stale entries. The old structure dropped them all in one
    rebuild, paid by whichever call crossed the threshold (at 1M cached pages a match
    could pay hundreds of ms); now each call removes a few, and the structure stays
    bounded after every call, not only on average."""
    from radixkv_server.core.evictable import STALE_SLACK, SWEEP_REMOVALS
    clock = Clock()
    nodes = make_nodes(5000)
    rnd = random.Random(11)
    for n in nodes:
        n.last_access = rnd.randrange(1000)  # old, scattered: every member joins the heap
    clock.now = 1000
    members = EvictableSet(strategy(name))
    for n in reversed(nodes):
        members.add(n)
    most_dropped = 0
    order = nodes[:]
    rnd.shuffle(order)
    for i, node in enumerate(order):
        before = members.num_entries()
        if i % 3 == 0:
            members.discard(node)
        else:
            clock.touch(node, members, hit=True)
        if i % 7 == 0:
            before -= members.pop() is not None
        most_dropped = max(most_dropped, before - members.num_entries())
        assert members.num_entries() <= 2 * len(members) + 64
    # A pop may skip the stale entries on top of the heap (each once), never more than
    # the sweep lets accumulate; the rebuild dropped about two thirds of the heap at once.
    assert most_dropped <= len(nodes) // 8 + STALE_SLACK + SWEEP_REMOVALS
    popped = [members.pop() for _ in range(len(members))]
    keys = [strategy(name).key(n) for n in popped]
    assert keys == sorted(keys) and members.pop() is None
