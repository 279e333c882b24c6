"""The third tier from the core's side: storage keys, and which nodes to store when.

The core never touches storage itself: the `Copier` stores and fetches, and the core
only decides. A node's keys form a hash chain over the whole prefix (page_keys), so
each node caches the key of its last page (`chain`) for its children to continue from.
Prefetches (storage -> host) live in prefetch.py.
"""

from collections import deque

from .copier import Copier
from .node import Node
from .page_keys import ROOT, page_keys
from .cache_config import StoragePolicy
from .state import CacheState
from .transfers import TransferKind


class StorageTier:
    """Storage keys and stores of host copies. Receives the cache's state and copier."""

    def __init__(self, state: CacheState, copier: Copier):
        self.state = state
        self.copier = copier
        self.config = state.config

    @property
    def on(self) -> bool:
        return self.config.storage is not StoragePolicy.OFF

    # -- keys --------------------------------------------------------------------------

    def chain(self, node: Node) -> bytes:
        """Storage key of the node's last page (the root's: the chain's start), computed
        down from the nearest ancestor that knows its own (no recursion: a path may be
        thousands of nodes deep, none of them stored yet)."""
        unknown = []
        while node.parent is not None and node.chain is None:
            unknown.append(node)
            node = node.parent
        start = ROOT if node.parent is None else node.chain
        for n in reversed(unknown):
            start = n.chain = self._keys(n.key, n.extra_key, start)[-1]
        return start

    def keys(self, node: Node) -> list[bytes]:
        """Storage keys of the node's pages."""
        keys = self._keys(node.key, node.extra_key, self.chain(node.parent))
        node.chain = keys[-1]
        return keys

    def _keys(self, tokens: bytes, extra_key: bytes, start: bytes | None = None) -> list[bytes]:
        return page_keys(self.config.storage_salt, tokens, self.config.page_size, extra_key, start=start)

    def probe(self, tokens: bytes, extra_key: bytes = b"") -> tuple[int, list[bytes]]:
        """Where the cached prefix of `tokens` ends (in pages), and the storage keys of
        the whole pages after it: what to ask the storage tier for. The prefix ends at an
        engine-managed node some rank's shard has not reached: storage may hold it whole.
        Changes nothing."""
        tree = self.state.tree
        end = len(tokens) - len(tokens) % tree.stride
        root = tree.roots.get(extra_key)
        if root is None:
            return 0, self._keys(tokens[:end], extra_key)
        path, partial, k = tree.walk(root, tokens[:end])
        whole = next((i for i, n in enumerate(path) if n.full.shards_missing), len(path))
        if whole < len(path) or (partial is not None and partial.full.shards_missing):
            path, partial = path[:whole], None
        cached = sum(tree.pages_of(n) for n in path)
        start = self.chain(path[-1]) if path else ROOT
        if partial is not None:
            start = self._keys(partial.key[:k * tree.stride], extra_key, start)[-1]
            cached += k
        return cached, self._keys(tokens[cached * tree.stride:end], extra_key, start)

    # -- storing -------------------------------------------------------------------------

    def start_store(self, nodes: list[Node], evicting_host: bool) -> int:
        """Write these nodes' (valid) host copies to storage; the host copies stay
        host-locked until the store completes (`finish_store`). Returns the store's
        transfer id (0: no nodes, nothing started)."""
        if not nodes:
            return 0
        keys = [k for n in nodes for k in self.keys(n)]  # before the transfer: nothing half-recorded
        t = self.state.new_transfer(TransferKind.STORE, nodes)
        t.keys = keys
        if evicting_host:
            self.state.room_stores[t.id] = None
        for n in nodes:
            self.state.begin_store(n, t.id, evicting_host)
        self.copier.store(t.id, t.host_pages, t.keys)
        return t.id

    def store_written_through(self, nodes: list[Node]) -> None:
        """Storage write-through: store nodes whose host copy just became valid."""
        if self.config.storage is StoragePolicy.WRITE_THROUGH:
            self.start_store([n for n in nodes if _storable(n)], evicting_host=False)

    def unstored(self) -> list[Node]:
        """Every node with a whole host copy that storage does not hold and no store is
        writing (under storage write-back, host copies reach storage only when evicted),
        parents before children: stored in this order, a run cut short still leaves
        prefixes that storage can serve."""
        out, todo = [], deque(self.state.tree.roots.values())
        while todo:
            for child in todo.popleft().children.values():
                todo.append(child)
                if _storable(child):
                    out.append(child)
        return out

    def store_now(self, nodes: list[Node]) -> int:
        """Start one store of those `nodes` still in the tree that are still storable (as
        `unstored` chose them); its transfer id, 0 when none was."""
        live = self.state.tree.nodes
        return self.start_store([n for n in nodes if live.get(n.id) is n and _storable(n)], evicting_host=False)

    def finish_store(self, tid: int, error: str | None) -> None:
        """A store completed (`error` set when it failed). Host copies that waited for it
        to leave the host leave now, stored or not, so an unreachable store never pins
        the host pool full."""
        state = self.state
        counters = state.counters
        state.room_stores.pop(tid, None)
        for node in state.transfers.pop(tid).nodes:
            tokens = state.tokens(node)
            if error is None:
                counters.stored_tokens += tokens
            else:
                counters.store_failed_tokens += tokens
            leaving = state.end_store(node, ok=error is None)
            if leaving and node in state.host_leaves:
                state.host_leaves.discard(node)
                counters.host_evicted_tokens += tokens
                if error is not None:
                    counters.store_dropped_tokens += tokens
                state.remove_node(node)


def _storable(node: Node) -> bool:
    """Whether a store may take the node's host copy now: whole (every rank's shard
    arrived), not in storage, not being stored."""
    s = node.full
    return s.host_valid and not s.stored and s.store is None and not s.shards_missing


__all__ = ["StorageTier"]
