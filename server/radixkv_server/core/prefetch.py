"""Prefetch: storage -> host, into reserved host pages, and host-only nodes built from
the fetched pages when they arrive."""

from .copier import Copier
from .node import Node
from .pages import count
from .results import FetchOutcome
from .state import CacheState
from .storage_tier import StorageTier
from .host_space import HostSpace
from .transfers import TransferKind
from .errors import NotReady, UnknownTransfer


class Prefetches:
    """Receives the cache's state, host space (to reserve pages), storage tier (keys)
    and copier."""

    def __init__(self, state: CacheState, host_space: HostSpace, storage: StorageTier, copier: Copier):
        self.state = state
        self.host_space = host_space
        self.storage = storage
        self.copier = copier
        self.losses = 0  # storage_lost calls so far
        self._losses_at_read: dict[int, int] = {}  # fetch in flight -> `losses` when its read began

    def storage_lost(self) -> None:
        """The store may have lost its pages: fetches in flight bring right bytes that it
        may no longer hold, so their pages join the tree as not stored."""
        self.losses += 1

    def start(self, tokens: bytes, extra_key: bytes, max_pages: int, owner: object = None,
              ahead: object = None, losses_seen: int | None = None, partial: bool = False) -> int:
        """Reserve host pages for up to `max_pages` pages of `tokens` past the cached
        prefix and start fetching them from storage (`ahead` goes to the copier as is;
        `losses_seen`: `losses` when it was read, so a loss since makes its pages join
        as not stored). Returns the transfer id, or 0 when there is nothing to fetch or
        no host room. Mutates: reserves host pages (evicting).

        Room: the whole run where eviction makes it. Where it does not, while stores are
        in flight (the pages they write become evictable when they end) raises NotReady
        naming them, unless `partial`; with `partial`, or no store in flight, the run's
        first pages, as many as there is room for (a hit on part of the run beats none)."""
        state = self.state
        start, keys = self.storage.probe(tokens, extra_key)
        keys = keys[:max(0, max_pages)]
        if not keys:
            return 0
        host = self.host_space.alloc(len(keys))
        if host is None:
            stores = self.host_space.stores_in_flight()
            if stores and not partial:
                raise NotReady(f"no host room for {len(keys)} fetched pages until stores in flight end", stores)
            host = self.host_space.take_free(len(keys))
            if host is None:
                return 0
            keys = keys[:count(host)]
        state.host_reserved += len(keys)
        t = state.new_transfer(TransferKind.FETCH, [], owner=owner)
        t.host_pages, t.keys, t.extra_key, t.start_page = host, keys, extra_key, start
        t.tokens = tokens[:(start + len(keys)) * state.tree.stride]
        self._losses_at_read[t.id] = self.losses if losses_seen is None else losses_seen
        self.copier.fetch(t.id, t.keys, host, ahead)
        return t.id

    def done(self, transfer: int, pages_read: int, error: str | None = None) -> FetchOutcome:
        """The first `pages_read` pages of a fetch arrived. They join the tree as host
        copies (new host-only nodes, or the host copy of device-only nodes), counted as
        stored unless `storage_lost` came while the fetch ran; pages already cached
        elsewhere, or cut off from the tree by an eviction meanwhile, are freed. Raises
        UnknownTransfer unless `transfer` is a fetch in flight. Mutates."""
        state = self.state
        t = state.transfers.get(transfer)
        if t is None or t.kind is not TransferKind.FETCH:
            raise UnknownTransfer(f"transfer {transfer} is not a storage fetch in flight")
        state.transfers.pop(transfer)
        stored = self._losses_at_read.pop(transfer) == self.losses
        state.host_reserved -= count(t.host_pages)
        n = max(0, min(pages_read, len(t.keys))) if error is None else 0
        got, rest = t.host_pages[:n * 4], t.host_pages[n * 4:]
        if rest:
            state.host.free(rest)
        added = 0
        if n:
            tokens = t.tokens[:(t.start_page + n) * state.tree.stride]
            added = self.insert_host(tokens, t.start_page, got, t.extra_key, stored)
        state.counters.prefetched_tokens += added * state.config.page_size
        return FetchOutcome(pages_read=n, added_tokens=added * state.config.page_size)

    def insert_host(self, tokens: bytes, first: int, host_pages: bytes, extra_key: bytes,
                    stored: bool = True) -> int:
        """Attach fetched host pages (for pages `first`.. of `tokens`; `stored`: the store
        still holds them); returns pages added. Pages the tree holds already, or whose
        prefix left it, are freed."""
        state = self.state
        tree = state.tree
        root = tree.root(extra_key)
        path, partial, k = tree.walk(root, tokens)
        cached = sum(state.pages(n) for n in path) + k
        if cached < first:  # the prefix before the fetched pages left the cache
            state.host.free(host_pages)
            return 0
        if partial is not None:
            path.append(state.split(partial, k))
        added = self._attach_to_path(path, first, host_pages, stored)
        if cached < len(tokens) // tree.stride:
            leaf = tree.add_child(path[-1] if path else root, tokens[cached * tree.stride:])
            state.touch(leaf, state.tick())
            state.refresh(leaf.parent)
            state.attach_host(leaf, host_pages[(cached - first) * 4:], stored)
            added += state.pages(leaf)
        return added

    def _attach_to_path(self, path: list[Node], first: int, host_pages: bytes, stored: bool) -> int:
        """Fetched pages for nodes already in the tree: a device-only node gains its host
        copy, an engine-managed node missing a rank's shard (no save copying into it)
        takes them whole in place of its own; the rest (cached on host already) are
        freed. Returns pages attached."""
        state = self.state
        added = pos = 0
        spare = []
        for node in path:
            m = state.pages(node)
            lo, hi = max(first, pos), pos + m
            if lo < hi:
                pages = host_pages[(lo - first) * 4:(hi - first) * 4]
                s = node.full
                if lo == pos and s.host_pages is None and s.device_pages is not None:
                    state.attach_host(node, pages, stored)
                    added += m
                elif lo == pos and s.shards_missing and not s.pins and not s.host_lock:
                    state.complete_host(node, pages, stored)
                    added += m
                else:
                    spare.append(pages)
            pos = hi
        for pages in spare:
            state.host.free(pages)
        return added


__all__ = ["Prefetches"]
