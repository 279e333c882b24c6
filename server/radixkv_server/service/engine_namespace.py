"""EngineNamespace: a namespace whose device tier the engines manage (vLLM).

The tree holds host and storage residency only (the core's `EngineTier`). Any number
of sessions share it: each engine instance's SCHEDULER session (Match with leases,
Release, Prefetch) and its `tp_size` ENGINE rank sessions (Insert = save, LoadBack =
load into the blocks the engine allocated, both acknowledged on the session's Acks
stream), each rank copying through its own copy engine (`RankCopies`). A session's end
finishes only its own transfers and releases only its own leases. Evict is refused: the
daemon holds no engine page to give back.

It owns a `NamespaceCore` as a managed namespace does (same tree operations: match,
leases, release, prefetch, waiting, finishing) and adds the engine-managed operations.
The event loop owns all of it.
"""

import asyncio
import dataclasses
import functools
from collections import Counter
from collections.abc import AsyncIterator

from ..core import FinishResult, InsertResult
from ..core.pages import require_packed, unpack
from ..datapath import DeviceBuffers, HostPool
from .calls import EvictAnswer, InsertAnswer, InsertRequest, LoadBackAnswer, MatchAnswer, PrefetchRequest, \
    PrefetchStep, Prompt
from . import reasons
from .errors import invalid, not_found, precondition, unavailable
from .namespace_config import NamespaceConfig
from .namespace_core import NamespaceCore
from .rank_copies import RankCopies
from .sessions import Session

SCHEDULER, ENGINE = "scheduler", "engine"


class EngineNamespace:
    """`config`, `host_pool`, `cache` (the core) and `copies` are its core's, read by
    operators (Stats, metrics); `tier` is the core's EngineTier, `ranks` the rank copies."""

    engine_managed = True
    group = None  # ranks gather into one group only in a managed-device namespace (`RankGroup`)

    def __init__(self, config: NamespaceConfig, host_pool: HostPool, tp_size: int, *, metrics=None, storage=None):
        self.tp_size = tp_size
        self.sessions: dict[str, Session] = {}  # every session sharing it, by id
        self.session: Session | None = None  # the managed namespace's one session: never set here
        self.page_geometry: tuple[int, int] | None = None  # registration.page_geometry, of the first rank
        self.owner = b""  # the tenant whose Register created it (its quota counts it: admission.py)
        self.ranks = RankCopies(config, host_pool, tp_size, self._copied, metrics)
        self.core = NamespaceCore(config, host_pool, num_device_pages=0, metrics=metrics, storage=storage,
                                  ranks=self.ranks)
        self.name, self.layout, self.config, self.host_pool = config.name, config.layout, config, host_pool
        self.cache, self.copies, self.expirations = self.core.cache, self.core.copies, self.core.expirations
        self.tier = self.cache.engine_tier(self.ranks, tp_size)

    @property
    def attached(self) -> bool:
        """Whether any session (a scheduler or a rank) shares it (Stats' `attached`)."""
        return bool(self.sessions)

    @classmethod
    async def open(cls, config: NamespaceConfig, *, metrics=None, storage=None) -> "EngineNamespace":
        """A new engine-managed namespace; its host pool (pages of `config.tp_size` shards)
        is allocated off the loop."""
        pool = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(HostPool, config.host_layout, config.host_pages,
                                    device=config.pin_device, prefault=config.prefault_host))
        return cls(config, pool, config.tp_size, metrics=metrics, storage=storage)

    def add_session(self, session: Session, device: DeviceBuffers | None) -> None:
        """Attach a session; an ENGINE session's buffers copy its rank's shards."""
        self.sessions[session.id] = session
        if device is not None:
            self.ranks.attach(session.id, device, session.rank)

    def _copied(self, transfer: int, error: str | None) -> None:
        self.tier.copied(transfer, error)

    # -- engine operations ------------------------------------------------------------------

    async def match(self, session: Session, prompts: list[Prompt], lease: bool,
                    include_storage: bool = False) -> list[MatchAnswer]:
        """The managed match (`NamespaceCore.match`), plus each prompt's
        `complete_tokens` (every rank's shard there)."""
        answers = await self.core.match(session, prompts, lease, include_storage)
        return [dataclasses.replace(a, complete_tokens=self.tier.complete_tokens(a.result.host_node))
                for a in answers]

    def order_after(self, session: Session, engine_event: bytes) -> None:
        """The engine's event from an Insert or LoadBack: the session's rank copies
        started from now on (by that call or later) run after it on the GPU. Call
        before the operation."""
        self.ranks.order_after(session.id, engine_event)

    async def insert(self, session: Session, request: InsertRequest) -> InsertAnswer:
        """Save the rank's pages to host (only pages whose shard is not there or on its
        way). `async_`: answer at once with the transfer to acknowledge; otherwise answer
        once copied (UNAVAILABLE if the copy failed)."""
        self._require(session, ENGINE, "Insert")
        with session.lease_room(int(request.lease) - int(bool(request.release_lease))):  # across the copy's wait
            if request.release_lease:
                session.check_lease(request.release_lease)
            self._check_pages(session, request.device_pages, "Insert")
            saved = self.tier.save(request.tokens, request.device_pages, request.extra_key,
                                   owner=session.id, rank=session.rank)
            tid = saved.transfer
            locked = False  # the saved path, kept from eviction while this call waits for the copy
            if tid and request.async_:
                session.answered(tid)
            elif tid:
                self.cache.lock(saved.node)
                locked = True
                try:
                    await self._finish_copied(tid, session, "Insert: the copy from the engine's pages failed")
                    session.check_open()  # a session that closed meanwhile released its leases and takes none
                except BaseException:
                    self.cache.unlock(saved.node)
                    raise
                tid = 0
            if request.release_lease:  # released or expired meanwhile: nothing left to release
                for node in session.pop_held([request.release_lease]):
                    self.cache.unlock(node)
            stored = self.cache.node(saved.node).parent is not None  # the root: no host room for any of it
            lease = 0
            if request.lease and stored:  # the lock taken for the wait becomes the lease
                lease = session.add_lease(saved.node) if locked else self.core.lease(session, saved.node)
            elif locked:
                self.cache.unlock(saved.node)
            return InsertAnswer(InsertResult(saved.cached_tokens, b"", saved.node), lease, transfer=tid)

    async def load_back(self, session: Session, node: int, device_pages: bytes, lease: int = 0,
                        start_page: int = 0, wait: bool = False) -> LoadBackAnswer:
        """Copy the complete host pages of `node`'s path from `start_page` into the rank's
        `device_pages`; nothing is published in the tree. `lease` (any session's, e.g. the
        scheduler's Match lease) must cover `node` when given. `wait`: answer once copied,
        with no transfer to acknowledge (UNAVAILABLE if the copy failed); otherwise once
        the copy is enqueued (on CUDA with its per-layer events), and the session
        acknowledges the transfer."""
        self._require(session, ENGINE, "LoadBack")
        if lease:
            self._check_lease_covers(lease, node)
        self._check_pages(session, device_pages, "LoadBack")
        result = self.tier.load(node, device_pages, start_page, owner=session.id, rank=session.rank)
        if result.transfer and wait:
            await self._finish_copied(result.transfer, session, "LoadBack: the copy into the engine's pages failed")
            return LoadBackAnswer(dataclasses.replace(result, transfer=0))
        if not result.transfer:
            return LoadBackAnswer(result)
        session.answered(result.transfer)
        return LoadBackAnswer(result, await self.ranks.layer_events(result.transfer, session.id))

    async def ack(self, session: Session, transfer: int) -> FinishResult:
        """Finish a save or load of this session once copied. NOT_FOUND (saying so) for
        one that expired."""
        return await self.core.ack(self.tier.finish, session, transfer)

    async def _finish_copied(self, transfer: int, session: Session, failed: str) -> None:
        """Finish a transfer answered once copied (a synchronous Insert, LoadBack(wait)):
        no ack is due; UNAVAILABLE "`failed` (why)" if the copy failed. Shielded: a caller
        that gives up (deadline, cancel) leaves nothing unfinished."""
        done = await asyncio.shield(self.finish(transfer, session.id, missing_ok=True))
        if done is None:  # the session's close finished it meanwhile
            session.check_open()
            raise precondition(f"{failed} (transfer {transfer} was finished by another call)", reasons.TRANSFER_UNKNOWN)
        if done.error is not None:
            raise unavailable(f"{failed} ({done.error})", reasons.COPY_FAILED)

    async def finish(self, transfer: int, owner=None, missing_ok: bool = False) -> FinishResult | None:
        """Finish a save or load once copied (see `NamespaceCore.finish`)."""
        return await self.core.finish(self.tier.finish, transfer, owner, missing_ok)

    def release(self, session: Session, leases: list[int]) -> None:
        """See `NamespaceCore.release`."""
        self.core.release(session, leases)

    async def evict(self, session: Session, num_pages: int) -> EvictAnswer:
        raise precondition(reason=reasons.WRONG_ROLE, message=f"namespace {self.name} is engine-managed: the engines keep their own blocks and the "
                           "daemon holds none to evict (host room is made by the daemon itself)")

    def prefetch(self, session: Session, request: PrefetchRequest) -> AsyncIterator[PrefetchStep]:
        """See `NamespaceCore.prefetch`."""
        return self.core.prefetch(session, request)

    # -- checks ---------------------------------------------------------------------------------

    def _require(self, session: Session, role: str, what: str) -> None:
        if session.role != role:
            raise precondition(reason=reasons.WRONG_ROLE, message=f"{what} needs an {role.upper()} session (registered with its KV buffers); "
                               f"this session is {session.role.upper()}")

    @staticmethod
    def _check_pages(session: Session, pages: bytes, what: str) -> None:
        require_packed(pages, f"{what}: device page")
        if pages:
            p = unpack(pages)
            if min(p) < 0 or max(p) >= session.device_pages:
                raise invalid(f"{what}: device page {min(p) if min(p) < 0 else max(p)} out of range "
                              f"0..{session.device_pages - 1} (this session registered {session.device_pages})")
            if len(set(p)) != len(p):
                twice = next(x for x, n in Counter(p).items() if n > 1)
                raise invalid(f"{what}: device page {twice} is listed twice")

    def _check_lease_covers(self, lease: int, node: int) -> None:
        held = next((s.leases[lease] for s in self.sessions.values() if lease in s.leases), None)
        if held is None:
            raise not_found(f"lease {lease} is not held by any session of namespace {self.name} (released or expired)",
                            reasons.LEASE_UNKNOWN, leases=lease)
        path = {n.id for n in self.cache.node(held).path()}
        if node not in path:
            raise invalid(f"lease {lease} covers node {held}'s path, which does not contain node {node}")

    # -- sessions come and go ---------------------------------------------------------------------

    def partners(self, session: Session) -> list[Session]:
        """None: each session of an engine-managed namespace ends alone."""
        return []

    def device_uuid(self, session: Session) -> str:
        """Always "": Register reports no GPU for an engine-managed session."""
        return ""

    async def end_session(self, session: Session) -> None:
        """The session's own saves and loads are finished (after their copies), its leases
        released, its buffers closed. Other sessions keep theirs."""
        await self.core.end_holdings(self.tier.finish, session, self.tier.pending(session.id))
        self.sessions.pop(session.id, None)
        await self.ranks.detach(session.id)

    async def drain(self) -> None:
        """Return once no copy (any rank's, or storage's) is in flight."""
        await self.copies.drain()

    async def close(self) -> None:
        """Detach every rank session's copy engine and buffers, then close the core as a
        managed namespace does. Idempotent."""
        await self.ranks.close()
        await self.core.close()

    # -- operators --------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """See `NamespaceCore.counters`."""
        return self.core.counters()

    def report_to(self, events) -> None:
        """See `NamespaceCore.report_to`."""
        self.core.report_to(events)

    def check_invariants(self) -> list[str]:
        """The engine tier's invariants, and every session's leases naming locked nodes."""
        out = self.tier.check_invariants()
        for session in self.sessions.values():
            out += self.core.lease_violations(session, f" of session {session.id[:8]}")
        return out


__all__ = ["ENGINE", "SCHEDULER", "EngineNamespace"]
