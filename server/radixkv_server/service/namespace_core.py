"""NamespaceCore: what both kinds of namespace share, whoever manages the device tier.

A managed namespace (`namespace.Namespace`: the daemon holds the engine's device pages)
and an engine-managed one (`engine_namespace.EngineNamespace`: the engines keep their own
blocks) each own one of these and add their own operations; it never calls them back.
It holds the core cache over the namespace's host pool and the copies the core starts,
and does on them what is alike for both: match (leases, storage probe), release,
prefetch, the one wait-and-retry loop after `NotReady`, the bounded wait for host room
(Evict, Prefetch), finishing and acknowledging a transfer, ending a session's holdings,
reporting residency as KV events, closing.

The event loop owns all of it. No tree change spans an `await`: an operation that must
wait for copies waits first (`until_copied`), then re-checks its session and tries the
core again.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from ..core import FinishResult, HierarchicalCache, NotReady
from ..core.errors import UnknownTransfer
from ..core.transfers import TransferKind
from ..datapath import HostPool
from ..events import resident
from ..logs import log_event
from .calls import MatchAnswer, PrefetchPolicy, PrefetchRequest, PrefetchState, PrefetchStep, Prompt
from .copies import Copies
from . import reasons
from .errors import not_found, precondition
from .namespace_config import NamespaceConfig
from .rank_copies import RankCopies
from .sessions import Session

T = TypeVar("T")
log = logging.getLogger("radixkv.namespace")

ROOM_WAIT_S = 2.0  # a wait for host room when --storage-lookup-timeout is 0 (no limit)
FAILING_ROOM_WAIT_S = 0.05  # its wait for stores while storage writes fail

FinishNow = Callable[[int, object], FinishResult]  # the core's finish of one transfer: (transfer, owner)


class NamespaceCore:
    """The cache core of `num_device_pages` device pages over `host_pool`, and its
    copies (`ranks`: the rank sessions' copies of an engine-managed namespace)."""

    def __init__(self, config: NamespaceConfig, host_pool: HostPool, *, num_device_pages: int,
                 metrics=None, storage=None, ranks: RankCopies | None = None):
        self.config = config
        self.host_pool = host_pool
        self.expirations = {"lease": 0, "load_back": 0, "save": 0, "session": 0}  # by the daemon's timeouts (expiry.py)
        self.copies = Copies(config, host_pool, metrics, storage, ranks=ranks)
        self.cache = HierarchicalCache(config.cache, self.copies, num_device_pages=num_device_pages,
                                       host_pages=host_pool.num_pages)
        self.copies.bind(self.cache)

    # -- the tree: match, leases, prefetch -------------------------------------------------

    async def match(self, session: Session, prompts: list[Prompt], lease: bool,
                    include_storage: bool = False) -> list[MatchAnswer]:
        """Match every prompt; with `lease`, lock each matched path (until released); with
        `include_storage`, also count the tokens past the cache that storage holds. The
        matches are atomic; the storage probe comes after them. The prompts must be packed
        int32 (`convert.prompts` checks), so no match fails after another took a lease."""
        if lease:
            session.check_lease_room(len(prompts))
        matched = []
        for p in prompts:
            result = self.cache.match(p.tokens, p.extra_key)
            held = lease and (result.device_tokens or result.host_tokens)
            matched.append((result, self.lease(session, result.host_node) if held else 0))
        stored = [0] * len(prompts)
        if include_storage and self.copies.storage is not None:
            probes = [self.cache.storage_probe(p.tokens, p.extra_key).keys for p in prompts]
            try:
                found = await self.copies.probe(probes)
            except BaseException:  # the caller gave up (deadline) or the probe failed:
                for node in session.pop_held([lease_id for _, lease_id in matched if lease_id]):
                    self.cache.unlock(node)  # nobody could release leases never answered
                raise
            stored = [n * self.config.layout.page_size for n in found]
            self.cache.counters.storage_hit_tokens += sum(stored)
        return [MatchAnswer(r, lease_id, n) for (r, lease_id), n in zip(matched, stored)]

    def lease(self, session: Session, node_id: int) -> int:
        """Lock `node_id`'s path for `session`; returns the lease id."""
        self.cache.lock(node_id)
        return session.add_lease(node_id)

    def release(self, session: Session, leases: list[int]) -> None:
        """Unlock the paths of the listed leases: all of them, or none (see Session.pop_leases)."""
        for node in session.pop_leases(leases):
            self.cache.unlock(node)

    async def prefetch(self, session: Session, request: PrefetchRequest) -> AsyncIterator[PrefetchStep]:
        """Fetch what storage holds of the prompt past the cache into host memory,
        reporting progress as the policy asks. FAILED_PRECONDITION without storage."""
        if self.copies.storage is None:
            raise precondition("no storage tier is configured (start the daemon with --storage)", reasons.NO_STORAGE)
        # A caller that waits for the whole fetch loses nothing if the read that finds the
        # run brings it along; the other policies answer STARTED as soon as it is found.
        losses = self.cache.storage_losses  # a loss while the lookup reads: its pages join as not stored
        ahead = await self.copies.find_run(self.cache.storage_probe(request.tokens, request.extra_key).keys,
                                           read=request.policy is PrefetchPolicy.WAIT_COMPLETE)
        transfer = 0
        try:
            session.check_open()
            if ahead.found:  # the fetch it starts takes `ahead` over
                transfer = await self._start_fetch(session, request, ahead, losses)
        finally:
            if not transfer:
                ahead.close()
        if not transfer:
            yield PrefetchStep(PrefetchState.NOTHING)
            return
        done = self.copies.fetched(transfer)  # before the first yield: the fetch may finish meanwhile
        tokens = len(self.cache.transfers[transfer].keys) * self.config.layout.page_size
        yield PrefetchStep(PrefetchState.STARTED, transfer, tokens)
        if request.policy is PrefetchPolicy.BEST_EFFORT:
            return
        timeout = request.timeout if request.policy is PrefetchPolicy.TIMEOUT else None
        try:
            outcome = await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            yield PrefetchStep(PrefetchState.WAITING_ENDED, transfer, tokens)
            return
        yield PrefetchStep.done(transfer, tokens, outcome, self.config.layout.page_size)

    async def _start_fetch(self, session: Session, request: PrefetchRequest, ahead, losses: int) -> int:
        """The fetch of `ahead`'s run (Cache.start_prefetch). Where the host pool has no
        room for all of it until stores in flight end, a caller waiting for the whole
        fetch waits for those stores (`wait_for_room`), the others go on at once; then
        what fits of the run is fetched. Returns the transfer id, 0 if none started."""
        def start(partial: bool) -> int:
            return self.cache.start_prefetch(request.tokens, request.extra_key, ahead.found, owner=session.id,
                                             ahead=ahead, losses_seen=losses, partial=partial)
        if request.policy is not PrefetchPolicy.WAIT_COMPLETE:
            return start(partial=True)
        try:
            return start(partial=False)
        except NotReady as e:
            await self.wait_for_room(e.transfers, "prefetch.store_wait_ended")
            session.check_open()
            return start(partial=True)

    # -- host room ---------------------------------------------------------------------

    def _room_wait_limit(self, transfers) -> float:
        """How long a call waits for `transfers` to free host room: as an engine call
        waits for storage (`storage_lookup_timeout`; ROOM_WAIT_S when that is 0), but
        FAILING_ROOM_WAIT_S for stores while the storage tier fails writes: they most
        likely fail too, and their room comes then, but a store client's retries against
        a store that is down took ~200 ms, which every Evict paid (engines 6x slower
        while Redis was down). A store refused at once (a full store) still frees its
        room within that."""
        limit = self.config.storage_lookup_timeout or ROOM_WAIT_S
        storage = self.copies.storage
        if storage is not None and "write" in storage.health.failing and any(
                self.cache.transfers[t].kind is TransferKind.STORE for t in transfers if t in self.cache.transfers):
            return min(limit, FAILING_ROOM_WAIT_S)
        return limit

    async def wait_for_room(self, transfers, event: str) -> bool:
        """Wait for copies (backups, stores) whose end frees host room or makes it
        evictable, no longer than `_room_wait_limit`; past it, log `event` (DEBUG).
        Whether they all ended."""
        limit = self._room_wait_limit(transfers)
        wait = asyncio.ensure_future(self.copies.wait(transfers))
        try:
            await asyncio.wait_for(asyncio.shield(wait), limit)
            return True
        except TimeoutError:
            log_event(log, event, logging.DEBUG, namespace=self.config.name, waited_s=limit)
            return False
        finally:
            wait.cancel()

    # -- waiting for copies, finishing transfers ------------------------------------------------

    async def until_copied(self, attempt: Callable[[], T], session: Session | None = None) -> T:
        """`attempt()` (one core call), tried again after each `NotReady` once the copies
        it names completed (rank sessions' copies included). With `session`:
        FAILED_PRECONDITION if it closed meanwhile. The one retry-after-NotReady loop."""
        while True:
            try:
                return attempt()
            except NotReady as e:
                await self.copies.wait(e.transfers)
                if session is not None:
                    session.check_open()

    async def finish(self, finish_now: FinishNow, transfer: int, owner=None,
                     missing_ok: bool = False) -> FinishResult | None:
        """`finish_now(transfer, owner)` once the transfer's copies completed. With
        `missing_ok` (closing a session, expiring a load), one that an ack finished
        meanwhile is no error (None)."""
        try:
            return await self.until_copied(lambda: finish_now(transfer, owner))
        except UnknownTransfer:
            if not missing_ok:
                raise
            return None

    async def ack(self, finish_now: FinishNow, session: Session, transfer: int) -> FinishResult:
        """The engine acknowledges one of its transfers: finished once copied. NOT_FOUND
        (saying so) for one that expired."""
        session.acked(transfer)
        try:
            return await self.finish(finish_now, transfer, session.id)
        except UnknownTransfer:
            why = session.expired_reason("transfer", transfer)
            if why is not None:
                raise not_found(f"transfer {transfer} {why}") from None
            raise

    async def end_holdings(self, finish_now: FinishNow, session: Session, pending: list[int]) -> None:
        """What a closing session held ends: its `pending` transfers are finished (after
        their copies), its leases released, its unacknowledged loads forgotten."""
        for tid in pending:
            await self.finish(finish_now, tid, None, missing_ok=True)
        for node in session.pop_all_leases():
            self.cache.unlock(node)
        session.forget_loads()

    # -- operators --------------------------------------------------------------------------

    def lease_violations(self, session: Session, who: str = "") -> list[str]:
        """A line for each lease of `session` naming a node that is not locked."""
        out = []
        for lease, node_id in session.leases.items():
            n = self.cache.tree.nodes.get(node_id)
            if n is None or (n.parent is not None and n.full.lock_ref <= 0):
                out.append(f"lease {lease}{who} names node {node_id}, which is not locked")
        return out

    def counters(self) -> dict[str, int]:
        """The core's counters, bytes copied each way and expirations, by name (Stats)."""
        out = self.cache.counters.as_dict()
        out["loaded_bytes"] = self.copies.loaded_bytes
        out["backed_up_bytes"] = self.copies.backed_up_bytes
        out["leases_expired"] = self.expirations["lease"]
        out["load_backs_expired"] = self.expirations["load_back"]
        out["saves_expired"] = self.expirations["save"]
        out["sessions_expired"] = self.expirations["session"]
        return out

    def report_to(self, events) -> None:
        """Report every residency change of the tree to `events` (an `EventHub`) as KV
        events, with the tree as the snapshot a resynchronisation announces."""
        self.cache.residency_listener = events.attach(
            self.config.name, self.config.layout.page_size, snapshot=lambda: resident(self.cache.tree))

    async def close(self) -> None:
        """Drain copies, stop the copy threads and storage I/O, close the host pool
        (unpinning it); routers told to forget what it held; the tree let go of. Idempotent."""
        await self.copies.drain()
        self.copies.close()
        self.host_pool.close()
        listener, self.cache.residency_listener = self.cache.residency_listener, None
        if listener is not None:
            listener.clear()
        self.cache.release()  # the tree freed now, not at some later full garbage collection


__all__ = ["FinishNow", "NamespaceCore"]
