"""Room in the host pool: allocation that evicts when the pool is full, and host eviction.

The one owner of "make host room": backups, write-backs and prefetches allocate here,
and the `EvictHost` operation frees here. Order: host copies of settled duplicates first
(the device copy stays; in every write policy, which avoids the host-pool starvation
write-through suffers in SGLang), then host-only leaves (stored to L3 first where the
storage tier is on and lacks them).
"""

from .node import Node
from .state import CacheState
from .storage_tier import StorageTier
from .transfers import TransferKind


class HostSpace:
    """Receives the cache's state and its storage tier (to store leaves before they go)."""

    # With storage on: how many not-yet-stored leaves the search may pass over while
    # looking for stored ones, before settling for the writes it started.
    STORE_SEARCH_LIMIT = 64

    def __init__(self, state: CacheState, storage: StorageTier):
        self.state = state
        self.storage = storage

    def alloc(self, n: int) -> bytes | None:
        """`n` host pages, evicting what `evict` may to make room; None when even that
        leaves too few free (nothing is taken then)."""
        host = self.state.host
        pages = host.alloc(n)
        if pages is None:
            self.evict(n - host.num_free)
            pages = host.alloc(n)
        return pages

    def take_free(self, n: int) -> bytes | None:
        """Up to `n` of the host pages free now, evicting nothing (after `alloc` found too
        few: what its eviction left); None when none is free."""
        free = min(n, self.state.host.num_free)
        return self.state.host.alloc(free) if free > 0 else None

    def stores_in_flight(self) -> tuple[int, ...]:
        """Every store in flight: when one ends its host pages are stored, so eviction may
        take them at once (or they leave, for a store that evicts): room that may come."""
        return tuple(tid for tid, t in self.state.transfers.items() if t.kind is TransferKind.STORE)

    def stores_freeing_room(self) -> tuple[int, ...]:
        """The stores in flight whose host copies leave the host when they end (stored
        or not): room that is coming."""
        return tuple(self.state.room_stores)

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages if possible; returns how many were freed.

        First reclaims host copies of settled duplicates, then removes host-only leaves
        from the cache. Where the storage tier is on, a leaf it lacks is written there
        first and leaves when the write completes: up to `num_pages` of such writes start,
        while the search goes on for leaves storage already holds, which free their pages
        at once. Copies in flight, pins and locks protect a node. Mutates the tree.
        """
        freed = self._reclaim_duplicates(num_pages)
        if freed < num_pages:
            freed += self._evict_leaves(num_pages - freed)
        return freed

    def _reclaim_duplicates(self, num_pages: int) -> int:
        state = self.state
        freed = 0
        while freed < num_pages:
            node = state.duplicates.pop()  # none host-locked: a copy reading it keeps it out
            if node is None:
                break
            freed += state.pages(node)
            state.clear_host(node)
            state.counters.reclaimed_duplicate_tokens += state.tokens(node)
        return freed

    def _evict_leaves(self, num_pages: int) -> int:
        state = self.state
        freed = storing = 0
        to_store: list[Node] = []
        passed: list[Node] = []
        while freed < num_pages and len(passed) < self.STORE_SEARCH_LIMIT:
            node = state.host_leaves.pop()
            if node is None:
                break
            if self.storage.on and not node.full.stored and not node.full.shards_missing:
                if storing < num_pages - freed:
                    to_store.append(node)
                    storing += state.pages(node)
                else:
                    passed.append(node)  # enough writes started: look for stored leaves
                continue
            freed += state.pages(node)
            state.counters.host_evicted_tokens += state.tokens(node)
            state.remove_node(node)
        for node in passed:
            state.refresh(node)
        self.storage.start_store(to_store, evicting_host=True)
        return freed


__all__ = ["HostSpace"]
