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
      tagged with a sequence number. Entries of removed members are skipped when popped
      (and compacted away once they outnumber the live ones); an entry whose key grew
      since it was pushed is pushed again with the current key, which keeps pop exact
      because keys never shrink.
    `pop` takes the smaller of the two heads.
    """

    def __init__(self, order: Strategy):
        self._key = order.key
        self._recency = order.recency
        self._recent: OrderedDict[int, Node] = OrderedDict()
        self._in_heap: dict[int, int] = {}  # node id -> sequence of its live heap entry
        self._heap: list[tuple[object, int, Node]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._recent) + len(self._in_heap)

    def __contains__(self, node: Node) -> bool:
        return node.id in self._recent or node.id in self._in_heap

    def ids(self) -> set[int]:
        return set(self._recent) | set(self._in_heap)

    def num_entries(self) -> int:
        """Entries held, live or stale (stays within twice the members, plus a constant)."""
        return len(self._recent) + len(self._heap)

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
            self._maybe_compact()

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
            self._maybe_compact()

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

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * len(self._in_heap) + 64:
            live = [e for e in self._heap if self._in_heap.get(e[2].id) == e[1]]
            heapq.heapify(live)
            self._heap = live
