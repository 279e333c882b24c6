"""The third tier from the core's side: which nodes to store, their storage keys,
prefetches into reserved host pages, and host-only nodes built from fetched pages.

The core never touches storage itself: the `Copier` stores and fetches, and the core
only decides. A node's keys form a hash chain over the whole prefix (page_keys), so
each node caches the key of its last page (`chain`) for its children to continue from.
"""

from .node import Node
from .page_keys import ROOT, page_keys
from .pages import count
from .policy import StoragePolicy
from .results import FetchOutcome
from .state import CacheState
from .transfers import TransferKind


class StorageTier(CacheState):
    @property
    def storage_on(self) -> bool:
        return self.config.storage is not StoragePolicy.OFF

    # -- keys --------------------------------------------------------------------------

    def _chain(self, node: Node) -> bytes:
        """Storage key of the node's last page (the root's: the chain's start)."""
        if node.parent is None:
            return ROOT
        if node.chain is None:
            node.chain = self.storage_keys(node)[-1]
        return node.chain

    def storage_keys(self, node: Node) -> list[bytes]:
        """Storage keys of the node's pages."""
        keys = page_keys(self.config.storage_salt, node.key, self.config.page_size,
                         node.extra_key, start=self._chain(node.parent))
        node.chain = keys[-1]
        return keys

    def storage_probe(self, tokens: bytes, extra_key: bytes = b"") -> tuple[int, list[bytes]]:
        """Where the cached prefix of `tokens` ends (in pages), and the storage keys of
        the whole pages after it: what to ask the storage tier for. Changes nothing."""
        end = len(tokens) - len(tokens) % self.tree.stride
        root = self.tree.roots.get(extra_key)
        if root is None:
            return 0, page_keys(self.config.storage_salt, tokens[:end], self.config.page_size, extra_key)
        path, partial, k = self.tree.walk(root, tokens[:end])
        cached = sum(self._pages(n) for n in path)
        start = self._chain(path[-1]) if path else ROOT
        if partial is not None:
            start = page_keys(self.config.storage_salt, partial.key[:k * self.tree.stride],
                              self.config.page_size, extra_key, start=start)[-1]
            cached += k
        rest = tokens[cached * self.tree.stride:end]
        return cached, page_keys(self.config.storage_salt, rest, self.config.page_size, extra_key, start=start)

    # -- storing -------------------------------------------------------------------------

    def _start_store(self, nodes: list[Node], evicting_host: bool) -> None:
        """Write these nodes' (valid) host copies to storage; the host copies stay
        host-locked until the store completes."""
        if not nodes:
            return
        t = self._new_transfer(TransferKind.STORE, nodes)
        t.keys = [k for n in nodes for k in self.storage_keys(n)]
        for n in nodes:
            s = n.full
            s.store = t.id
            s.host_lock += 1
            s.evicting_host = evicting_host
            self._refresh(n)
        self._copier.store(t.id, t.host_pages, t.keys)

    def _store_written_through(self, nodes: list[Node]) -> None:
        """Storage write-through: store nodes whose host copy just became valid."""
        if self.config.storage is StoragePolicy.WRITE_THROUGH:
            self._start_store([n for n in nodes if not n.full.stored and n.full.store is None
                               and n.full.host_valid], evicting_host=False)

    def _finish_store(self, tid: int, error: str | None) -> None:
        t = self.transfers.pop(tid)
        for node in t.nodes:
            s = node.full
            s.store = None
            s.host_lock -= 1
            tokens = self._tokens(node)
            if error is None:
                s.stored = True
                self.counters.stored_tokens += tokens
            else:
                self.counters.store_failed_tokens += tokens
            leaving = s.evicting_host
            s.evicting_host = False
            self._refresh(node)
            if leaving and node in self.host_leaves:
                # Stored, or storage failed: the host eviction goes ahead either way, so
                # an unreachable store never pins the host pool full.
                self.host_leaves.discard(node)
                self.counters.host_evicted_tokens += tokens
                if error is not None:
                    self.counters.store_dropped_tokens += tokens
                self._remove_node(node)

    # -- prefetch ------------------------------------------------------------------------

    def start_prefetch(self, tokens: bytes, extra_key: bytes, max_pages: int, owner: object = None) -> int:
        """Reserve host pages for up to `max_pages` pages of `tokens` past the cached
        prefix and start fetching them from storage. Returns the transfer id, or 0 when
        there is nothing to fetch or no host room. Mutates: reserves host pages."""
        start, keys = self.storage_probe(tokens, extra_key)
        keys = keys[:max(0, max_pages)]
        if not keys:
            return 0
        host = self._alloc_host(len(keys))
        if host is None:
            return 0
        self.host_reserved += len(keys)
        t = self._new_transfer(TransferKind.FETCH, [], owner=owner)
        t.host_pages, t.keys, t.extra_key, t.start_page = host, keys, extra_key, start
        t.tokens = tokens[:(start + len(keys)) * self.tree.stride]
        self._copier.fetch(t.id, t.keys, host)
        return t.id

    def on_fetch_done(self, transfer: int, pages_read: int, error: str | None = None) -> FetchOutcome:
        """The first `pages_read` pages of a fetch arrived. They join the tree as host
        copies (new host-only nodes, or the host copy of device-only nodes); pages
        already cached elsewhere, or cut off from the tree by an eviction meanwhile,
        are freed. Mutates."""
        t = self.transfers.pop(transfer)
        self.host_reserved -= count(t.host_pages)
        n = max(0, min(pages_read, len(t.keys))) if error is None else 0
        got, rest = t.host_pages[:n * 4], t.host_pages[n * 4:]
        if rest:
            self.host.free(rest)
        added = self._insert_host(t.tokens[:(t.start_page + n) * self.tree.stride], t.start_page, got,
                                  t.extra_key) if n else 0
        self.counters.prefetched_tokens += added * self.config.page_size
        return FetchOutcome(pages_read=n, added_tokens=added * self.config.page_size)

    def _insert_host(self, tokens: bytes, first: int, host_pages: bytes, extra_key: bytes) -> int:
        """Attach fetched host pages (for pages `first`.. of `tokens`); returns pages added."""
        root = self.tree.root(extra_key)
        path, partial, k = self.tree.walk(root, tokens)
        cached = sum(self._pages(n) for n in path) + k
        if cached < first:  # the prefix before the fetched pages left the cache
            self.host.free(host_pages)
            return 0
        if partial is not None:
            path.append(self._split(partial, k))
        added = 0
        spare = []
        pos = 0
        for node in path:
            m = self._pages(node)
            lo, hi = max(first, pos), pos + m
            if lo < hi:
                pages = host_pages[(lo - first) * 4:(hi - first) * 4]
                s = node.full
                if lo == pos and s.host_pages is None and s.device_pages is not None:
                    s.host_pages = pages  # a device-only node gains its host copy
                    s.stored = True
                    self._refresh(node)
                    added += m
                else:
                    spare.append(pages)
            pos = hi
        for pages in spare:
            self.host.free(pages)
        if cached < len(tokens) // self.tree.stride:
            leaf = self.tree.add_child(path[-1] if path else root, tokens[cached * self.tree.stride:])
            leaf.last_access = self._tick()
            leaf.full.host_pages = host_pages[(cached - first) * 4:]
            leaf.full.stored = True
            self._refresh(leaf)
            self._refresh(leaf.parent)
            added += self._pages(leaf)
        return added
