"""EngineNamespace: a namespace whose device tier the engines manage (vLLM).

The tree holds host and storage residency only (the core's `EngineTier`). Any number
of sessions share it: each engine instance's SCHEDULER session (Match with leases,
Release, Prefetch) and its `tp_size` ENGINE rank sessions (Insert = save, LoadBack =
load into the blocks the engine allocated, both acknowledged on the session's Acks
stream). A session's end finishes only its own transfers and releases only its own
leases. Evict is refused: the daemon holds no engine page to give back.

Match, Release and Prefetch are the managed namespace's (same tree, same leases).
"""

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from typing import TypeVar

from radixkv.layout import KvLayout

from ..core import FinishResult, InsertResult, NotReady
from ..core.engine_tier import EngineTier
from ..core.errors import UnknownTransfer
from ..core.pages import unpack
from ..datapath import CopyError, CopyJob, DeviceBuffers, HostPool
from .calls import EvictAnswer, InsertAnswer, InsertRequest, LoadBackAnswer, MatchAnswer, Prompt
from .errors import invalid, not_found, precondition, unavailable
from .namespace import Namespace
from .namespace_config import NamespaceConfig
from .rank_copies import RankCopies
from .sessions import Session

T = TypeVar("T")
SCHEDULER, ENGINE = "scheduler", "engine"


def host_layout(layout: KvLayout, tp_size: int) -> KvLayout:
    """The layout of one host page holding `tp_size` ranks' shards of `layout`'s page."""
    return dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads * tp_size)


class _NoDevice(DeviceBuffers):
    """The managed namespace's device slot, empty: engine pages are the rank sessions'."""

    def __init__(self, layout: KvLayout):
        self.layout = layout
        self.num_pages = 0

    def submit_load(self, host_pool, host_pages, device_pages, after=b"") -> CopyJob:
        raise CopyError("an engine-managed namespace copies through its rank sessions")

    submit_store = submit_load

    def close(self) -> None:
        pass


class EngineNamespace(Namespace):
    engine_managed = True

    def __init__(self, config: NamespaceConfig, host_pool: HostPool, tp_size: int, *, metrics=None, storage=None):
        super().__init__(config, host_pool, _NoDevice(config.layout), "none", metrics=metrics, storage=storage)
        self.copies.release_device()
        self.tp_size = tp_size
        self.sessions: dict[str, Session] = {}
        self.ranks = RankCopies(config, host_pool, tp_size, self._copied)
        self.copies.others = self.ranks
        self.tier = EngineTier(self.cache.state, self.cache.host_space, self.ranks, tp_size)

    @classmethod
    async def open_engine(cls, config: NamespaceConfig, tp_size: int, *, metrics=None,
                          storage=None) -> "EngineNamespace":
        """A new engine-managed namespace; its host pool (pages of `tp_size` shards) is
        allocated off the loop."""
        pool = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(HostPool, host_layout(config.layout, tp_size), config.host_pages,
                                    device=config.pin_device))
        return cls(config, pool, tp_size, metrics=metrics, storage=storage)

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
        """The managed match, plus each prompt's `complete_tokens` (every rank's shard there)."""
        answers = await super().match(session, prompts, lease, include_storage)
        return [dataclasses.replace(a, complete_tokens=self.tier.complete_tokens(a.result.host_node))
                for a in answers]

    async def insert(self, session: Session, request: InsertRequest) -> InsertAnswer:
        """Save the rank's pages to host (only pages whose shard is not there or on its
        way). `async_`: answer at once with the transfer to acknowledge; otherwise answer
        once copied (UNAVAILABLE if the copy failed)."""
        self._require(session, ENGINE, "Insert")
        if request.release_lease:
            session.check_lease(request.release_lease)
        self._check_pages(session, request.device_pages, "Insert")
        saved = self.tier.save(request.tokens, request.device_pages, request.extra_key,
                               owner=session.id, rank=session.rank)
        cached, node, tid = saved.cached_tokens, saved.node, saved.transfer
        if tid and request.async_:
            session.answered(tid)
        elif tid:
            done = await self.finish(tid, session.id)
            if done.error is not None:
                raise unavailable(f"Insert: the copy from the engine's pages failed ({done.error})")
            tid = 0
        if request.release_lease:
            self.cache.unlock(session.pop_lease(request.release_lease))
        saved = self.cache.node(node).parent is not None  # the root: no host room for any of it
        lease = self._lease(session, node) if request.lease and saved else 0
        return InsertAnswer(InsertResult(cached, b"", node), lease, transfer=tid)

    async def load_back(self, session: Session, node: int, device_pages: bytes, lease: int = 0,
                        start_page: int = 0) -> LoadBackAnswer:
        """Copy the complete host pages of `node`'s path from `start_page` into the rank's
        `device_pages`; nothing is published in the tree. `lease` (any session's, e.g. the
        scheduler's Match lease) must cover `node` when given."""
        self._require(session, ENGINE, "LoadBack")
        if lease:
            self._check_lease_covers(lease, node)
        self._check_pages(session, device_pages, "LoadBack")
        result = self.tier.load(node, device_pages, start_page, owner=session.id, rank=session.rank)
        if result.transfer:
            session.answered(result.transfer)
        return LoadBackAnswer(result)

    async def finish(self, transfer: int, owner=None, missing_ok: bool = False) -> FinishResult | None:
        """Finish a save or load once copied (an ack, a close, an expiry)."""
        try:
            return await self._until_copied(lambda: self.tier.finish(transfer, owner))
        except UnknownTransfer:
            if not missing_ok:
                raise
            return None

    async def evict(self, num_pages: int) -> EvictAnswer:
        raise precondition(f"namespace {self.name} is engine-managed: the engines keep their own blocks and the "
                           "daemon holds none to evict (host room is made by the daemon itself)")

    async def _until_copied(self, attempt: Callable[[], T], session: Session | None = None) -> T:
        while True:
            try:
                return attempt()
            except NotReady as e:
                await self.ranks.wait(e.transfers)
                await self.copies.wait(e.transfers)
                if session is not None:
                    session.check_open()

    # -- checks ---------------------------------------------------------------------------------

    def _require(self, session: Session, role: str, what: str) -> None:
        if session.role != role:
            raise precondition(f"{what} needs an {role.upper()} session (registered with its KV buffers); "
                               f"this session is {session.role.upper()}")

    @staticmethod
    def _check_pages(session: Session, pages: bytes, what: str) -> None:
        if len(pages) % 4:
            raise invalid(f"{what}: device page bytes ({len(pages)}) are not packed int32")
        if pages:
            p = unpack(pages)
            if min(p) < 0 or max(p) >= session.device_pages:
                raise invalid(f"{what}: device page {min(p) if min(p) < 0 else max(p)} out of range "
                              f"0..{session.device_pages - 1} (this session registered {session.device_pages})")

    def _check_lease_covers(self, lease: int, node: int) -> None:
        held = next((s.leases[lease] for s in self.sessions.values() if lease in s.leases), None)
        if held is None:
            raise not_found(f"lease {lease} is not held by any session of namespace {self.name} (released or expired)")
        path = {n.id for n in self.cache.node(held).path()}
        if node not in path:
            raise invalid(f"lease {lease} covers node {held}'s path, which does not contain node {node}")

    # -- sessions come and go ---------------------------------------------------------------------

    async def end_session(self, session: Session) -> None:
        """The session's own saves and loads are finished (after their copies), its leases
        released, its buffers closed. Other sessions keep theirs."""
        for tid in self.tier.pending(session.id):
            await self.finish(tid, None, missing_ok=True)
        for node in session.pop_all_leases():
            self.cache.unlock(node)
        session.forget_loads()
        self.sessions.pop(session.id, None)
        await self.ranks.detach(session.id)

    async def drain(self) -> None:
        await self.ranks.drain()
        await self.copies.drain()

    async def close(self) -> None:
        await self.ranks.drain()
        await self.ranks.close()
        await super().close()

    # -- operators --------------------------------------------------------------------------------

    def check_invariants(self) -> list[str]:
        """The engine tier's invariants, and every session's leases naming locked nodes."""
        out = self.tier.check_invariants()
        for session in self.sessions.values():
            for lease, node_id in session.leases.items():
                n = self.cache.tree.nodes.get(node_id)
                if n is None or (n.parent is not None and n.full.lock_ref <= 0):
                    out.append(f"lease {lease} of session {session.id[:8]} names node {node_id}, which is not locked")
        return out


__all__ = ["ENGINE", "SCHEDULER", "EngineNamespace", "host_layout"]
