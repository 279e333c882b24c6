"""Device->host traffic: write-through backups, device eviction (with write-back) and
host eviction (duplicate reclaim first, then host-only leaves)."""

from .errors import CacheError, UnknownTransfer
from .node import Node
from .results import CopyOutcome, EvictResult
from .storage_tier import StorageTier
from .transfers import TransferKind


class Evictions(StorageTier):
    # Host eviction with storage on: how many not-yet-stored leaves it may pass over
    # while looking for stored ones, before settling for the writes it started.
    STORE_SEARCH_LIMIT = 64

    # -- backups ---------------------------------------------------------------------

    def _start_backups(self, node: Node) -> None:
        """Back up to host every device node on `node`'s path that the write policy
        says is due and has no host copy yet. Nodes that find no host room stay
        device-only (counted); write-back eviction retries them later."""
        threshold = self.config.backup_threshold
        if threshold is None:
            return
        due = [
            n for n in reversed(node.path())
            if n.full.device_pages is not None and n.full.host_pages is None
            and n.hit_count >= threshold
        ]
        if not due:
            return
        tid = self._reserve_transfer_id()
        started = []
        for n in due:
            if not self._claim_host_copy(n, tid):
                self.counters.skipped_backup_tokens += self._tokens(n)
                continue
            started.append(n)
        if started:
            self._start_device_to_host(TransferKind.BACKUP, started, tid)

    def _claim_host_copy(self, node: Node, tid: int) -> bool:
        """Allocate host pages for `node` as the target of transfer `tid` (from then on
        its host copy counts as in flight). False when the host has no room."""
        host = self._alloc_host(self._pages(node))
        if host is None:
            return False
        s = node.full
        s.host_pages = host
        s.backup = tid
        s.host_lock += 1
        self._refresh(node)
        return True

    def _start_device_to_host(self, kind: TransferKind, nodes: list[Node], tid: int) -> None:
        """Start copy `tid` of `nodes`' device pages into their claimed host pages."""
        t = self._new_transfer(kind, nodes, tid)
        for n in nodes:
            n.full.evicting = kind is TransferKind.WRITE_BACK
        self._copier.backup(t.id, t.device_pages, t.host_pages)

    def _alloc_host(self, n: int) -> bytes | None:
        pages = self.host.alloc(n)
        if pages is None:
            self.evict_host(n - self.host.num_free)
            pages = self.host.alloc(n)
        return pages

    # -- device eviction -------------------------------------------------------------

    def evict_device(self, num_pages: int) -> EvictResult:
        """Free up to `num_pages` device pages, least valuable unlocked leaves first.

        Mutates the tree. Nodes with a host copy leave the device at once; nodes without
        one are written back first (their pages come back through `on_copy_done` of the
        transfers in `pending`), or dropped from the cache when the host has no room and
        nothing there can be evicted. Locked, pinned or backing-up nodes are never
        touched. Evicting 0 pages does nothing.
        """
        if num_pages < 0:
            raise CacheError(f"cannot evict {num_pages} pages")
        freed: list[bytes] = []
        write_back: list[Node] = []
        tid = self._reserve_transfer_id()
        skipped: list[Node] = []
        planned = 0
        while planned < num_pages:
            node = self.device_leaves.pop()
            if node is None:
                break
            s = node.full
            n = self._pages(node)
            if s.host_valid:
                freed.append(self._release_device(node))
                self.counters.device_evicted_tokens += self._tokens(node)
            elif self._claim_host_copy(node, tid):
                write_back.append(node)
            elif not node.children:
                freed.append(self._release_device(node))
                self._remove_node(node)
                self.counters.dropped_write_back_tokens += self._tokens(node)
            else:
                skipped.append(node)  # its host-only children need it; no room to keep it
                continue
            planned += n
        for node in skipped:
            self._refresh(node)
        pending = ()
        if write_back:
            self._start_device_to_host(TransferKind.WRITE_BACK, write_back, tid)
            pending = (tid,)
        return EvictResult(b"".join(freed), pending)

    def _release_device(self, node: Node) -> bytes:
        pages = self._clear_device(node)
        self.device.give_back(pages)
        return pages

    # -- host eviction ---------------------------------------------------------------

    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages if possible; returns how many were freed.

        First reclaims host copies of settled duplicates (the device copy stays), in every
        write policy; then removes host-only leaves from the cache. Where the storage
        tier is on, a leaf it lacks is written there first and leaves when the write
        completes: up to `num_pages` of such writes start, while the search goes on for
        leaves storage already holds, which free their pages at once. Copies in flight,
        pins and locks protect a node. Mutates the tree.
        """
        freed = 0
        busy = []
        while freed < num_pages:
            node = self.duplicates.pop()
            if node is None:
                break
            if node.full.host_lock:
                busy.append(node)
                continue
            freed += self._pages(node)
            self._clear_host(node)
            self.counters.reclaimed_duplicate_tokens += self._tokens(node)
        for node in busy:
            self._refresh(node)
        to_store, passed = [], []
        storing = 0
        while freed < num_pages and len(passed) < self.STORE_SEARCH_LIMIT:
            node = self.host_leaves.pop()
            if node is None:
                break
            if self.storage_on and not node.full.stored:
                if storing < num_pages - freed:
                    to_store.append(node)
                    storing += self._pages(node)
                else:
                    passed.append(node)  # enough writes started: look for stored leaves
                continue
            freed += self._pages(node)
            self.counters.host_evicted_tokens += self._tokens(node)
            self._remove_node(node)
        for node in passed:
            self._refresh(node)
        self._start_store(to_store, evicting_host=True)
        return freed

    # -- completion ------------------------------------------------------------------

    def _finish_device_to_host(self, tid: int, error: str | None) -> CopyOutcome:
        t = self.transfers.pop(tid)
        freed = []
        for node in t.nodes:
            s = node.full
            s.backup = None
            s.host_lock -= 1
            tokens = self._tokens(node)
            if error is not None:
                self.host.free(s.host_pages)
                s.host_pages = None
                s.evicting = False
                self.counters.failed_backup_tokens += tokens
            elif s.evicting:
                freed.append(self._release_device(node))
                self.counters.written_back_tokens += tokens
                self.counters.device_evicted_tokens += tokens
            else:
                self.counters.backed_up_tokens += tokens
            self._refresh(node)
        if error is None:
            self._store_written_through(t.nodes)
        return CopyOutcome(b"".join(freed))

    def on_copy_done(self, transfer: int, error: str | None = None) -> CopyOutcome:
        """The data path reports a finished copy (`error` set when it failed).

        Backups settle at once: the host copy becomes valid, or is freed on error (the
        node stays device-only). Write-backs then free their device pages, returned here;
        a write-back whose node was touched meanwhile keeps it on the device instead.
        Load-backs are marked copied (failed ones leave the tree now, with every load
        that depends on them) and finish when the engine acknowledges them.
        """
        t = self.transfers.get(transfer)
        if t is None or t.copied:
            raise UnknownTransfer(f"copy of transfer {transfer} reported twice or never started")
        if t.kind is TransferKind.LOAD:
            t.copied = True
            if error is not None:
                self._fail_load(t, f"copy failed: {error}")
            return CopyOutcome(b"")
        if t.kind is TransferKind.STORE:
            self._finish_store(transfer, error)
            return CopyOutcome(b"")
        if t.kind is TransferKind.FETCH:
            raise UnknownTransfer(f"transfer {transfer} is a fetch: report it with on_fetch_done")
        return self._finish_device_to_host(transfer, error)


__all__ = ["Evictions"]
