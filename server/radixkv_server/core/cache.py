"""HierarchicalCache: one namespace's radix tree over device and host KV pages.

The public API of the core. Synchronous, single-owner (the daemon's event loop), no
I/O: bytes move through the `Copier` given at construction. Every method either
completes or raises a `CacheError` subclass before changing anything.
"""

from .device_ledger import DeviceLedger
from .errors import InvalidRequest, LockError, NotReady
from .invariants import check_invariants
from .loadback import LoadBacks
from .node import Node
from .results import InsertResult, MatchResult


class HierarchicalCache(LoadBacks):
    """Construct with `HierarchicalCache(config, copier, num_device_pages=, host_pages=)`."""

    # -- match -----------------------------------------------------------------------

    def match(self, tokens: bytes, extra_key: bytes = b"") -> MatchResult:
        """Longest cached prefix of `tokens` (whole pages only; a partial tail is ignored).

        Mutates structure only: splits the last node where the prompt diverges inside it,
        marks the path accessed, and keeps on the device a node whose write-back eviction
        is in flight. Never frees or moves data.
        """
        self._check_tokens(tokens, "Match")
        end = len(tokens) - len(tokens) % self.tree.stride
        self.counters.match_requests += 1
        self.counters.match_prompt_tokens += len(tokens) // 4
        root = self.tree.roots.get(extra_key)
        if root is None or end == 0:
            rid = root.id if root is not None else 0
            return MatchResult(b"", 0, 0, rid, rid, ())
        path, partial, k = self.tree.walk(root, tokens[:end] if end < len(tokens) else tokens)
        if partial is not None:
            path.append(self._split(partial, k))
        now = self._tick()
        device_pages = []
        device_tokens = host_tokens = 0
        device_node = root
        for node in path:
            node.last_access = now
            s = node.full
            if s.device_pages is not None:
                s.evicting = False
                device_pages.append(s.device_pages)
                device_tokens += self._tokens(node)
                device_node = node
            else:
                host_tokens += self._tokens(node)
        host_node = path[-1] if path else root
        self.counters.device_hit_tokens += device_tokens
        self.counters.host_hit_tokens += host_tokens
        depends_on = self._copying(path[: len(device_pages)])
        return MatchResult(
            b"".join(device_pages), device_tokens, host_tokens,
            device_node.id, host_node.id, tuple(sorted(depends_on)),
        )

    # -- insert ----------------------------------------------------------------------

    def insert(self, tokens: bytes, device_pages: bytes, extra_key: bytes = b"",
               chunked: bool = False) -> InsertResult:
        """Hand finished KV to the cache: `device_pages[i]` holds page i of `tokens`.

        `tokens` must be whole pages. Where the cache already holds the page on device,
        the caller's page is returned as redundant unless it is that very page; where
        the cache holds it only on host, the caller's page becomes its device copy; the
        rest becomes a new leaf. Every node on the path counts a hit (chunked inserts
        too: `chunked` is accepted for symmetry with engines and changes nothing) and
        the write policy starts backups.
        Raises InvalidRequest / PageOwnershipError, or NotReady while part of the prefix
        is still being loaded (wait for those transfers, then insert).
        """
        del chunked
        self._check_tokens(tokens, "Insert")
        ps = self.config.page_size
        num_tokens = len(tokens) // 4
        if num_tokens == 0:
            raise InvalidRequest("Insert: no tokens given")
        if num_tokens % ps:
            raise InvalidRequest(
                f"Insert: {num_tokens} tokens is not a whole number of pages (page_size {ps}); "
                f"insert the first {num_tokens - num_tokens % ps}"
            )
        if len(device_pages) % 4 or len(device_pages) // 4 != num_tokens // ps:
            raise InvalidRequest(
                f"Insert: {num_tokens} tokens need {num_tokens // ps} device pages, got {len(device_pages) / 4:g}"
            )
        root = self.tree.roots.get(extra_key)
        path, partial, k = self.tree.walk(root, tokens) if root is not None else ([], None, 0)
        segments = [(n, self._pages(n)) for n in path]
        if partial is not None:
            segments.append((partial, k))
        loading = self._copying(n for n, _ in segments)
        if loading:
            raise NotReady("Insert: part of this prefix is still being loaded", tuple(sorted(loading)))
        same = self._same_pages(segments, device_pages)
        self.device.check_new(device_pages, "Insert", allowed=same)

        if partial is not None:
            segments[-1] = (self._split(partial, k), k)
        root = self.tree.root(extra_key)
        now = self._tick()
        redundant = []
        off = 0
        for node, m in segments:
            given = device_pages[off * 4:(off + m) * 4]
            s = node.full
            if s.device_pages is None:
                self.device.take(given)
                self._set_device(node, given)  # host-only before: now a duplicate
            else:
                s.evicting = False
                if s.device_pages != given:
                    redundant.extend(
                        given[i:i + 4] for i in range(0, len(given), 4)
                        if given[i:i + 4] != s.device_pages[i:i + 4]
                    )
            node.hit_count += 1
            node.last_access = now
            off += m
        last = segments[-1][0] if segments else root
        if off * 4 < len(device_pages):
            leaf = self.tree.add_child(last, tokens[off * self.tree.stride:])
            leaf.hit_count = 1
            leaf.last_access = now
            pages = device_pages[off * 4:]
            self.device.take(pages)
            self._set_device(leaf, pages)
            last = leaf
        self.counters.inserted_tokens += num_tokens - off * ps
        self._start_backups(last)
        return InsertResult(off * ps, b"".join(redundant), last.id)

    def _same_pages(self, segments: list[tuple[Node, int]], given: bytes) -> bytes:
        """The caller's pages that are the cache's own page at the same position."""
        same = []
        off = 0
        for node, m in segments:
            mine = node.full.device_pages
            if mine is not None:
                mine = mine[:m * 4]
                theirs = given[off * 4:(off + m) * 4]
                if mine == theirs:  # the usual case: the engine passes back what it matched
                    same.append(mine)
                else:
                    same.extend(mine[i:i + 4] for i in range(0, m * 4, 4) if mine[i:i + 4] == theirs[i:i + 4])
            off += m
        return b"".join(same)

    # -- leases ----------------------------------------------------------------------

    def lock(self, node_id: int) -> None:
        """Protect the node's path from eviction (device and host) until `unlock`."""
        self._lock_path(self.tree.get(node_id))

    def unlock(self, node_id: int) -> None:
        """Release one `lock` of the node. Raises LockError if it holds none."""
        node = self.tree.get(node_id)
        if node.parent is not None and node.full.lock_ref <= 0:
            raise LockError(f"node {node_id} is not locked")
        self._unlock_path(node)

    # -- engine restart --------------------------------------------------------------

    def drop_device(self, num_device_pages: int) -> int:
        """Forget every device page (the engine that owned them is gone) and start a new
        device ledger of `num_device_pages`. Host copies stay; device-only nodes leave
        with the host-only nodes below them. Returns the tokens dropped from the tree.
        Raises NotReady while copies are in flight (finish them first)."""
        if self.transfers:
            raise NotReady("copies are still in flight", tuple(sorted(self.transfers)))
        dropped = 0
        for root in self.tree.roots.values():
            for node in list(root.children.values()):
                dropped += self._drop_device_below(node)
        self.device = DeviceLedger(num_device_pages)
        return dropped

    def _drop_device_below(self, node: Node) -> int:
        dropped = 0
        for child in list(node.children.values()):
            dropped += self._drop_device_below(child)
        s = node.full
        if s.device_pages is not None:
            self._clear_device(node)
        if s.host_pages is None:
            dropped += self._drop_subtree(node)
        return dropped

    def _drop_subtree(self, node: Node) -> int:
        dropped = self._tokens(node)
        for child in list(node.children.values()):
            dropped += self._drop_subtree(child)
        self._remove_node(node)
        return dropped

    # -- inspection ------------------------------------------------------------------

    def node(self, node_id: int) -> Node:
        return self.tree.get(node_id)

    def check_invariants(self) -> list[str]:
        """Every violated invariant, as one line each; empty when the state is sound."""
        return check_invariants(self)

    @staticmethod
    def _check_tokens(tokens: bytes, what: str) -> None:
        if len(tokens) % 4:
            raise InvalidRequest(f"{what}: token bytes ({len(tokens)}) are not a multiple of 4 (packed int32)")


__all__ = ["HierarchicalCache"]
