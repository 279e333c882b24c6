"""Eviction order: strategies, and the incrementally kept sets of evictable nodes.

Eviction never scans the tree. Each kind of eviction (device leaves, host duplicates,
host-only leaves) keeps an `EvictableSet` that the cache state updates whenever a node's
state changes (`set`, `discard`) or it is accessed (`touched`).
"""

import heapq
import itertools
from collections import OrderedDict
from typing import Protocol

from .node import Node


class Strategy(Protocol):
    """Orders victims: the node with the smallest key goes first.

    A node's key may only grow over time (access time, hit count). `EvictableSet` relies
    on that to keep stale heap entries lazily instead of re-sorting on every access.
    `recency`: the key is the access time, so an accessed node's key is the newest of
    all; the set then keeps members in access order and an access costs O(1).
    """

    name: str
    recency: bool

    def key(self, node: Node): ...


class LRU:
    name = "lru"
    recency = True

    @staticmethod
    def key(node: Node):
        return node.last_access


class LFU:
    name = "lfu"
    recency = False

    @staticmethod
    def key(node: Node):
        return (node.hit_count, node.last_access)


class FIFO:
    name = "fifo"
    recency = False

    @staticmethod
    def key(node: Node):
        return node.id  # ids grow with creation order


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (LRU(), LFU(), FIFO())}


def strategy(name: str) -> Strategy:
    """Look up an eviction strategy by name; ValueError lists the known ones."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(STRATEGIES)}"
        ) from None


class EvictableSet:
    """A set of nodes with pop-min in strategy order.

    Two structures hold the members, each member in exactly one:
    - `_recent` (recency strategies only): members in key order. An accessed member
      moves to its end (its key is the newest), and a member joining with a key no older
      than the last one's is appended: O(1) each, so eviction cost never depends on how
      many accesses came before it.
    - a heap of (key, sequence, node) for every other member: one live entry each,
      tagged with a sequence number. An entry whose key grew since it was pushed is
      pushed again with the current key, which keeps pop exact because keys never shrink.
      Entries of members that left the heap (discarded, or moved to `_recent` by an
      access) go stale: pop skips one it meets on top, and while stale entries exceed
      half the live ones plus a constant, every operation sweeps `SWEEP` heap positions
      and removes at most `SWEEP_REMOVALS` stale entries there (O(log n) each). No call
      ever rebuilds the heap, so no match or eviction pays for the history before it,
      and entries stay within twice the members plus a constant.
    `pop` takes the smaller of the two heads.
    """

    def __init__(self, order: Strategy):
        self._key = order.key
        self._recency = order.recency
        self._recent: OrderedDict[int, Node] = OrderedDict()
        self._in_heap: dict[int, int] = {}  # node id -> sequence of its live heap entry
        self._heap: list[tuple[object, int, Node]] = []
        self._seq = itertools.count()
        self._cursor = 0  # heap position the sweep examines next (root first, then down the list)

    def __len__(self) -> int:
        return len(self._recent) + len(self._in_heap)

    def __contains__(self, node: Node) -> bool:
        return node.id in self._recent or node.id in self._in_heap

    def ids(self) -> set[int]:
        return set(self._recent) | set(self._in_heap)

    def num_entries(self) -> int:
        """Entries held, live or stale (stays within twice the members, plus a constant)."""
        return len(self._recent) + len(self._heap)

    def clear(self) -> None:
        """Forget every member."""
        self._recent.clear()
        self._in_heap.clear()
        self._heap.clear()
        self._cursor = 0

    def add(self, node: Node) -> None:
        if node in self:
            return
        if self._recency and self._fits_at_end(node):
            self._recent[node.id] = node
            return
        seq = next(self._seq)
        self._in_heap[node.id] = seq
        heapq.heappush(self._heap, (self._key(node), seq, node))

    def discard(self, node: Node) -> None:
        if self._recent.pop(node.id, None) is None and self._in_heap.pop(node.id, None) is not None:
            self._sweep()

    def set(self, node: Node, member: bool) -> None:
        if member:
            self.add(node)
        else:
            self.discard(node)

    def touched(self, node: Node) -> None:
        """The node was accessed: its key grew. Recency strategies move a member to the
        end of the access order; others refresh its heap entry lazily, on pop."""
        if not self._recency:
            return
        if node.id in self._recent:
            self._recent.move_to_end(node.id)
        elif self._in_heap.pop(node.id, None) is not None:
            self._recent[node.id] = node  # its key is the newest now
            self._sweep()

    def pop(self) -> Node | None:
        """Remove and return the member with the smallest current key, or None."""
        head = self._heap_head()
        if self._recent:
            first = next(iter(self._recent.values()))
            if head is None or self._key(first) <= self._key(head):
                del self._recent[first.id]
                return first
        if head is None:
            return None
        heapq.heappop(self._heap)
        del self._in_heap[head.id]
        self._sweep()
        return head

    def _heap_head(self) -> Node | None:
        """The live heap entry with the smallest current key, left on top of the heap."""
        heap = self._heap
        while heap:
            key, seq, node = heap[0]
            if self._in_heap.get(node.id) != seq:
                heapq.heappop(heap)
                continue
            current = self._key(node)
            if current != key:
                heapq.heapreplace(heap, (current, seq, node))
                continue
            return node
        return None

    def _fits_at_end(self, node: Node) -> bool:
        if not self._recent:
            return True
        last = next(reversed(self._recent.values()))
        return self._key(node) >= self._key(last)

    def _sweep(self) -> None:
        """Bounded cleanup: while stale heap entries exceed half the live ones plus a
        constant, examine the next `SWEEP` positions (walking the heap list from its root
        toward its end, then again from the root: the entries pop meets first go first) and remove up to `SWEEP_REMOVALS`
        stale entries there. An operation adds at most one stale entry and a sweep in
        that regime finds several, so the stale count stays near its threshold without
        any call doing work proportional to the heap."""
        heap, live = self._heap, self._in_heap
        if len(heap) - len(live) <= (len(live) >> 3) + STALE_SLACK:
            return
        i = self._cursor
        removed = 0
        for _ in range(SWEEP):
            if i >= len(heap):
                i = 0
            if live.get(heap[i][2].id) != heap[i][1]:
                _remove_at(heap, i)  # what moves into position i is examined next
                removed += 1
                if removed == SWEEP_REMOVALS:
                    break
            else:
                i += 1
        self._cursor = i


SWEEP = 32           # heap positions one operation examines while the heap holds too many stale entries
SWEEP_REMOVALS = 4   # stale entries one operation removes at most (each O(log n))
STALE_SLACK = 32     # stale entries tolerated beyond an eighth of the live ones


def _remove_at(heap: list, i: int) -> None:
    """Remove heap[i] and restore the heap property along one root-to-leaf path."""
    last = heap.pop()
    if i == len(heap):
        return
    heap[i] = last
    heapq._siftup(heap, i)         # down into the subtree (then back up to i at most)
    heapq._siftdown(heap, 0, i)    # up toward the root, if smaller than its new parent
