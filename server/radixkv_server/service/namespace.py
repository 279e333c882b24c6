"""A namespace: one cache core, its host pool, its copies, and the operations engines
call on it (match, insert, load-back and ack, release, evict, prefetch).

The event loop owns all of it. No tree change spans an `await`: an operation that must
wait for copies waits first (`_until_copied`), then re-checks its session and tries the
core again. Sessions are asked which leases and load-backs are theirs; the namespace
does the locking and finishing on the core.
"""

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from radixkv.layout import KvLayout

from ..core import FinishResult, HierarchicalCache, NotReady
from ..core.errors import UnknownTransfer
from ..core.pages import count
from ..datapath import DeviceBuffers, HostPool
from ..logs import log_event
from .calls import (
    EvictAnswer, InsertAnswer, InsertRequest, LoadBackAnswer, MatchAnswer, PrefetchPolicy, PrefetchRequest,
    PrefetchState, PrefetchStep, Prompt,
)
from .copies import Copies
from .errors import invalid, not_found, precondition
from .namespace_config import NamespaceConfig
from .sessions import Session

log = logging.getLogger("radixkv.namespace")
T = TypeVar("T")


class Namespace:
    def __init__(self, config: NamespaceConfig, host_pool: HostPool, device: DeviceBuffers, backend: str, *,
                 metrics=None, storage=None):
        """`storage`: the daemon's StorageBackend, or None. Call on the event loop."""
        self.config = config
        self.host_pool = host_pool
        self.session: Session | None = None  # the attached engine's session; set by the Daemon
        self.expirations = {"lease": 0, "load_back": 0}  # released by the daemon's timeouts
        self.copies = Copies(config, host_pool, metrics, storage)
        self.cache = HierarchicalCache(config.cache, self.copies, num_device_pages=device.num_pages,
                                       host_pages=host_pool.num_pages)
        self.copies.bind(self.cache)
        self.copies.attach(device, backend)

    @classmethod
    async def open(cls, config: NamespaceConfig, device: DeviceBuffers, backend: str, *,
                   metrics=None, storage=None) -> "Namespace":
        """A new namespace; its host pool is allocated (and pinned) off the loop."""
        pool = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(HostPool, config.layout, config.host_pages, device=config.pin_device))
        return cls(config, pool, device, backend, metrics=metrics, storage=storage)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def layout(self) -> KvLayout:
        return self.config.layout

    # -- engine operations ----------------------------------------------------------------

    async def match(self, session: Session, prompts: list[Prompt], lease: bool,
                    include_storage: bool = False) -> list[MatchAnswer]:
        """Match every prompt; with `lease`, lock each matched path (until released); with
        `include_storage`, also count the tokens past the cache that storage holds. The
        matches are atomic; the storage probe comes after them. The prompts must be packed
        int32 (`convert.prompts` checks), so no match fails after another took a lease."""
        matched = []
        for p in prompts:
            result = self.cache.match(p.tokens, p.extra_key)
            held = lease and (result.device_tokens or result.host_tokens)
            matched.append((result, self._lease(session, result.host_node) if held else 0))
        stored = [0] * len(prompts)
        if include_storage and self.copies.storage is not None:
            probes = [self.cache.storage_probe(p.tokens, p.extra_key).keys for p in prompts]
            stored = [n * self.layout.page_size for n in await self.copies.probe(probes)]
            self.cache.counters.storage_hit_tokens += sum(stored)
        return [MatchAnswer(r, lease_id, n) for (r, lease_id), n in zip(matched, stored)]

    def order_after(self, engine_event: bytes) -> None:
        """The engine's event from an Insert, Evict or LoadBack: copies started from now
        on (by that call or later) run after it on the GPU. Call before the operation."""
        self.copies.order_after(engine_event)

    async def insert(self, session: Session, request: InsertRequest) -> InsertAnswer:
        """Hand finished KV to the cache (waiting for copies the core names first), then
        release `release_lease` and take a lease if asked. NOT_FOUND for a lease the
        session does not hold, checked before anything changes."""
        def attempt():
            if request.release_lease:
                session.check_lease(request.release_lease)
            return self.cache.insert(request.tokens, request.device_pages, request.extra_key, request.chunked)

        result = await self._until_copied(attempt, session)
        if request.release_lease:
            self.cache.unlock(session.pop_lease(request.release_lease))
        return InsertAnswer(result, self._lease(session, result.node) if request.lease else 0)

    async def load_back(self, session: Session, node: int, device_pages: bytes, lease: int = 0,
                        start_page: int = 0) -> LoadBackAnswer:
        """Start copying `node`'s host-only path into `device_pages`; the session owes an
        ack for the transfer. On CUDA, answers once the copy is enqueued (with its events).
        `lease` and `start_page` are for engine-managed namespaces only (INVALID_ARGUMENT)."""
        if lease or start_page:
            raise invalid("LoadBack: lease and start_page are for engine-managed namespaces; a managed-device "
                          "load re-plans from the tree's device prefix")
        result = self.cache.load_back(node, device_pages, owner=session.id)
        if not result.transfer:
            return LoadBackAnswer(result)
        session.answered(result.transfer)
        return LoadBackAnswer(result, await self.copies.layer_events(result.transfer))

    async def ack(self, session: Session, transfer: int) -> FinishResult:
        """Finish a load-back of this session once its copy completed. NOT_FOUND (saying
        so) for one that expired."""
        session.acked(transfer)
        try:
            return await self.finish(transfer, owner=session.id)
        except UnknownTransfer:
            why = session.expired_reason("load_back", transfer)
            if why is not None:
                raise not_found(f"transfer {transfer} {why}") from None
            raise

    async def finish(self, transfer: int, owner=None, missing_ok: bool = False) -> FinishResult | None:
        """Finish a load-back once its copies completed. With `missing_ok` (closing a
        session, expiring a load), one that an ack finished meanwhile is no error."""
        try:
            return await self._until_copied(lambda: self.cache.finish_load_back(transfer, owner=owner))
        except UnknownTransfer:
            if not missing_ok:
                raise
            return None

    def release(self, session: Session, leases: list[int]) -> None:
        """Unlock the paths of the listed leases: all of them, or none (see Session.pop_leases)."""
        for node in session.pop_leases(leases):
            self.cache.unlock(node)

    async def evict(self, num_pages: int) -> EvictAnswer:
        """Free up to `num_pages` device pages, waiting for write-backs. The answer says
        how many of the freed pages were written back to host first."""
        freed: list[bytes] = []
        written_back = 0
        need = num_pages
        while need > 0:
            result = self.cache.evict_device(need)
            freed.append(result.freed_pages)
            progress = count(result.freed_pages)
            if not result.pending:
                break
            for pages in await asyncio.gather(*map(self.copies.written_back, result.pending)):
                freed.append(pages)
                written_back += count(pages)
                progress += count(pages)
            if progress == 0:
                break  # write-backs kept their nodes (touched meanwhile)
            need -= progress
        return EvictAnswer(b"".join(freed), written_back)

    async def prefetch(self, session: Session, request: PrefetchRequest) -> AsyncIterator[PrefetchStep]:
        """Fetch what storage holds of the prompt past the cache into host memory,
        reporting progress as the policy asks. FAILED_PRECONDITION without storage."""
        if self.copies.storage is None:
            raise precondition("no storage tier is configured (start the daemon with --storage)")
        (pages,) = await self.copies.probe([self.cache.storage_probe(request.tokens, request.extra_key).keys])
        session.check_open()
        transfer = self.cache.start_prefetch(request.tokens, request.extra_key, pages, owner=session.id) if pages else 0
        if not transfer:
            yield PrefetchStep(PrefetchState.NOTHING)
            return
        done = self.copies.fetched(transfer)  # before the first yield: the fetch may finish meanwhile
        tokens = pages * self.layout.page_size
        yield PrefetchStep(PrefetchState.STARTED, transfer, tokens)
        if request.policy is PrefetchPolicy.BEST_EFFORT:
            return
        timeout = request.timeout if request.policy is PrefetchPolicy.TIMEOUT else None
        try:
            outcome = await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            yield PrefetchStep(PrefetchState.WAITING_ENDED, transfer, tokens)
            return
        yield PrefetchStep.done(transfer, tokens, outcome, self.layout.page_size)

    def _lease(self, session: Session, node_id: int) -> int:
        self.cache.lock(node_id)
        return session.add_lease(node_id)

    async def _until_copied(self, attempt: Callable[[], T], session: Session | None = None) -> T:
        """`attempt()` (one core call), tried again after each `NotReady` once the copies
        it names completed. With `session`: FAILED_PRECONDITION if it closed meanwhile."""
        while True:
            try:
                return attempt()
            except NotReady as e:
                await self.copies.wait(e.transfers)
                if session is not None:
                    session.check_open()

    # -- sessions come and go ---------------------------------------------------------------

    async def end_session(self, session: Session) -> None:
        """What the session held ends with it: its load-backs are finished (after their
        copies), its leases released, the engine's device buffers closed."""
        for tid in self.cache.pending_loads(session.id):
            await self.finish(tid, None, missing_ok=True)
        for node in session.pop_all_leases():
            self.cache.unlock(node)
        session.forget_loads()
        await self.detach()

    def has_transfer(self, transfer: int) -> bool:
        """Whether `transfer` is still in flight or unfinished on the core."""
        return transfer in self.cache.transfers

    async def attach(self, device: DeviceBuffers, backend: str) -> int:
        """Swap in a restarted engine's device buffers: wait for copies, drop the old
        device residency (host copies stay). Returns tokens dropped from the cache."""
        await self.copies.drain()
        dropped = self.cache.drop_device(device.num_pages)
        self.copies.attach(device, backend)
        log_event(log, "namespace.reattached", namespace=self.name, dropped_tokens=dropped)
        return dropped

    async def detach(self) -> int:
        """The engine's session ended: wait for copies, forget its device pages (host and
        storage copies stay) and close its buffers, so a dead engine's memory (a CUDA
        IPC mapping keeps it allocated) is not held until the next registration.
        Returns tokens dropped from the cache. Idempotent."""
        await self.copies.drain()
        if self.copies.device is None:
            return 0
        dropped = self.cache.drop_device(0)
        self.copies.release_device()
        log_event(log, "namespace.detached", namespace=self.name, dropped_tokens=dropped)
        return dropped

    async def drain(self) -> None:
        """Return once no copy is in flight."""
        await self.copies.drain()

    async def close(self) -> None:
        """Drain copies, stop the copy threads, close the device buffers (IPC handles),
        stop storage I/O and close the host pool (unpinning it). Idempotent."""
        await self.copies.drain()
        self.copies.close()
        self.host_pool.close()

    # -- operators --------------------------------------------------------------------------

    def check_invariants(self) -> list[str]:
        """The core's violations, and any lease of the attached session naming a node
        that is not locked."""
        out = self.cache.check_invariants()
        leases = self.session.leases if self.session is not None else {}
        for lease, node_id in leases.items():
            n = self.cache.tree.nodes.get(node_id)
            if n is None or (n.parent is not None and n.full.lock_ref <= 0):
                out.append(f"lease {lease} names node {node_id}, which is not locked")
        return out
