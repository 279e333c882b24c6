"""The daemon's state above the core: namespaces, sessions, and every operation that
spans an `await` (registration, waiting for copies). RPC handlers call into here.

The event loop owns everything. No tree change spans an `await`: an operation that
must wait for copies waits first, then re-checks its session and retries on the core.
"""

import asyncio
import functools
import logging
import time
import uuid

from ..config import DaemonConfig
from ..core import LoadBackResult, NotReady
from ..core.errors import UnknownTransfer
from ..datapath import HostPool
from ..logs import log_event
from . import registration
from .errors import exhausted, invalid, not_found, precondition, unavailable
from .expiry import Expiry
from .namespace import Namespace
from .sessions import Session, SessionRegistry

log = logging.getLogger("radixkv.daemon")

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


class Daemon:
    def __init__(self, config: DaemonConfig, metrics=None, storage=None):
        self.config = config
        self.metrics = metrics
        self.storage = storage  # StorageBackend shared by every namespace, or None
        self.instance = uuid.uuid4().hex[:12]
        self.started = time.monotonic()
        self.namespaces: dict[str, Namespace] = {}
        self.sessions = SessionRegistry()
        self.accepting = True
        self.stopping = asyncio.Event()
        self._register_lock = asyncio.Lock()  # registrations await I/O; one at a time
        self._background: set[asyncio.Task] = set()
        self.expiry = Expiry(self)

    def start(self) -> None:
        """Start background duties (expiring what a stuck engine holds). Call on the loop."""
        self.expiry.start()

    def run_in_background(self, coro) -> None:
        """Run `coro` as a task that `close` waits for."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- registration ------------------------------------------------------------------

    async def register(self, reg: registration.Registration) -> registration.Registered:
        """Attach an engine. Validates everything, then opens its device buffers and
        creates (or re-attaches) the namespace. Errors change nothing."""
        if not self.accepting:
            raise unavailable("the daemon is shutting down; register with its successor")
        registration.validate(reg)
        async with self._register_lock:
            ns = self.namespaces.get(reg.namespace)
            policy = reg.write_policy or (ns.config.write_policy.value if ns else self.config.write_policy)
            if ns is not None:
                registration.check_compatible(ns, reg, policy)
                if ns.session is not None:
                    if not reg.replace_existing:
                        raise precondition(
                            f"namespace {reg.namespace} is attached to a live session (engine "
                            f"{ns.session.engine or 'unnamed'}); after an engine restart pass replace_existing")
                    await self.close_session(ns.session, "replaced by a new registration")
            elif len(self.namespaces) >= self.config.max_namespaces:
                raise exhausted(f"namespace limit reached ({self.config.max_namespaces}); raise --max-namespaces")
            if len(self.sessions) >= self.config.max_sessions:
                raise exhausted(f"session limit reached ({self.config.max_sessions}); raise --max-sessions")
            cache_config = registration.cache_config(self.config, reg, policy, self.storage is not None)
            host_pages = registration.host_pages(self.config, reg) if ns is None else 0
            device = await registration.open_device(reg)
            dropped = 0
            try:
                if ns is None:
                    pool = await asyncio.get_running_loop().run_in_executor(
                        None, functools.partial(HostPool, reg.layout, host_pages,
                                                device=reg.device if reg.backend == "cuda" else None))
                    ns = Namespace(reg.namespace, reg.layout, reg.model_name, cache_config, pool, device, reg.backend,
                                   self.config.copy_workers, self.metrics, self.storage,
                                   self.config.storage_workers, self.config.storage_queue_pages,
                                   copy_delay=self.config.fault_copy_delay)
                    self.namespaces[reg.namespace] = ns
                    warm = False
                else:
                    dropped = await ns.attach(device, reg.backend)
                    warm = True
            except BaseException:
                device.close()
                raise
            session = self.sessions.new(ns, reg.engine)
            ns.session = session
        log_event(log, "session.registered", namespace=ns.name, session=session.id[:8],
                  engine=reg.engine, backend=reg.backend, device_pages=reg.num_device_pages,
                  host_pages=ns.host_pool.num_pages, warm=warm, dropped_tokens=dropped)
        return registration.Registered(session, warm, dropped)

    # -- sessions ----------------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        return self.sessions.get(session_id)

    @staticmethod
    def check_open(session: Session) -> None:
        if session.closing:
            raise precondition(f"session {session.id} closed while this call waited")

    async def close_session(self, session: Session, reason: str) -> None:
        """Finish the session's load-backs (after their copies), release its leases and
        detach it from its namespace. Idempotent; concurrent calls wait for the first."""
        if session.closing:
            await session.closed.wait()
            return
        session.closing = True
        ns = session.namespace
        try:
            for tid in ns.cache.pending_loads(session.id):
                await self.finish(ns, tid, None, missing_ok=True)
            for node in session.leases.values():
                ns.cache.unlock(node)
            session.leases.clear()
            session.lease_times.clear()
            session.unacked.clear()
            await ns.detach()
        finally:
            if ns.session is session:
                ns.session = None
            self.sessions.forget(session, reason)
            session.closed.set()
        log_event(log, "session.closed", namespace=ns.name, session=session.id[:8], reason=reason)

    def close_in_background(self, session: Session, reason: str) -> None:
        self.run_in_background(self.close_session(session, reason))

    # -- engine operations -------------------------------------------------------------

    async def match(self, session: Session, prompts: list[tuple[bytes, bytes]], lease: bool,
                    include_storage: bool = False):
        """Match every prompt; with `lease`, lock each matched path; with
        `include_storage`, also count the tokens past the cache that storage holds.
        Returns (MatchResult, lease id, storage tokens) per prompt. Validates all
        prompts first; the storage probe comes after the (atomic) match."""
        if len(prompts) > self.config.max_prompts_per_match:
            raise exhausted(f"{len(prompts)} prompts in one Match; the limit is {self.config.max_prompts_per_match}")
        for i, (tokens, _) in enumerate(prompts):
            if len(tokens) % 4:
                raise invalid(f"prompt {i}: token bytes ({len(tokens)}) are not a multiple of 4 (packed int32)")
        ns = session.namespace
        cache = ns.cache
        out = []
        for tokens, extra_key in prompts:
            result = cache.match(tokens, extra_key)
            lease_id = 0
            if lease and (result.device_tokens or result.host_tokens):
                cache.lock(result.host_node)
                lease_id = self.sessions.new_lease(session, result.host_node)
            out.append((result, lease_id))
        stored = [0] * len(prompts)
        if include_storage and ns.storage is not None:
            probes = [cache.storage_probe(tokens, extra_key)[1] for tokens, extra_key in prompts]
            pages = await ns.storage.probe(probes)
            stored = [n * ns.layout.page_size for n in pages]
            cache.counters.storage_hit_tokens += sum(stored)
        return [(r, lease_id, n) for (r, lease_id), n in zip(out, stored)]

    async def prefetch(self, session: Session, tokens: bytes, extra_key: bytes, policy: str,
                       timeout: float | None):
        """Fetch what storage holds of `tokens` past the cache into host memory. Yields
        progress: (state, transfer, storage tokens, FetchOutcome or None)."""
        ns = session.namespace
        if len(tokens) % 4:
            raise invalid(f"token bytes ({len(tokens)}) are not a multiple of 4 (packed int32)")
        if policy not in PREFETCH_POLICIES:
            raise invalid(f"prefetch policy {policy!r}: use one of {list(PREFETCH_POLICIES)}")
        if ns.storage is None:
            raise precondition("no storage tier is configured (start the daemon with --storage)")
        (pages,) = await ns.storage.probe([ns.cache.storage_probe(tokens, extra_key)[1]])
        self.check_open(session)
        transfer = ns.cache.start_prefetch(tokens, extra_key, pages, owner=session.id) if pages else 0
        if not transfer:
            yield "nothing", 0, 0, None
            return
        done = ns.fetch_done(transfer)  # before the first yield: the fetch may finish meanwhile
        yield "started", transfer, pages * ns.layout.page_size, None
        if policy == "best_effort":
            return
        try:
            outcome = await asyncio.wait_for(asyncio.shield(done), timeout if policy == "timeout" else None)
        except asyncio.TimeoutError:
            yield "waiting_ended", transfer, pages * ns.layout.page_size, None
            return
        yield "done", transfer, pages * ns.layout.page_size, outcome

    async def insert(self, session: Session, tokens: bytes, pages: bytes, extra_key: bytes,
                     chunked: bool, release_lease: int, lease: bool):
        ns = session.namespace
        while True:
            if release_lease and release_lease not in session.leases:
                raise not_found(_lease_unknown(session, release_lease))
            try:
                result = ns.cache.insert(tokens, pages, extra_key, chunked)
                break
            except NotReady as e:
                await ns.wait_copied(e.transfers)
                self.check_open(session)
        if release_lease:
            ns.cache.unlock(session.pop_lease(release_lease))
        lease_id = 0
        if lease:
            ns.cache.lock(result.node)
            lease_id = self.sessions.new_lease(session, result.node)
        return result, lease_id

    async def load_back(self, session: Session, node: int, pages: bytes) -> tuple[LoadBackResult, list[bytes]]:
        ns = session.namespace
        result = ns.cache.load_back(node, pages, owner=session.id)
        if result.transfer:
            session.unacked[result.transfer] = time.monotonic()
        events: list[bytes] = []
        if result.transfer and ns.backend == "cuda":
            events = await ns.engine.submitted(result.transfer)
        return result, events

    async def ack(self, session: Session, transfer: int):
        """Finish a load-back of this session once its copy completed."""
        session.unacked.pop(transfer, None)
        try:
            return await self.finish(session.namespace, transfer, session.id)
        except UnknownTransfer:
            why = session.expired.get(("load_back", transfer))
            if why is not None:
                raise not_found(f"transfer {transfer} {why}") from None
            raise

    async def finish(self, ns: Namespace, transfer: int, owner, missing_ok: bool = False):
        """Finish a load-back once its copies completed. With `missing_ok` (closing a
        session, expiring a load), one that an ack finished meanwhile is no error."""
        while True:
            try:
                return ns.cache.finish_load_back(transfer, owner=owner)
            except NotReady as e:
                await ns.wait_copied(e.transfers)
            except UnknownTransfer:
                if not missing_ok:
                    raise
                return None

    def release(self, session: Session, leases: list[int]) -> None:
        unknown = [lease for lease in leases if lease not in session.leases]
        if unknown:
            raise not_found("; ".join(_lease_unknown(session, lease) for lease in unknown))
        if len(set(leases)) != len(leases):
            raise invalid(f"leases {sorted(x for x in set(leases) if leases.count(x) > 1)} are listed twice")
        for lease in leases:
            session.namespace.cache.unlock(session.pop_lease(lease))

    async def evict(self, session: Session, num_pages: int) -> tuple[bytes, int]:
        return await session.namespace.evict(num_pages)

    # -- operators ---------------------------------------------------------------------

    def namespace(self, name: str) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            raise not_found(f"no namespace {name!r}; known: {sorted(self.namespaces)}")
        return ns

    def selected(self, name: str) -> list[Namespace]:
        return [self.namespace(name)] if name else list(self.namespaces.values())

    def check_invariants(self, name: str) -> list[tuple[str, str]]:
        out = []
        for ns in self.selected(name):
            out += [(ns.name, v) for v in ns.cache.check_invariants()]
            for session in self.sessions.all():
                if session.namespace is ns:
                    for lease, node in session.leases.items():
                        n = ns.cache.tree.nodes.get(node)
                        if n is None or (n.parent is not None and n.full.lock_ref <= 0):
                            out.append((ns.name, f"lease {lease} names node {node}, which is not locked"))
        if self.metrics is not None:
            for name, _ in out:
                self.metrics.invariant_violations.labels(name).inc()
        return out

    # -- shutdown ----------------------------------------------------------------------

    def stop_accepting(self) -> None:
        self.accepting = False
        self.stopping.set()

    async def drain(self) -> None:
        for ns in list(self.namespaces.values()):
            await ns.drain()

    async def close(self) -> None:
        """Close every session, then every namespace (device handles, pinned pool).
        Idempotent."""
        self.stop_accepting()
        await self.expiry.stop()
        for session in self.sessions.all():
            await self.close_session(session, "daemon shutting down")
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for ns in list(self.namespaces.values()):
            await ns.close()
        self.namespaces.clear()

    def uptime(self) -> float:
        return time.monotonic() - self.started


def _lease_unknown(session: Session, lease: int) -> str:
    why = session.expired.get(("lease", lease))
    if why is not None:
        return f"lease {lease} {why}"
    return f"lease {lease} is not held by this session (released, or never taken)"


__all__ = ["Daemon"]
