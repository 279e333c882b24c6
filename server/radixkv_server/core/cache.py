"""HierarchicalCache: one namespace's radix tree over device and host KV pages.

The public API of the core: a facade over one `CacheState` and the parts that receive
it (storage tier, host space, prefetches, device eviction, load-backs, insertions).
Synchronous, single-owner (the daemon's event loop), no I/O: bytes move through the
`Copier` given at construction. Every method either completes or raises a `CacheError`
subclass before changing anything.
"""

from dataclasses import dataclass

from . import device_drop
from .copier import Copier
from .device_ledger import DeviceLedger
from .engine_tier import EngineCopier, EngineTier
from .errors import InvalidRequest, LockError, NotReady, UnknownTransfer
from .device_eviction import DeviceEviction
from .host_space import HostSpace
from .insertion import Insertions, check_tokens
from .invariants import check_invariants, state_digest
from .loadback import LoadBacks
from .node import Node
from .cache_config import CacheConfig
from .prefetch import Prefetches
from .residency import ResidencyListener
from .results import CopyOutcome, EvictResult, FetchOutcome, FinishResult, InsertResult, LoadBackResult, MatchResult
from .state import CacheState
from .storage_tier import StorageTier
from .transfers import TransferKind


@dataclass(frozen=True, slots=True)
class StorageProbe:
    """What to ask the storage tier about a prompt: the cache holds its first
    `cached_pages` whole pages; `keys` are the storage keys of the whole pages after
    them, in prompt order."""

    cached_pages: int
    keys: list[bytes]


def _state_attribute(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.state, name), doc=doc)


class HierarchicalCache:
    """Construct with `HierarchicalCache(config, copier, num_device_pages=, host_pages=)`;
    `listener` (optional) hears every residency change (see residency.py)."""

    def __init__(self, config: CacheConfig, copier: Copier, *, num_device_pages: int, host_pages: int,
                 listener: ResidencyListener | None = None):
        self.config = config
        self.state = CacheState(config, num_device_pages=num_device_pages, host_pages=host_pages,
                                listener=listener)
        self.storage_tier = StorageTier(self.state, copier)
        self.host_space = HostSpace(self.state, self.storage_tier)
        self.prefetches = Prefetches(self.state, self.host_space, self.storage_tier, copier)
        self.evictions = DeviceEviction(self.state, self.host_space, self.storage_tier, copier)
        self.loads = LoadBacks(self.state, copier)
        self.insertions = Insertions(self.state, self.evictions)

    # -- the state, read through (callers outside the core use these names) --------------

    tree = _state_attribute("tree", "The radix tree (read only outside the core).")
    host = _state_attribute("host", "The host page allocator.")
    device = _state_attribute("device", "The device page ledger (replaced by `drop_device`).")
    transfers = _state_attribute("transfers", "Copies in flight, by transfer id.")
    counters = _state_attribute("counters", "Monotonic counts since creation.")
    duplicates = _state_attribute("duplicates", "Tracked settled duplicates.")
    device_leaves = _state_attribute("device_leaves", "Evictable device leaves.")
    host_leaves = _state_attribute("host_leaves", "Evictable host-only leaves.")
    evictable_pages = _state_attribute("evictable_pages", "Device pages in unlocked nodes.")
    protected_pages = _state_attribute("protected_pages", "Device pages in locked nodes.")
    pinned_nodes = _state_attribute("pinned_nodes", "Nodes whose host copy a copy in flight pins "
                                    "(load-backs; engine-managed saves and loads).")
    host_reserved = _state_attribute("host_reserved", "Host pages reserved by fetches in flight.")

    @property
    def residency_listener(self) -> ResidencyListener | None:
        """Hears every residency change (None: nobody listens); settable."""
        return self.state.listener

    @residency_listener.setter
    def residency_listener(self, listener: ResidencyListener | None) -> None:
        self.state.listener = listener

    @property
    def storage_on(self) -> bool:
        return self.storage_tier.on

    # -- match -----------------------------------------------------------------------

    def match(self, tokens: bytes, extra_key: bytes = b"") -> MatchResult:
        """Longest cached prefix of `tokens` (whole pages only; a partial tail is ignored).

        Mutates structure only: splits the last node where the prompt diverges inside it,
        marks the path accessed, and keeps on the device a node whose write-back eviction
        is in flight. Never frees or moves data.
        """
        check_tokens(tokens, "Match")
        state = self.state
        end = len(tokens) - len(tokens) % state.tree.stride
        state.counters.match_requests += 1
        state.counters.match_prompt_tokens += len(tokens) // 4
        root = state.tree.roots.get(extra_key)
        if root is None or end == 0:
            rid = root.id if root is not None else 0
            return MatchResult(b"", 0, 0, rid, rid, ())
        path, partial, k = state.tree.walk(root, tokens[:end] if end < len(tokens) else tokens)
        if partial is not None:
            path.append(state.split(partial, k))
        return self._match_result(root, path)

    def _match_result(self, root: Node, path: list[Node]) -> MatchResult:
        """Touch the matched `path` and describe it: its device prefix, then host-only."""
        state = self.state
        now = state.tick()
        device = []  # a prefix of the path
        device_tokens = host_tokens = 0
        for node in path:
            state.touch(node, now)
            if node.full.device_pages is not None:
                device.append(node)
                device_tokens += state.tokens(node)
            else:
                host_tokens += state.tokens(node)
        state.counters.device_hit_tokens += device_tokens
        state.counters.host_hit_tokens += host_tokens
        depends_on = state.copying(device)
        return MatchResult(
            b"".join(n.full.device_pages for n in device), device_tokens, host_tokens,
            device[-1].id if device else root.id, path[-1].id if path else root.id,
            tuple(sorted(depends_on)),
        )

    # -- insert, load back, acknowledge -------------------------------------------------

    def insert(self, tokens: bytes, device_pages: bytes, extra_key: bytes = b"",
               chunked: bool = False) -> InsertResult:
        """See `Insertions.insert`. `chunked` is accepted for symmetry with engines and
        changes nothing (chunked inserts count hits too)."""
        del chunked
        return self.insertions.insert(tokens, device_pages, extra_key)

    def load_back(self, node_id: int, device_pages: bytes, owner: object = None) -> LoadBackResult:
        """See `LoadBacks.load_back`."""
        return self.loads.load_back(node_id, device_pages, owner)

    def finish_load_back(self, transfer: int, owner: object = None) -> FinishResult:
        """See `LoadBacks.finish`."""
        return self.loads.finish(transfer, owner)

    def pending_loads(self, owner: object) -> list[int]:
        """Load-backs of `owner` not yet acknowledged."""
        return self.loads.pending(owner)

    # -- eviction --------------------------------------------------------------------

    def evict_device(self, num_pages: int, keep_for_room: bool = True) -> EvictResult:
        """See `DeviceEviction.evict`."""
        return self.evictions.evict(num_pages, keep_for_room)

    def evict_host(self, num_pages: int) -> int:
        """See `HostSpace.evict`."""
        return self.host_space.evict(num_pages)

    # -- the data path reports -----------------------------------------------------------

    def on_copy_done(self, transfer: int, error: str | None = None) -> CopyOutcome:
        """The data path reports a finished copy (`error` set when it failed).

        Backups settle at once: the host copy becomes valid, or is freed on error (the
        node stays device-only). Write-backs then free their device pages, returned here;
        a write-back whose node was touched meanwhile keeps it on the device instead.
        Load-backs are marked copied (failed ones leave the tree now, with every load
        that depends on them) and finish when the engine acknowledges them.
        Raises UnknownTransfer for a copy reported twice or never started, a fetch, or
        an engine-managed save or load.
        """
        t = self.state.transfers.get(transfer)
        if t is None or t.copied:
            raise UnknownTransfer(f"copy of transfer {transfer} reported twice or never started")
        if t.kind is TransferKind.LOAD:
            self.loads.copied(t, error)
            return CopyOutcome(b"")
        if t.kind is TransferKind.STORE:
            self.storage_tier.finish_store(transfer, error)
            return CopyOutcome(b"")
        if t.kind is TransferKind.FETCH:
            raise UnknownTransfer(f"transfer {transfer} is a fetch: report it with on_fetch_done")
        if t.kind not in (TransferKind.BACKUP, TransferKind.WRITE_BACK):
            raise UnknownTransfer(f"transfer {transfer} is an engine-managed {t.kind.value}: "
                                  "report it to the EngineTier")
        return self.evictions.finish(transfer, error)

    # -- storage -----------------------------------------------------------------------

    def storage_probe(self, tokens: bytes, extra_key: bytes = b"") -> StorageProbe:
        """See `StorageTier.probe`. Changes nothing."""
        cached, keys = self.storage_tier.probe(tokens, extra_key)
        return StorageProbe(cached, keys)

    def storage_keys(self, node: Node) -> list[bytes]:
        """Storage keys of the node's pages."""
        return self.storage_tier.keys(node)

    def unstored_host_nodes(self) -> list[Node]:
        """See `StorageTier.unstored`. Changes nothing."""
        return self.storage_tier.unstored()

    def store_host_copies(self, nodes: list[Node]) -> int:
        """Start storing the host copies of `nodes` (from `unstored_host_nodes`) that still
        need it, in one store; its transfer id (0: none did). Completes through
        `on_copy_done`, as every store does."""
        return self.storage_tier.store_now(nodes)

    def start_prefetch(self, tokens: bytes, extra_key: bytes, max_pages: int, owner: object = None,
                       ahead: object = None, losses_seen: int | None = None, partial: bool = False) -> int:
        """See `Prefetches.start`."""
        return self.prefetches.start(tokens, extra_key, max_pages, owner, ahead, losses_seen, partial)

    @property
    def storage_losses(self) -> int:
        """How many times `storage_lost` was called (pass it, read before reading storage
        ahead of a prefetch, to `start_prefetch`)."""
        return self.prefetches.losses

    def storage_lost(self) -> int:
        """The store may have lost pages it acknowledged (a restarted server): no node
        counts as stored any more, so each is stored again before it leaves the host
        (a stored leaf left at once, and a store lost its only copy). Stores in flight
        still record theirs; fetches in flight attach theirs as not stored. Returns how
        many nodes were forgotten."""
        self.prefetches.storage_lost()
        return self.state.forget_stored()

    def on_fetch_done(self, transfer: int, pages_read: int, error: str | None = None) -> FetchOutcome:
        """See `Prefetches.done`."""
        return self.prefetches.done(transfer, pages_read, error)

    # -- leases ----------------------------------------------------------------------

    def lock(self, node_id: int) -> None:
        """Protect the node's path from eviction (device and host) until `unlock`."""
        self.state.lock_path(self.state.tree.get(node_id))

    def unlock(self, node_id: int) -> None:
        """Release one `lock` of the node. Raises LockError if it holds none."""
        node = self.state.tree.get(node_id)
        if node.parent is not None and node.full.lock_ref <= 0:
            raise LockError(f"node {node_id} is not locked")
        self.state.unlock_path(node)

    # -- engine-managed device tier ----------------------------------------------------

    def engine_tier(self, copier: EngineCopier, tp_size: int = 1) -> EngineTier:
        """The saves and loads of an engine-managed namespace, on this cache's state and
        host space (build the cache with no device pages). Call once."""
        return EngineTier(self.state, self.host_space, copier, tp_size)

    # -- engine restart --------------------------------------------------------------

    def device_drop_waits_for(self) -> list[int]:
        """The transfers `drop_device` needs finished first: every one but a store of
        pages it keeps and a storage fetch (the others touch the engine's device pages,
        or fill or read host pages of nodes it may remove). A store only reads host
        pages; a fetch fills host pages reserved apart from the tree, inserted when it
        ends only where their prefix still is. Both take as long as the store does: an
        engine's Close need not wait for them."""
        return device_drop.waits_for(self.state)

    def drop_device(self, num_device_pages: int) -> int:
        """Forget every device page (the engine that owned them is gone) and start a new
        device ledger of `num_device_pages`. Host copies stay; device-only nodes leave
        with the host-only nodes below them. Returns the tokens dropped from the tree.
        Raises NotReady while copies it needs finished are in flight
        (`device_drop_waits_for`; finish them first), InvalidRequest for a negative
        count; either before changing anything."""
        if num_device_pages < 0:
            raise InvalidRequest(f"num_device_pages must be >= 0, got {num_device_pages}")
        if waits := self.device_drop_waits_for():
            raise NotReady("copies are still in flight", tuple(sorted(waits)))
        dropped = device_drop.drop(self.state)
        self.state.device = DeviceLedger(num_device_pages)
        return dropped

    def release(self) -> None:
        """The namespace is closed for good: see `CacheState.release`."""
        self.state.release()

    # -- inspection ------------------------------------------------------------------

    def node(self, node_id: int) -> Node:
        """The node `node_id`; raises UnknownNode."""
        return self.state.tree.get(node_id)

    def check_invariants(self) -> list[str]:
        """Every violated invariant, as one line each; empty when the state is sound."""
        return check_invariants(self.state)

    def state_digest(self) -> str:
        """A hash of everything a caller could observe (see invariants.state_digest)."""
        return state_digest(self.state)


__all__ = ["HierarchicalCache", "StorageProbe"]
