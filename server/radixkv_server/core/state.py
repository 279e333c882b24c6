"""The cache's state and the primitive transitions every operation is built from.

Every change to a node's residency, locks or pins goes through the methods here, which
keep the derived bookkeeping exact: the evictable sets, the tracked duplicates, the
evictable/protected page counts, the device page ledger and the host allocator. The
operations (eviction, load-back, storage, insertion) receive one `CacheState` and never
touch those structures directly; nothing here calls them back.

Residency changes are reported to the optional `listener` (see residency.py).
"""

from .device_ledger import DeviceLedger
from .evictable import EvictableSet, strategy
from .host_allocator import HostAllocator
from .ids import fresh_ids
from .node import NO_PINS, Node
from .pages import count
from .cache_config import CacheConfig
from .residency import Change, ResidencyListener, Tier
from .results import CacheCounters
from .transfers import Transfer, TransferKind
from .tree import RadixTree


class CacheState:
    """One namespace's tree, pools, sets, transfers and counters. Not thread-safe: the
    event loop owns it. Primitives assume the caller checked their preconditions (they
    are the core's own steps, never reached with unchecked caller input)."""

    def __init__(self, config: CacheConfig, *, num_device_pages: int, host_pages: int,
                 listener: ResidencyListener | None = None):
        self.config = config
        self.tree = RadixTree(config.page_size)
        self.host = HostAllocator(host_pages)
        self.device = DeviceLedger(num_device_pages)
        order = strategy(config.eviction_policy)
        self.device_leaves = EvictableSet(order)  # device nodes, no device child, unlocked, settled
        self.duplicates = EvictableSet(order)     # settled duplicates (the tracked set)
        self.host_leaves = EvictableSet(order)    # host-only childless nodes, unlocked, unpinned
        # Sets that reorder on access (recency strategies); the others re-key lazily on pop.
        self._reordered = (self.device_leaves, self.duplicates, self.host_leaves) if order.recency else ()
        self.transfers: dict[int, Transfer] = {}
        # Stores in flight whose host copies leave the host when they end (room coming),
        # in start order: kept by StorageTier, so asking costs nothing per Evict leaf.
        self.room_stores: dict[int, None] = {}
        self.counters = CacheCounters()
        self.evictable_pages = 0  # device pages in unlocked nodes
        self.protected_pages = 0  # device pages in locked nodes
        self.pinned_nodes = 0     # nodes with a pin (Stats: no walk of the tree)
        self.host_reserved = 0    # host pages reserved by fetches in flight
        self.listener = listener
        self._clock = 0
        self._transfer_ids = fresh_ids()

    def release(self) -> None:
        """The namespace is closed for good (its copies over): forget every node, so its
        tree is freed now rather than at a later full garbage collection (`RadixTree.unlink_all`).
        The counts are not kept up after: nothing may use the state again."""
        self.tree.unlink_all()
        for nodes in (self.device_leaves, self.duplicates, self.host_leaves):
            nodes.clear()

    # -- small helpers -----------------------------------------------------------------

    def tick(self) -> int:
        """The next access time (strictly increasing)."""
        self._clock += 1
        return self._clock

    def pages(self, node: Node) -> int:
        return len(node.key) // self.tree.stride

    @staticmethod
    def tokens(node: Node) -> int:
        return len(node.key) // 4

    def touch(self, node: Node, now: int) -> None:
        """The node is needed again: mark it accessed at `now`, and keep it on the device
        if a write-back eviction is taking it (the copy still completes)."""
        node.last_access = now
        node.full.evicting = False
        for members in self._reordered:
            members.touched(node)

    def _emit(self, tier: Tier, change: Change, node: Node) -> None:
        if self.listener is not None:
            self.listener.residency_changed(tier, change, node)

    # -- derived sets ------------------------------------------------------------------

    def refresh(self, node: Node) -> None:
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
        # Settled duplicate: device and valid host copy, nothing pending on either (no
        # copy reading the host copy: a load's pin, a store's host lock). Kept out while
        # one is, host allocation under pressure never meets it (it popped and pushed
        # back every busy duplicate on each call: 4.7 ms per Insert at 4000 of them).
        self.duplicates.set(node, on_device and s.host_valid and not s.pins and s.host_lock == 0)
        self.host_leaves.set(
            node,
            not on_device and s.host_pages is not None and not node.children
            and s.lock_ref == 0 and s.host_lock == 0 and not s.pins,
        )

    def _forget(self, node: Node) -> None:
        self.device_leaves.discard(node)
        self.duplicates.discard(node)
        self.host_leaves.discard(node)

    # -- device residency --------------------------------------------------------------

    def set_device(self, node: Node, pages: bytes) -> None:
        """Publish device pages (checked by the caller) on a node that had none; the
        ledger takes them."""
        self.device.take(pages)
        s = node.full
        s.device_pages = pages
        node.parent.device_children += 1
        if s.lock_ref:
            self.protected_pages += count(pages)
        else:
            self.evictable_pages += count(pages)
        self.refresh(node)
        self.refresh(node.parent)
        self._emit("device", "stored", node)

    def clear_device(self, node: Node) -> bytes:
        """Take the device pages off a node (it must have no device child) and return
        them; they stay in the ledger (the caller gives them back or parks them)."""
        self._emit("device", "removed", node)
        s = node.full
        pages = s.device_pages
        s.device_pages = None
        s.evicting = False
        node.parent.device_children -= 1
        if s.lock_ref:
            self.protected_pages -= count(pages)
        else:
            self.evictable_pages -= count(pages)
        self.refresh(node)
        self.refresh(node.parent)
        return pages

    def release_device(self, node: Node) -> bytes:
        """`clear_device`, and the pages go back to the engine (off the ledger)."""
        pages = self.clear_device(node)
        self.device.give_back(pages)
        return pages

    # -- host residency ----------------------------------------------------------------

    def claim_host(self, node: Node, pages: bytes, tid: int) -> None:
        """Make freshly allocated host `pages` the node's host copy, filled by backup
        `tid` (not valid, and host-locked, until `end_backup`)."""
        s = node.full
        s.host_pages = pages
        s.backup = tid
        s.host_lock += 1
        self.refresh(node)

    def end_backup(self, node: Node, ok: bool) -> None:
        """The backup filling the node's host copy finished: the copy is valid now, or
        (failed) freed, and the node stays device-only and no longer evicting."""
        s = node.full
        s.backup = None
        s.host_lock -= 1
        if ok:
            self._emit("host", "stored", node)
        else:
            self.host.free(s.host_pages)
            s.host_pages = None
            s.evicting = False
        self.refresh(node)

    def attach_host(self, node: Node, pages: bytes, stored: bool = True) -> None:
        """Pages fetched from storage become the node's (valid) host copy; `stored`: the
        store still holds them (False when it lost its contents during the fetch)."""
        s = node.full
        s.host_pages = pages
        s.stored = stored
        self.refresh(node)
        self._emit("host", "stored", node)

    def complete_host(self, node: Node, pages: bytes, stored: bool = True) -> None:
        """Pages fetched from storage replace the host copy of an engine-managed node that
        lacks some rank's shard (nothing copying into it): the node is complete, and
        stored unless `stored` is False (the store lost its contents meanwhile)."""
        s = node.full
        self.host.free(s.host_pages)
        s.host_pages = None
        s.shards_missing = 0
        self.attach_host(node, pages, stored)

    def clear_host(self, node: Node) -> None:
        """Free a node's valid host copy (nothing may be copying it). Removal is told only
        of a copy that was told stored (an engine-managed one missing a shard never was)."""
        s = node.full
        if not s.shards_missing:
            self._emit("host", "removed", node)
        self.host.free(s.host_pages)
        s.host_pages = None
        self.refresh(node)

    def remove_node(self, node: Node) -> None:
        """Unlink a childless node that is off the device; frees its host copy."""
        parent = node.parent
        s = node.full
        if s.host_pages is not None:
            if s.backup is None and not s.shards_missing:
                self._emit("host", "removed", node)
            self.host.free(s.host_pages)
            s.host_pages = None
        self._forget(node)
        self.tree.remove(node)
        self.refresh(parent)

    # -- storage -----------------------------------------------------------------------

    def forget_stored(self) -> int:
        """Every node stops counting as stored (told as removed from storage); returns
        how many did."""
        forgotten = 0
        for node in self.tree.iter_nodes():
            if node.full.stored:
                node.full.stored = False
                forgotten += 1
                self._emit("storage", "removed", node)
                self.refresh(node)
        return forgotten

    def begin_store(self, node: Node, tid: int, evicting_host: bool) -> None:
        """Store `tid` reads the node's host copy (host-locked until `end_store`); with
        `evicting_host` the host copy leaves once the store completes."""
        s = node.full
        s.store = tid
        s.host_lock += 1
        s.evicting_host = evicting_host
        self.refresh(node)

    def end_store(self, node: Node, ok: bool) -> bool:
        """The store reading the node finished (`ok`: storage holds its pages now).
        Returns whether the node's host copy was waiting for it to leave."""
        s = node.full
        s.store = None
        s.host_lock -= 1
        if ok:
            s.stored = True
            self._emit("storage", "stored", node)
        leaving = s.evicting_host
        s.evicting_host = False
        self.refresh(node)
        return leaving

    # -- pins and locks ----------------------------------------------------------------

    def pin(self, node: Node, tid: int) -> None:
        """Load-back `tid` reads the node's host copy: pinned and host-locked."""
        s = node.full
        if s.pins:
            s.pins.add(tid)
        else:
            s.pins = {tid}
            self.pinned_nodes += 1
        s.host_lock += 1
        self.refresh(node)

    def unpin(self, node: Node, tid: int) -> None:
        """Drop `tid`'s pin (and its host lock) if it holds one; refresh either way."""
        s = node.full
        if tid in s.pins:
            s.pins.discard(tid)
            s.host_lock -= 1
            if not s.pins:
                s.pins = NO_PINS
                self.pinned_nodes -= 1
        self.refresh(node)

    def lock_path(self, node: Node) -> None:
        """Lock the node and every ancestor: no eviction from any tier until unlocked."""
        while node.parent is not None:
            s = node.full
            s.lock_ref += 1
            if s.lock_ref == 1:
                self._move_locked_pages(s.device_pages, locked=True)
                self.refresh(node)
            node = node.parent

    def unlock_path(self, node: Node) -> None:
        """Undo one `lock_path` of the node (the caller checked it holds one)."""
        while node.parent is not None:
            s = node.full
            s.lock_ref -= 1
            if s.lock_ref == 0:
                self._move_locked_pages(s.device_pages, locked=False)
                self.refresh(node)
            node = node.parent

    def _move_locked_pages(self, pages: bytes | None, locked: bool) -> None:
        if pages is None:
            return
        n = count(pages) if locked else -count(pages)
        self.evictable_pages -= n
        self.protected_pages += n

    # -- structure and transfers ------------------------------------------------------

    def split(self, node: Node, pages: int) -> Node:
        """Split `node` after `pages` pages; returns the new upper node. Transfers that
        copy `node` now copy both halves."""
        top = self.tree.split(node, pages)
        self.pinned_nodes += bool(top.full.pins)  # the upper part keeps the pins of the whole
        tids = set(node.full.pins)
        tids.update(t for t in (node.full.backup, node.full.store) if t is not None)
        for tid in tids:
            t = self.transfers[tid]
            nodes = t.nodes if node in t.nodes else t.shared
            nodes.insert(nodes.index(node), top)
        self.refresh(top)
        return top

    def reserve_transfer_id(self) -> int:
        return next(self._transfer_ids)

    def new_transfer(self, kind: TransferKind, nodes: list[Node], tid: int = 0, **fields) -> Transfer:
        """Record a transfer of `nodes`' current device and host pages (`tid` if reserved)."""
        tid = tid or self.reserve_transfer_id()
        dev = b"".join(n.full.device_pages or b"" for n in nodes)
        host = b"".join(n.full.host_pages or b"" for n in nodes)
        t = Transfer(tid, kind, nodes, dev, host, **fields)
        self.transfers[tid] = t
        return t

    def copying(self, nodes) -> set[int]:
        """Load-backs still copying into any of these nodes; not those that only rely on
        a node another load fills (`Transfer.shared`): a reader of the node waits for the
        one that writes it."""
        out = set()
        for node in nodes:
            for tid in node.full.pins:
                t = self.transfers[tid]
                if not t.copied and node not in t.shared:
                    out.add(tid)
        return out


__all__ = ["CacheState"]
