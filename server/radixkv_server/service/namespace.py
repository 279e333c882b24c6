"""A managed namespace: the daemon holds the engine's device pages in its tree, and one
engine session at a time attaches its buffers (`Daemon.register`).

It owns a `NamespaceCore` (the cache core, its host pool and copies, and what every
namespace does on them: match, release, prefetch, waiting, finishing) and adds the
operations of a managed device tier: insert, load-back, evict, attaching and detaching
the engine's buffers, ending its session. Sessions are asked which leases and load-backs
are theirs; the namespace does the locking and finishing on the core.

The event loop owns all of it (see namespace_core.py for the rule about `await`s).
"""

import asyncio
import functools
import logging
from collections.abc import AsyncIterator

from ..core import FinishResult
from ..core.pages import count
from ..datapath import DeviceBuffers, HostPool
from ..logs import log_event
from .calls import EvictAnswer, InsertAnswer, InsertRequest, LoadBackAnswer, MatchAnswer, PrefetchRequest, \
    PrefetchStep, Prompt
from .errors import invalid
from .namespace_config import NamespaceConfig
from .namespace_core import NamespaceCore
from .rank_group import RankGroup
from .sessions import Session

log = logging.getLogger("radixkv.namespace")


class Namespace:
    """`config`, `host_pool`, `cache` (the core) and `copies`: its core's (Stats, metrics)."""

    engine_managed = False
    owner = b""  # the tenant whose Register created it (admission.py); set by the Daemon

    def __init__(self, config: NamespaceConfig, host_pool: HostPool, device: DeviceBuffers | None, *,
                 num_device_pages: int = 0, metrics=None, storage=None):
        """`device`: the engine's buffers; None when `config.tp_size` > 1 (its ranks join
        with `num_device_pages` each: `join_rank`). `storage`: the daemon's, or None."""
        num_device_pages = device.num_pages if device is not None else num_device_pages
        self.core = NamespaceCore(config, host_pool, num_device_pages=num_device_pages, metrics=metrics,
                                  storage=storage)
        self.num_device_pages = num_device_pages  # a group's ranks': set by the first rank of each group
        self.group = RankGroup(config.name, config.tp_size) if config.tp_size > 1 else None
        self._group_detach: asyncio.Task | None = None  # the last group's buffers being detached
        self.name, self.layout, self.config, self.host_pool = config.name, config.layout, config, host_pool
        self.cache, self.copies, self.expirations = self.core.cache, self.core.copies, self.core.expirations
        self.session: Session | None = None  # the attached engine's session (set by the Daemon)
        self.page_geometry: tuple[int, int] | None = None  # registration.page_geometry, of the first engine
        self._abandoned: set[asyncio.Task] = set()  # Evicts whose callers gave up (see `evict`)
        self._dropped_at_detach = 0  # tokens the last session's end dropped, for the next Register
        self._room_waited: set[int] = set()  # copies an Evict waited for host room on (see `_evict`)
        self._swapping = 0  # a group's buffers being attached or detached now (check_invariants)
        if device is not None:
            self.copies.attach(device)

    @property
    def attached(self) -> bool:
        """Whether an engine's session (of a tensor-parallel group: any rank's) is attached."""
        return self.session is not None or bool(self.group and self.group.sessions)

    @classmethod
    async def open(cls, config: NamespaceConfig, device: DeviceBuffers | None, *, num_device_pages: int = 0,
                   metrics=None, storage=None) -> "Namespace":
        """A new namespace; its host pool is allocated (and pinned) off the loop."""
        pool = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(HostPool, config.host_layout, config.host_pages, device=config.pin_device,
                                    prefault=config.prefault_host))
        return cls(config, pool, device, num_device_pages=num_device_pages, metrics=metrics, storage=storage)

    def _check_caller(self, session: Session, what: str) -> None:
        """Of a tensor-parallel namespace, only its complete group's rank 0 calls (`RankGroup.check_driver`)."""
        if self.group is not None:
            self.group.check_driver(session, what)

    # -- engine operations ----------------------------------------------------------------

    async def match(self, session: Session, prompts: list[Prompt], lease: bool,
                    include_storage: bool = False) -> list[MatchAnswer]:
        """See `NamespaceCore.match`. An empty one is a liveness probe: any rank's."""
        if prompts:
            self._check_caller(session, "Match")
        return await self.core.match(session, prompts, lease, include_storage)

    def order_after(self, session: Session, engine_event: bytes) -> None:
        """The engine's event from an Insert, Evict or LoadBack: copies to and from its
        buffers started from now on (by that call or later) run after it on the GPU.
        Call before the operation. Another rank's than the driver's orders nothing: the
        operation is refused next (`_check_caller`)."""
        if self.group is not None and session is not self.group.driver:
            return
        self.copies.order_after(engine_event)

    async def insert(self, session: Session, request: InsertRequest) -> InsertAnswer:
        """Hand finished KV to the cache (waiting for copies the core names first), then
        release `release_lease` and take a lease if asked. NOT_FOUND for a lease the
        session does not hold, checked before anything changes."""
        self._check_caller(session, "Insert")

        def attempt():
            if request.release_lease:
                session.check_lease(request.release_lease)
            return self.cache.insert(request.tokens, request.device_pages, request.extra_key, request.chunked)

        with session.lease_room(int(request.lease) - int(bool(request.release_lease))):  # across the wait
            result = await self.core.until_copied(attempt, session)
            if request.release_lease:
                self.cache.unlock(session.pop_lease(request.release_lease))
            return InsertAnswer(result, self.core.lease(session, result.node) if request.lease else 0)

    async def load_back(self, session: Session, node: int, device_pages: bytes, lease: int = 0,
                        start_page: int = 0, wait: bool = False) -> LoadBackAnswer:
        """Start copying `node`'s host-only path into `device_pages`; the session owes an
        ack for the transfer. On CUDA, answers once the copy is enqueued (with its events).
        `lease`, `start_page` and `wait` are for engine-managed namespaces only
        (INVALID_ARGUMENT)."""
        self._check_caller(session, "LoadBack")
        if lease or start_page or wait:
            raise invalid("LoadBack: lease, start_page and wait are for engine-managed namespaces; a "
                          "managed-device load re-plans from the tree's device prefix and is acknowledged")
        result = self.cache.load_back(node, device_pages, owner=session.id)
        if not result.transfer:
            return LoadBackAnswer(result)
        session.answered(result.transfer)
        return LoadBackAnswer(result, await self.copies.layer_events(result.transfer))

    async def ack(self, session: Session, transfer: int) -> FinishResult:
        """Finish a load-back of this session once its copy completed. NOT_FOUND (saying
        so) for one that expired."""
        self._check_caller(session, "Ack")
        return await self.core.ack(self.cache.finish_load_back, session, transfer)

    async def finish(self, transfer: int, owner=None, missing_ok: bool = False) -> FinishResult | None:
        """Finish a load-back once its copies completed (see `NamespaceCore.finish`)."""
        return await self.core.finish(self.cache.finish_load_back, transfer, owner, missing_ok)

    def release(self, session: Session, leases: list[int]) -> None:
        """See `NamespaceCore.release`."""
        self._check_caller(session, "Release")
        self.core.release(session, leases)

    async def evict(self, session: Session, num_pages: int) -> EvictAnswer:
        """Free up to `num_pages` device pages, waiting for write-backs, and, once, for the
        write-through backups in flight when too few nodes could leave (a node being
        backed up stays until its host copy is whole: with asynchronous copies, a GPU's,
        an engine that inserted just before would otherwise get fewer pages than the
        cache could give). The answer says how many freed pages were written back first.

        An Evict whose caller gave up (deadline, cancel) runs to its end: the pages it
        frees have left the tree and belong to the engine, so the next Evict waits for it
        and answers them too, on top of what it frees itself (up to `num_pages` in all,
        or more when the abandoned one freed more)."""
        self._check_caller(session, "Evict")
        earlier = await self._abandoned_answer()
        # No await since `earlier` was taken: the task holds its pages from here on.
        task = asyncio.ensure_future(self._evict(num_pages - count(earlier.freed_pages), earlier))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():  # this caller gave up, not the namespace closing
                self._abandoned.add(task)
            raise

    async def _abandoned_answer(self) -> EvictAnswer:
        """The pages freed by Evicts whose callers gave up, once those ended (they are
        forgotten at once, with nothing awaited after, so no answer carries them twice)."""
        tasks = list(self._abandoned)
        if not tasks:
            return EvictAnswer(b"", 0)
        await asyncio.wait(tasks)  # a caller cancelled here leaves them for the next
        freed, written_back = [], 0
        for task in tasks:
            if task in self._abandoned:
                self._abandoned.discard(task)
                if not task.cancelled() and task.exception() is None:
                    freed.append(task.result().freed_pages)
                    written_back += task.result().written_back_pages
        return EvictAnswer(b"".join(freed), written_back)

    async def _evict(self, num_pages: int, earlier: EvictAnswer) -> EvictAnswer:
        """`evict`'s work; the answer starts with `earlier`'s pages."""
        freed: list[bytes] = [earlier.freed_pages]
        written_back = earlier.written_back_pages
        need = num_pages
        waited, keep_for_room = False, True
        while need > 0:
            result = self.cache.evict_device(need, keep_for_room)
            freed.append(result.freed_pages)
            progress = count(result.freed_pages)
            if not result.pending:
                if result.backing_up and keep_for_room and progress < need:
                    need -= progress
                    # Each copy is waited for once, by one Evict: one still running after
                    # that wait (a stuck store) is not waited for again, and what waited
                    # for room is dropped, as when no room is coming (engines are not held).
                    self._room_waited &= self.cache.transfers.keys()
                    fresh = [t for t in result.backing_up if t not in self._room_waited]
                    keep_for_room = bool(fresh) and not waited and await self._wait_for_room(fresh)
                    waited = True
                    continue
                break
            for pages in await asyncio.gather(*map(self.copies.written_back, result.pending)):
                freed.append(pages)
                written_back += count(pages)
                progress += count(pages)
            if progress == 0:
                break  # write-backs kept their nodes (touched meanwhile)
            need -= progress
        return EvictAnswer(b"".join(freed), written_back)

    async def _wait_for_room(self, transfers: list[int]) -> bool:
        """Wait for the backups and room-freeing stores an Evict came short on (each once:
        `_room_waited`), as `NamespaceCore.wait_for_room`. Whether they all ended."""
        self._room_waited.update(transfers)
        return await self.core.wait_for_room(transfers, "evict.store_wait_ended")

    def prefetch(self, session: Session, request: PrefetchRequest) -> AsyncIterator[PrefetchStep]:
        """See `NamespaceCore.prefetch`."""
        self._check_caller(session, "Prefetch")
        return self.core.prefetch(session, request)

    # -- sessions and buffers come and go ---------------------------------------------------

    def device_uuid(self, session: Session) -> str:
        """The GPU the session's buffers were opened on ("" unless CUDA)."""
        if self.group is not None:
            return self.group.device_uuids.get(session.rank, "")
        return self.copies.device_uuid

    async def end_session(self, session: Session) -> None:
        """What the session held ends with it: its load-backs are finished (after their
        copies), its leases released, the engine's device buffers closed. A rank of a
        tensor-parallel group ends the group's hold: the driver's load-backs and leases
        end, and every rank's buffers close (its other sessions are ended by the daemon,
        `partners`)."""
        if self.group is not None:
            await self._end_rank(session)
            return
        await self.core.end_holdings(self.cache.finish_load_back, session, self.cache.pending_loads(session.id))
        await self.detach()

    async def _end_rank(self, session: Session) -> None:
        """The group's sessions all began closing at once (`Daemon._end_session`), so no
        call of the driver starts a load from here; one already past its checks may, so
        its loads are finished until none is left. The first rank to leave a complete
        group detaches every rank's buffers, whatever happened before, and every rank's
        close ends only once that detach did: a close answered while a backup still read
        the ranks' pages let the engine reuse them under it (the backup stored new KV
        under the old tokens)."""
        try:
            driver = self.group.driver
            while driver is not None and (pending := self.cache.pending_loads(driver.id)):
                await self.core.end_holdings(self.cache.finish_load_back, driver, pending)
            if driver is not None:
                await self.core.end_holdings(self.cache.finish_load_back, driver, [])
        finally:
            if self.session is session:
                self.session = None
            if self.group.leave(session):
                self._group_detach = asyncio.ensure_future(self._detach_group())
            if self._group_detach is not None:  # every rank's close ends once no copy reads its pages
                await asyncio.shield(self._group_detach)

    async def _detach_group(self) -> None:
        self._swapping += 1
        try:
            await self.detach()
        finally:  # (check_invariants allows a group's buffers half detached meanwhile)
            self._swapping -= 1

    def partners(self, session: Session) -> list[Session]:
        """The sessions that end with `session`: the other ranks of its tensor-parallel
        group (none otherwise)."""
        return self.group.partners(session) if self.group is not None else []

    async def join_rank(self, session: Session, device: DeviceBuffers, warm: bool) -> int:
        """Rank `session.rank` of a tensor-parallel namespace joins with its buffers
        (`RankGroup.join`; its place free: the registration checked). Once every rank is
        in, their buffers are attached as one device (`attach`). Returns the tokens
        dropped with the previous group's device residency (to every waiting rank too)."""
        if session.rank == 0:
            self.session = session
        if not self.group.sessions:  # a new engine may bring a new page count
            self.num_device_pages = device.num_pages
        ranked = self.group.join(session, device, warm)
        if ranked is None:
            return 0
        self._swapping += 1
        try:
            dropped = await self.attach(ranked)
        except BaseException:
            ranked.close()  # every rank's buffers: the group ends (the registration closes it)
            raise
        finally:
            self._swapping -= 1
        self.group.formed(dropped)
        return dropped

    async def attach(self, device: DeviceBuffers) -> int:
        """Swap in a restarted engine's device buffers: wait for copies (not stores of
        pages that stay: `device_drop_waits_for`), drop the old device residency (host
        copies stay). Returns the tokens dropped from the cache with the previous engine's
        device residency: here, or when its session ended (`detach`)."""
        await self.copies.drain(self.cache.device_drop_waits_for)
        self._abandoned.clear()  # pages of the engine that left
        dropped = self.cache.drop_device(device.num_pages) + self._dropped_at_detach
        self._dropped_at_detach = 0
        self.copies.attach(device)
        log_event(log, "namespace.reattached", namespace=self.name, dropped_tokens=dropped)
        return dropped

    async def detach(self) -> int:
        """The engine's session ended: wait for copies, forget its device pages (host and
        storage copies stay) and close its buffers, so a dead engine's memory (a CUDA
        IPC mapping keeps it allocated) is not held until the next registration. Waits
        for no store of pages that stay (`HierarchicalCache.device_drop_waits_for`: a
        slow store held every Close). Returns tokens dropped from the cache. Idempotent;
        buffers attached while it waited (another engine's) stay."""
        device = self.copies.device
        await self.copies.drain(self.cache.device_drop_waits_for)
        if device is None or self.copies.device is not device:
            return 0
        self._abandoned.clear()  # pages of the engine that left
        dropped = self.cache.drop_device(0)
        self._dropped_at_detach += dropped  # the next engine's Register reports them
        self.copies.release_device()
        log_event(log, "namespace.detached", namespace=self.name, dropped_tokens=dropped)
        return dropped

    async def drain(self) -> None:
        """Return once no copy is in flight (shutdown waits for this before stopping gRPC)."""
        await self.copies.drain()

    async def close(self) -> None:
        """Drain copies, stop the copy threads, close the device buffers (IPC handles),
        stop storage I/O and close the host pool (unpinning it); KV-event subscribers
        told to forget the namespace. Idempotent."""
        if self.group is not None:
            self.group.close()
        await self.core.close()

    # -- operators --------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """See `NamespaceCore.counters`."""
        return self.core.counters()

    def report_to(self, events) -> None:
        """See `NamespaceCore.report_to`."""
        self.core.report_to(events)

    def check_invariants(self) -> list[str]:
        """The core's violations, and any lease of the attached session naming a node
        that is not locked; of a tensor-parallel namespace, also a complete group whose
        buffers are not attached, buffers attached to an incomplete group that no rank
        is leaving, and a driver that is not its rank 0."""
        out = self.cache.check_invariants()
        if self.session is not None:
            out += self.core.lease_violations(self.session)
        if self.group is not None:
            attached = self.copies.device is not None
            if self.group.complete and not attached and not self._swapping:
                out.append(f"every one of {self.group.tp_size} ranks is in, yet their buffers are not attached")
            if attached and not self.group.complete and not self._swapping:
                out.append(f"{len(self.group.sessions)} of {self.group.tp_size} ranks are in and none is leaving, "
                           "yet the ranks' buffers are attached (a left engine's memory held)")
            if self.session is not self.group.driver:
                out.append("the namespace's session is not its group's rank 0")
        return out
