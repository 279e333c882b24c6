"""Engine-managed device tier: saves and loads for engines that keep their own blocks (vLLM).

In an engine-managed namespace the tree records host (and storage) residency only; the
engine's blocks are touched only during a transfer the engine asked for, and forgotten
when it is done. Each tensor-parallel rank copies its own shard: a node's host page holds
every rank's shard (slice `rank` of the page, one host page of `tp_size` slices), and the
node's `shards_missing` bitmask says which ranks' bytes have not arrived. A node is
*complete* (matchable, loadable, storable) when no shard is missing.

- `save` (Insert): copy the rank's engine pages of the pages whose shard is neither on
  host nor being copied by that rank (dedupe), into new or existing host pages. The
  transfer's copy sets the rank's bits; the engine's pages are never retained. The
  engine acknowledges the transfer (`finish`) before it reuses those blocks.
- `load` (LoadBack): copy the complete host pages of a path, from `start_page`, into the
  engine pages given. Nothing is published in the tree; the source nodes stay pinned
  (host-locked) until the rank acknowledges its transfer. Each rank loads and
  acknowledges its own transfer.

Receives the cache's `CacheState` and `HostSpace`; copies go through an `EngineCopier`
and are reported back with `copied`.
"""

from dataclasses import dataclass
from typing import Protocol

from .errors import InvalidRequest, NotOwner, NotReady, UnknownTransfer
from .host_space import HostSpace
from .insertion import check_insert
from .invariants import check_invariants
from .node import Node
from .pages import count, require_packed
from .results import FinishResult, LoadBackResult
from .state import CacheState
from .transfers import Transfer, TransferKind

ENGINE_KINDS = (TransferKind.SAVE, TransferKind.ENGINE_LOAD)


class EngineCopier(Protocol):
    """Copies between one rank's engine pages and its slice of host pages. Reports with
    `EngineTier.copied(transfer, error)` on a later turn of the loop, never from inside."""

    def save(self, transfer: int, owner: object, device_pages: bytes, host_pages: bytes) -> None:
        """Start copying `owner`'s engine page i (all its buffers) to its shard of host page i."""

    def load_into(self, transfer: int, owner: object, host_pages: bytes, device_pages: bytes) -> None:
        """Start copying `owner`'s shard of host page i into its engine page i."""


@dataclass(frozen=True, slots=True)
class SaveResult:
    """A rank's save: `cached_tokens` of the prompt had a node before it; `node` ends the
    prompt (the root when no host room was found for any of it); `transfer` copies the
    pages whose shard was missing (0: nothing needed copying)."""

    cached_tokens: int
    node: int
    transfer: int


class EngineTier:
    """Saves and loads of an engine-managed namespace; `tp_size` ranks shard each page."""

    def __init__(self, state: CacheState, host_space: HostSpace, copier: EngineCopier, tp_size: int = 1):
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.state = state
        self.host_space = host_space
        self.copier = copier
        self.tp_size = tp_size
        self.all_shards = (1 << tp_size) - 1
        self.ranks: dict[int, int] = {}  # save transfer still copying -> its rank

    # -- match ---------------------------------------------------------------------------

    def complete_tokens(self, node_id: int) -> int:
        """Tokens of the path from the root to `node_id` whose every shard arrived (its
        longest complete prefix: what a load can copy)."""
        state = self.state
        tokens = 0
        node = state.tree.nodes.get(node_id)  # Match answers 0 when no root exists yet
        for node in reversed(node.path() if node is not None else []):
            if not _complete(node):
                break
            tokens += state.tokens(node)
        return tokens

    # -- save ----------------------------------------------------------------------------

    def save(self, tokens: bytes, device_pages: bytes, extra_key: bytes, owner: object,
             rank: int = 0) -> SaveResult:
        """Copy rank `rank`'s engine pages (`device_pages[i]` holds page i of `tokens`)
        to host where its shard is not there yet. Pages that find no host room are not
        saved (the cache is full of pinned or leased pages). Raises InvalidRequest
        before changing anything."""
        state = self.state
        self._check_rank(rank)
        self._check_save(tokens, device_pages)
        root = state.tree.root(extra_key)
        path, partial, k = state.tree.walk(root, tokens)
        if partial is not None:
            path.append(state.split(partial, k))
        now = state.tick()
        copies, off = self._existing(path, device_pages, rank, now)
        anchor = last = path[-1] if path else root
        state.lock_path(anchor)  # making host room below must not evict the path itself
        if off * 4 < len(device_pages):
            tail = self._new_node(anchor, tokens[off * state.tree.stride:], now)
            if tail is not None:
                copies.append((tail, device_pages[off * 4:]))
                last = tail
        tid = self._start_save(copies, owner, rank) if copies else 0
        state.unlock_path(anchor)
        return SaveResult(off * state.config.page_size, last.id, tid)

    def _check_save(self, tokens: bytes, device_pages: bytes) -> None:
        check_insert(tokens, device_pages, self.state.config.page_size)

    def _existing(self, path: list[Node], device_pages: bytes, rank: int, now: int) -> tuple[list, int]:
        """The (node, engine pages) of the path's nodes that lack rank's shard and are not
        being saved by that rank; counts a hit on each. Returns them and the pages covered."""
        state, bit = self.state, 1 << rank
        copies, off = [], 0
        for node in path:
            m = state.pages(node)
            node.hit_count += 1
            state.touch(node, now)
            s = node.full
            if s.host_pages is not None and s.shards_missing & bit and not self._saving(node, rank):
                copies.append((node, device_pages[off * 4:(off + m) * 4]))
            off += m
        return copies, off

    def _saving(self, node: Node, rank: int) -> bool:
        return any(self.ranks.get(tid) == rank for tid in node.full.pins)

    def _new_node(self, parent: Node, key: bytes, now: int) -> Node | None:
        """A new host node under `parent` for `key`, no shard arrived yet; None without room."""
        state = self.state
        pages = self.host_space.alloc(len(key) // state.tree.stride)
        if pages is None:
            return None
        node = state.tree.add_child(parent, key)
        node.hit_count = 1
        node.full.host_pages = pages
        node.full.shards_missing = self.all_shards
        state.touch(node, now)
        state.refresh(node)
        state.refresh(parent)
        return node

    def _start_save(self, copies: list, owner: object, rank: int) -> int:
        state = self.state
        tid = state.reserve_transfer_id()
        nodes = [n for n, _ in copies]
        for n in nodes:
            state.pin(n, tid)
        t = Transfer(tid, TransferKind.SAVE, nodes, b"".join(d for _, d in copies),
                     b"".join(n.full.host_pages for n in nodes), owner=owner)
        state.transfers[tid] = t
        self.ranks[tid] = rank
        state.counters.inserted_tokens += t.num_pages * state.config.page_size
        self.copier.save(tid, owner, t.device_pages, t.host_pages)
        return tid

    # -- load ----------------------------------------------------------------------------

    def load(self, node_id: int, device_pages: bytes, start_page: int, owner: object,
             rank: int = 0) -> LoadBackResult:
        """Copy the complete host pages of `node_id`'s path from page `start_page` on into
        rank `rank`'s engine pages `device_pages` (as many as both allow). The result's
        `device_pages` are the pages written, covering tokens up to `device_tokens`;
        `unused_pages` the rest. Raises UnknownNode / InvalidRequest (a start_page past the
        path among them) before changing anything."""
        state = self.state
        self._check_rank(rank)
        node = state.tree.get(node_id)
        require_packed(device_pages, "LoadBack: device page")
        if start_page < 0:
            raise InvalidRequest(f"LoadBack: start_page {start_page} is negative")
        sources, host = self._sources(node, start_page, count(device_pages))
        n = count(host)
        ps = state.config.page_size
        if n == 0:
            path_pages = sum(state.pages(p) for p in node.path())
            if start_page > path_pages:
                raise InvalidRequest(f"LoadBack: start_page {start_page} is past node {node_id}'s path "
                                     f"({path_pages} pages)")
            return LoadBackResult(0, b"", start_page * ps, 0, (), device_pages)
        tid = state.reserve_transfer_id()
        for s in sources:
            state.pin(s, tid)
        t = Transfer(tid, TransferKind.ENGINE_LOAD, sources, device_pages[:n * 4], host, owner=owner,
                     start_page=start_page)
        state.transfers[tid] = t
        state.counters.loaded_tokens += n * ps
        self.copier.load_into(tid, owner, host, t.device_pages)
        return LoadBackResult(tid, t.device_pages, (start_page + n) * ps, n * ps, (), device_pages[n * 4:])

    def _sources(self, node: Node, start_page: int, budget: int) -> tuple[list[Node], bytes]:
        """The complete nodes overlapping pages [start_page, start_page + budget) of the
        path to `node`, and the host pages of that range (stopping at the first incomplete node)."""
        state = self.state
        nodes, host, page = [], [], 0
        for n in reversed(node.path()):
            if not _complete(n) or budget <= 0:
                break
            m = state.pages(n)
            lo = max(start_page - page, 0)
            hi = min(m, lo + budget)  # `budget` is what is left to copy
            if lo < hi:
                nodes.append(n)
                host.append(n.full.host_pages[lo * 4:hi * 4])
                budget -= hi - lo
            page += m
        return nodes, b"".join(host)

    # -- the data path reports; the engine acknowledges ------------------------------------

    def copied(self, transfer: int, error: str | None = None) -> None:
        """A save's or load's copy finished. A save's rank shard arrives (its bits set when
        `error` is None) and its nodes are unpinned at once (nodes it completes are stored
        under storage write-through); a load keeps its pins until the ack. Raises UnknownTransfer for a copy reported twice or never started."""
        state = self.state
        t = state.transfers.get(transfer)
        if t is None or t.copied or t.kind not in ENGINE_KINDS:
            raise UnknownTransfer(f"copy of transfer {transfer} reported twice or never started")
        t.copied = True
        t.error = None if error is None else f"copy failed: {error}"
        if t.kind is TransferKind.ENGINE_LOAD:
            if error is not None:
                state.counters.failed_load_tokens += t.num_pages * state.config.page_size
            return
        bit = 1 << self.ranks.pop(transfer)
        completed = []
        for n in t.nodes:
            state.unpin(n, transfer)
            if error is None and n.full.shards_missing & bit:
                n.full.shards_missing &= ~bit
                if not n.full.shards_missing:
                    state._emit("host", "stored", n)
                    completed.append(n)
        state.counters.backed_up_tokens += sum(state.pages(n) for n in completed) * state.config.page_size
        t.nodes = []
        self.host_space.storage.store_written_through(completed)  # storage write-through: complete nodes only

    def finish(self, transfer: int, owner: object = None) -> FinishResult:
        """Acknowledge a save or load once copied: a load's sources are unpinned. Raises
        UnknownTransfer, NotOwner (another session's), NotReady (still copying). A failed
        load's `failed_pages` are its engine pages (the engine recomputes them)."""
        state = self.state
        t = state.transfers.get(transfer)
        if t is None or t.kind not in ENGINE_KINDS:
            raise UnknownTransfer(f"transfer {transfer} is not a save or load in flight "
                                  "(never started, or already acknowledged)")
        if owner is not None and t.owner is not None and t.owner != owner:
            raise NotOwner(f"transfer {transfer} belongs to another session")
        if not t.copied:
            raise NotReady(f"transfer {transfer} is still copying", (transfer,))
        del state.transfers[transfer]
        for n in t.nodes:
            state.unpin(n, transfer)
        failed = t.device_pages if t.error is not None and t.kind is TransferKind.ENGINE_LOAD else b""
        return FinishResult(transfer, t.error, failed)

    def pending(self, owner: object) -> list[int]:
        """Saves and loads of `owner` not yet acknowledged."""
        return [tid for tid, t in self.state.transfers.items() if t.kind in ENGINE_KINDS and t.owner == owner]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp_size:
            raise InvalidRequest(f"tensor-parallel rank {rank} out of range 0..{self.tp_size - 1}")

    # -- invariants ----------------------------------------------------------------------

    def check_invariants(self) -> list[str]:
        """The core's invariants, and: no device residency; every node holds host pages
        (or nothing remains of it); missing shards name real ranks; a rank's save in
        flight writes only nodes that lack its shard, at most one per (node, rank);
        exactly the saves still copying have a rank."""
        state = self.state
        errors = check_invariants(state)
        err = errors.append
        if state.device.num_taken:
            err(f"engine-managed: the device ledger took {state.device.num_taken} pages")
        for node in state.tree.iter_nodes():
            _check_engine_node(node, self.all_shards, err)
        copying = set()
        for tid, t in state.transfers.items():
            if t.kind is TransferKind.SAVE and not t.copied:
                copying.add(tid)
                self._check_save_in_flight(tid, t, err)
        if copying != set(self.ranks):
            err(f"engine-managed: saves copying {sorted(copying)}, ranks recorded for {sorted(self.ranks)}")
        return errors

    def _check_save_in_flight(self, tid: int, t: Transfer, err) -> None:
        rank = self.ranks.get(tid)
        if rank is None:
            return
        for n in t.nodes:
            if not n.full.shards_missing & (1 << rank):
                err(f"save {tid} (rank {rank}) writes node {n.id}, whose rank {rank} shard arrived already")
            others = [p for p in n.full.pins if p != tid and self.ranks.get(p) == rank]
            if others:
                err(f"node {n.id}: rank {rank} saves it twice (transfers {tid}, {others})")


def _complete(node: Node) -> bool:
    return node.full.host_pages is not None and not node.full.shards_missing


def _check_engine_node(node: Node, all_shards: int, err) -> None:
    s = node.full
    if s.device_pages is not None or node.device_children:
        err(f"engine-managed: node {node.id} has device residency")
    if s.host_pages is None:
        err(f"engine-managed: node {node.id} has no host pages")
    if s.shards_missing & ~all_shards:
        err(f"engine-managed: node {node.id} misses shards {s.shards_missing:#x} beyond ranks {all_shards:#x}")
    if s.shards_missing and (s.stored or s.store is not None):
        err(f"engine-managed: node {node.id} is stored (or storing) with shards {s.shards_missing:#x} missing")


__all__ = ["ENGINE_KINDS", "EngineCopier", "EngineTier", "SaveResult"]
