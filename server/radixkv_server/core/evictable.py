"""Eviction order: strategies, and the incrementally kept sets of evictable nodes.

Eviction never scans the tree. Each kind of eviction (device leaves, host duplicates,
host-only leaves) keeps an `EvictableSet` that the cache updates whenever a node's state
changes; popping the next victim costs O(log n).
"""

import heapq
import itertools
from typing import Callable, Protocol

from .node import Node


class Strategy(Protocol):
    """Orders victims: the node with the smallest key goes first.

    A node's key may only grow over time (access time, hit count). `EvictableSet` relies
    on that to keep stale heap entries lazily instead of re-sorting on every access.
    """

    name: str

    def key(self, node: Node): ...


class LRU:
    name = "lru"

    @staticmethod
    def key(node: Node):
        return node.last_access


class LFU:
    name = "lfu"

    @staticmethod
    def key(node: Node):
        return (node.hit_count, node.last_access)


class FIFO:
    name = "fifo"

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

    Each member has exactly one live heap entry, tagged with a sequence number; entries
    of removed members are skipped when popped. An entry whose key grew since it was
    pushed is pushed again with the current key, which keeps pop exact because keys
    never shrink.
    """

    def __init__(self, key: Callable[[Node], object]):
        self._key = key
        self._members: dict[int, int] = {}  # node id -> sequence of its live entry
        self._heap: list[tuple[object, int, Node]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, node: Node) -> bool:
        return node.id in self._members

    def ids(self) -> set[int]:
        return set(self._members)

    def add(self, node: Node) -> None:
        if node.id in self._members:
            return
        seq = next(self._seq)
        self._members[node.id] = seq
        heapq.heappush(self._heap, (self._key(node), seq, node))

    def discard(self, node: Node) -> None:
        if self._members.pop(node.id, None) is not None:
            if len(self._heap) > 2 * len(self._members) + 1024:
                self._compact()

    def set(self, node: Node, member: bool) -> None:
        if member:
            self.add(node)
        else:
            self.discard(node)

    def touched(self, node: Node) -> None:
        """The node's key grew (it was accessed). Entries are refreshed lazily on pop."""

    def pop(self) -> Node | None:
        """Remove and return the member with the smallest current key, or None."""
        heap = self._heap
        while heap:
            key, seq, node = heapq.heappop(heap)
            if self._members.get(node.id) != seq:
                continue
            current = self._key(node)
            if current != key:
                heapq.heappush(heap, (current, seq, node))
                continue
            del self._members[node.id]
            return node
        return None

    def _compact(self) -> None:
        live = [e for e in self._heap if self._members.get(e[2].id) == e[1]]
        heapq.heapify(live)
        self._heap = live
