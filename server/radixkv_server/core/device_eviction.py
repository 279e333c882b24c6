"""Device -> host traffic: write-through backups, and device eviction with write-back."""

import enum

from .copier import Copier
from .errors import CacheError
from .host_space import HostSpace
from .node import Node
from .results import CopyOutcome, EvictResult
from .state import CacheState
from .storage_tier import StorageTier
from .transfers import TransferKind


class _Fate(enum.Enum):
    """What `evict` did with one device leaf."""
    LEAVES = "off the device now, or written back"
    WAITS = "stays until host room that stores in flight free"
    STAYS = "stays: no host room, and host-only children need it"


class DeviceEviction:
    """Receives the cache's state, host space (host copies allocate there), storage tier
    (storage write-through after a backup) and copier."""

    # Once the pages asked for are covered by nodes waiting for host room: how many more
    # leaves to look at for ones that leave at once (a host copy), starting no store.
    SCAN_PAST_WAITING = 64

    def __init__(self, state: CacheState, host_space: HostSpace, storage: StorageTier, copier: Copier):
        self.state = state
        self.host_space = host_space
        self.storage = storage
        self.copier = copier

    # -- backups ---------------------------------------------------------------------

    def start_backups(self, node: Node) -> None:
        """Back up to host every device node on `node`'s path that the write policy
        says is due and has no host copy yet. Nodes that find no host room stay
        device-only (counted); write-back eviction retries them later."""
        threshold = self.state.config.backup_threshold
        if threshold is None:
            return
        due = [
            n for n in reversed(node.path())
            if n.full.device_pages is not None and n.full.host_pages is None
            and n.hit_count >= threshold
        ]
        if not due:
            return
        tid = self.state.reserve_transfer_id()
        started = []
        for n in due:
            if not self._claim_host_copy(n, tid):
                self.state.counters.skipped_backup_tokens += self.state.tokens(n)
                continue
            started.append(n)
        if started:
            self._start_device_to_host(TransferKind.BACKUP, started, tid)

    def _claim_host_copy(self, node: Node, tid: int) -> bool:
        """Allocate host pages for `node` as the target of transfer `tid` (from then on
        its host copy counts as in flight). False when the host has no room."""
        host = self.host_space.alloc(self.state.pages(node))
        if host is None:
            return False
        self.state.claim_host(node, host, tid)
        return True

    def _start_device_to_host(self, kind: TransferKind, nodes: list[Node], tid: int) -> None:
        """Start copy `tid` of `nodes`' device pages into their claimed host pages."""
        t = self.state.new_transfer(kind, nodes, tid)
        for n in nodes:
            n.full.evicting = kind is TransferKind.WRITE_BACK
        self.copier.backup(t.id, t.device_pages, t.host_pages)

    # -- device eviction -------------------------------------------------------------

    def evict(self, num_pages: int, keep_for_room: bool = True) -> EvictResult:
        """Free up to `num_pages` device pages, least valuable unlocked leaves first.

        Mutates the tree. Nodes with a host copy leave the device at once; nodes without
        one are written back first (their pages come back through `finish` of the
        transfers in `pending`). When the host has no room for that, a node stays while
        stores that free host room are in flight and `keep_for_room` (the next Evict,
        with the room, writes it back), and is dropped from the cache otherwise. Once
        waiting nodes cover what is asked, up to SCAN_PAST_WAITING more leaves are looked
        at for ones with a host copy. Locked, pinned or backing-up nodes are never
        touched. When fewer pages than asked come free, the result names the backups and
        room-freeing stores in flight. Evicting 0 pages does nothing.
        """
        if num_pages < 0:
            raise CacheError(f"cannot evict {num_pages} pages")
        state = self.state
        freed: list[bytes] = []
        write_back: list[Node] = []
        tid = state.reserve_transfer_id()
        planned = self._take_leaves(num_pages, tid, freed, write_back, keep_for_room)
        pending = ()
        if write_back:
            self._start_device_to_host(TransferKind.WRITE_BACK, write_back, tid)
            pending = (tid,)
        backing_up = ()
        if planned < num_pages:
            backing_up = tuple(t.id for t in state.transfers.values() if t.kind is TransferKind.BACKUP)
            backing_up += self.host_space.stores_freeing_room()
        return EvictResult(b"".join(freed), pending, backing_up)

    def _take_leaves(self, num_pages: int, tid: int, freed: list[bytes], write_back: list[Node],
                     keep_for_room: bool) -> int:
        """`evict`'s walk over the device leaves, least valuable first; returns the pages
        leaving (now, or once written back). Leaves that stay go back to the set."""
        state = self.state
        skipped: list[Node] = []
        planned = waiting = past = 0  # pages leaving; pages waiting for host room; leaves looked past
        while planned < num_pages:
            covered = planned + waiting >= num_pages
            if covered and past == self.SCAN_PAST_WAITING:
                break
            node = state.device_leaves.pop()
            if node is None:
                break
            if covered:  # start no store: only a leaf that leaves at once helps now
                past += 1
                if not node.full.host_valid:
                    skipped.append(node)
                    continue
            fate = self._evict_one(node, tid, freed, write_back, keep_for_room)
            if fate is _Fate.LEAVES:
                planned += state.pages(node)
            else:
                skipped.append(node)
                if fate is _Fate.WAITS:
                    waiting += state.pages(node)
        for node in skipped:
            state.refresh(node)
        return planned

    def _evict_one(self, node: Node, tid: int, freed: list[bytes], write_back: list[Node],
                   keep_for_room: bool) -> _Fate:
        """Take one device leaf off the device now (appending to `freed`), or plan its
        write-back as part of `tid`; or leave it where it is (`_Fate`)."""
        state = self.state
        tokens = state.tokens(node)
        if node.full.host_valid:
            freed.append(state.release_device(node))
            state.counters.device_evicted_tokens += tokens
        elif self._claim_host_copy(node, tid):
            write_back.append(node)
        elif keep_for_room and self.host_space.stores_freeing_room():
            return _Fate.WAITS
        elif not node.children:
            freed.append(state.release_device(node))
            state.remove_node(node)
            state.counters.dropped_write_back_tokens += tokens
        else:
            return _Fate.STAYS
        return _Fate.LEAVES

    # -- completion ------------------------------------------------------------------

    def finish(self, tid: int, error: str | None) -> CopyOutcome:
        """A backup or write-back copy completed (`error` set when it failed). The host
        copies become valid (or are freed; the nodes stay device-only); write-backs then
        free their device pages, returned here, unless the node was needed meanwhile."""
        state = self.state
        counters = state.counters
        t = state.transfers.pop(tid)
        freed = []
        # Deepest first: a node split while the copy ran lists its upper half before its
        # lower one, which must leave the device first (a device node's parent is one).
        for node in reversed(t.nodes):
            tokens = state.tokens(node)
            evicting = node.full.evicting
            state.end_backup(node, ok=error is None)
            if error is not None:
                counters.failed_backup_tokens += tokens
            elif evicting:
                freed.append(state.release_device(node))
                counters.written_back_tokens += tokens
                counters.device_evicted_tokens += tokens
            else:
                counters.backed_up_tokens += tokens
        if error is None:
            self.storage.store_written_through(t.nodes)
        return CopyOutcome(b"".join(freed))


__all__ = ["DeviceEviction"]
