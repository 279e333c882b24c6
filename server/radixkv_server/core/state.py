"""The cache's state and the primitive transitions every operation is built from.

Every change to a node's residency, locks or pins goes through the methods here, which
keep the derived bookkeeping exact: the evictable sets, the tracked duplicates, the
evictable/protected page counts and the device page ledger. Operations (cache.py,
loadback.py, eviction.py) never touch those structures directly.
"""

import itertools

from .device_ledger import DeviceLedger
from .evictable import EvictableSet, strategy
from .host_allocator import HostAllocator
from .node import Node
from .pages import count
from .policy import CacheConfig
from .results import CacheCounters
from .transfers import Transfer, TransferKind
from .tree import RadixTree


class CacheState:
    def __init__(self, config: CacheConfig, copier, *, num_device_pages: int, host_pages: int):
        self.config = config
        self.tree = RadixTree(config.page_size)
        self.host = HostAllocator(host_pages)
        self.device = DeviceLedger(num_device_pages)
        key = strategy(config.eviction_policy).key
        self.device_leaves = EvictableSet(key)  # device nodes with no device child, unlocked, settled
        self.duplicates = EvictableSet(key)     # settled duplicates (the tracked set)
        self.host_leaves = EvictableSet(key)    # host-only childless nodes, unlocked, unpinned
        self.transfers: dict[int, Transfer] = {}
        self.counters = CacheCounters()
        self.evictable_pages = 0  # device pages in unlocked nodes
        self.protected_pages = 0  # device pages in locked nodes
        self.host_reserved = 0    # host pages reserved by fetches in flight
        self._copier = copier
        self._clock = 0
        self._transfer_ids = itertools.count(1)

    # -- small helpers -----------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _pages(self, node: Node) -> int:
        return len(node.key) // self.tree.stride

    @staticmethod
    def _tokens(node: Node) -> int:
        return len(node.key) // 4

    # -- derived sets ------------------------------------------------------------------

    def _refresh(self, node: Node) -> None:
        """Recompute the node's membership of the evictable sets and the duplicate set."""
        if node.parent is None:
            return
        s = node.full
        on_device = s.device_pages is not None
        self.device_leaves.set(
            node,
            on_device and node.device_children == 0 and s.lock_ref == 0
            and s.backup is None and not s.pins,
        )
        # Settled duplicate: device and valid host copy, nothing pending on either.
        self.duplicates.set(node, on_device and s.host_valid and not s.pins)
        self.host_leaves.set(
            node,
            not on_device and s.host_pages is not None and not node.children
            and s.lock_ref == 0 and s.host_lock == 0 and not s.pins,
        )

    def _forget(self, node: Node) -> None:
        self.device_leaves.discard(node)
        self.duplicates.discard(node)
        self.host_leaves.discard(node)

    # -- residency transitions -----------------------------------------------------------

    def _set_device(self, node: Node, pages: bytes) -> None:
        """Publish device pages on a node that had none. The ledger is the caller's."""
        s = node.full
        s.device_pages = pages
        node.parent.device_children += 1
        if s.lock_ref:
            self.protected_pages += count(pages)
        else:
            self.evictable_pages += count(pages)
        self._refresh(node)
        self._refresh(node.parent)

    def _clear_device(self, node: Node) -> bytes:
        """Take the device pages off a node (it must have no device child)."""
        s = node.full
        pages = s.device_pages
        s.device_pages = None
        s.evicting = False
        node.parent.device_children -= 1
        if s.lock_ref:
            self.protected_pages -= count(pages)
        else:
            self.evictable_pages -= count(pages)
        self._refresh(node)
        self._refresh(node.parent)
        return pages

    def _clear_host(self, node: Node) -> None:
        """Free a node's host copy (nothing may be copying it)."""
        s = node.full
        self.host.free(s.host_pages)
        s.host_pages = None
        self._refresh(node)

    def _remove_node(self, node: Node) -> None:
        """Unlink a childless node that is off the device; frees its host copy."""
        parent = node.parent
        if node.full.host_pages is not None:
            self.host.free(node.full.host_pages)
            node.full.host_pages = None
        self._forget(node)
        self.tree.remove(node)
        self._refresh(parent)

    # -- locks -----------------------------------------------------------------------

    def _lock_path(self, node: Node) -> None:
        while node.parent is not None:
            s = node.full
            if s.lock_ref == 0:
                if s.device_pages is not None:
                    n = count(s.device_pages)
                    self.evictable_pages -= n
                    self.protected_pages += n
                s.lock_ref = 1
                self._refresh(node)
            else:
                s.lock_ref += 1
            node = node.parent

    def _unlock_path(self, node: Node) -> None:
        while node.parent is not None:
            s = node.full
            s.lock_ref -= 1
            if s.lock_ref == 0:
                if s.device_pages is not None:
                    n = count(s.device_pages)
                    self.protected_pages -= n
                    self.evictable_pages += n
                self._refresh(node)
            node = node.parent

    # -- structure -------------------------------------------------------------------

    def _split(self, node: Node, pages: int) -> Node:
        """Split `node` after `pages` pages; returns the new upper node. Transfers that
        copy `node` now copy both halves."""
        top = self.tree.split(node, pages)
        tids = set(node.full.pins)
        tids.update(t for t in (node.full.backup, node.full.store) if t is not None)
        for tid in tids:
            t = self.transfers[tid]
            nodes = t.nodes if node in t.nodes else t.shared
            nodes.insert(nodes.index(node), top)
        self._refresh(top)
        return top

    def _reserve_transfer_id(self) -> int:
        return next(self._transfer_ids)

    def _new_transfer(self, kind: TransferKind, nodes: list[Node], tid: int = 0, **fields) -> Transfer:
        """Record a transfer of `nodes`' current device and host pages (`tid` if reserved)."""
        tid = tid or self._reserve_transfer_id()
        dev = b"".join(n.full.device_pages or b"" for n in nodes)
        host = b"".join(n.full.host_pages or b"" for n in nodes)
        t = Transfer(tid, kind, nodes, dev, host, **fields)
        self.transfers[tid] = t
        return t

    def _copying(self, nodes) -> set[int]:
        """Load-backs still copying into any of these nodes."""
        out = set()
        for node in nodes:
            for tid in node.full.pins:
                if not self.transfers[tid].copied:
                    out.add(tid)
        return out
