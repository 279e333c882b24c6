"""The daemon's registry and lifecycle: which namespaces and sessions exist, registering
an engine, closing a session, shutting down. Engine operations belong to the session's
`Namespace`; the servicer finds it here (`session(id).namespace`).

The event loop owns everything. A change of a namespace (a Register, a drop) awaits
I/O holding that namespace's lock only (namespace_locks.py).
"""

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

from ..config import DaemonConfig
from ..core.errors import CacheError
from ..logs import log_event
from . import admission, engine_registration, host_budget, rank_registration, reasons, registration
from .errors import ServiceError, not_found, precondition, REPLACED, session_end_code, unavailable
from .expiry import Expiry
from .idle_checks import IdleChecks
from .namespace import Namespace
from . import namespace_reclaim
from .namespace_locks import NamespaceLocks
from .sessions import Session, SessionRegistry
from .shutdown_store import store_host_copies
from .watch import BatchMessages

log = logging.getLogger("radixkv.daemon")


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant of a namespace (CheckInvariants)."""

    namespace: str
    message: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """What DropNamespace removed: the host tier's tokens, the host pool's bytes, and
    the tokens stored first (when asked)."""

    host_tokens: int
    freed_host_bytes: int
    stored_tokens: int


class Daemon:
    def __init__(self, config: DaemonConfig, metrics=None, storage=None, events=None,
                 host_memory: tuple[int, str] | None = None):
        """`host_memory`: the host memory budget and its source, as the start worked it
        out and logged it (host_budget.host_memory_limit); None reads it here."""
        self.config = config
        self.metrics = metrics
        self.storage = storage  # StorageBackend shared by every namespace, or None
        self.events = events    # events.EventHub (KV events for routers), or None: off
        self.instance = uuid.uuid4().hex[:12]
        self.watch_messages = BatchMessages(self.instance)  # WatchEvents' messages, made once per batch
        self.started = time.monotonic()
        self.namespaces: dict[str, Namespace] = {}
        self.detached = namespace_reclaim.DetachedSince()  # when each namespace's engines left (namespace_reclaim.py)
        self.sessions = SessionRegistry(max_leases=config.max_leases_per_session)
        self.accepting = True
        self.storage_answered: bool | None = None  # the start's storage check (storage_check.py)
        self.stopping = asyncio.Event()
        self.locks = NamespaceLocks()  # a change of a namespace awaits I/O: one at a time per namespace
        self._background: set[asyncio.Task] = set()
        self.expiry = Expiry(self)
        self.idle_checks = IdleChecks(self)
        self.last_call = time.monotonic()  # when an engine call was last answered (idle_checks)
        self.host_memory_limit, self.host_memory_source = \
            host_memory or host_budget.host_memory_limit(config.max_host_memory)

    def start(self) -> None:
        """Start background duties (expiring what a stuck engine holds, invariant checks
        when idle). Call on the loop."""
        self.expiry.start()
        self.idle_checks.start()

    def run_in_background(self, coro) -> asyncio.Task:
        """Run `coro` as a task that `close` waits for; returns it. Its failure is logged
        (whoever awaited it may have stopped waiting)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._finished_in_background)
        return task

    def _finished_in_background(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and isinstance(task.exception(), Exception) \
                and not isinstance(task.exception(), (ServiceError, CacheError)):
            log.error("background task %s failed", task.get_coro().__qualname__, exc_info=task.exception())

    # -- registration ------------------------------------------------------------------

    async def register(self, reg: registration.Registration) -> registration.Registered:
        """Attach an engine. Validates everything, then opens its device buffers and
        creates (or re-attaches) the namespace. Errors change nothing."""
        if not self.accepting:
            raise unavailable("the daemon is shutting down; register with its successor", reasons.SHUTTING_DOWN)
        registration.validate(reg)
        if reg.engine_managed:  # shared by many sessions: see engine_registration
            async with self.locks.hold(reg.namespace):
                return await engine_registration.register(self, reg)
        await self._closes_ended(reg.namespace)  # its engine went: taken once the close ends
        if reg.tp_size > 1:  # one namespace, a session per rank: see rank_registration
            return await self._register_rank(reg)
        async with self.locks.hold(reg.namespace):
            ns = self.namespaces.get(reg.namespace)
            replacing = ns is not None and self._check_free(ns, reg)
            ns_config = await admission.admit(self, reg, ns, replacing)
            device = await registration.open_device(reg)  # before the live session goes: errors change nothing
            try:
                if replacing and ns.session is not None:
                    await self.close_session(ns.session, REPLACED, replaced=True)
                if ns is None:
                    ns = self.add_namespace(await Namespace.open(
                        ns_config, device, metrics=self.metrics, storage=self.storage), reg)
                    warm, dropped = False, 0
                else:
                    warm, dropped = True, await ns.attach(device)
            except BaseException:
                device.close()
                raise
            session = self.new_session(ns, reg)
            ns.session = session
            ns.page_geometry = ns.page_geometry or registration.page_geometry(reg)
        log_event(log, "session.registered", namespace=ns.name, session=session.id[:8],
                  engine=reg.engine, backend=reg.backend, device_pages=reg.num_device_pages,
                  host_pages=ns.host_pool.num_pages, warm=warm, dropped_tokens=dropped)
        return registration.Registered(session, warm, dropped)

    async def _register_rank(self, reg: registration.Registration) -> registration.Registered:
        """A tensor-parallel rank's Register, run to its end under its namespace's lock
        whoever waits: cut part-way, its join went on without the lock. A session made
        for a caller that left is closed (it never learns its id), with its group. Then,
        when asked, waits (without the lock) for the group to form."""
        async def locked():
            async with self.locks.hold(reg.namespace):
                return await rank_registration.register(self, reg)

        task = self.run_in_background(locked())
        try:
            done = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._close_unanswered)
            raise
        return await rank_registration.wait_for_ranks(self, done, reg.wait_for_ranks) if reg.wait_for_ranks else done

    def _close_unanswered(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            self.close_in_background(task.result().session, "its Register's caller left before the answer")

    def _check_free(self, ns: Namespace, reg: registration.Registration) -> bool:
        """Whether `reg` may take the existing namespace `ns`: compatible, and free or
        asked to replace its live session (FAILED_PRECONDITION otherwise). Returns
        whether a live session is to be replaced."""
        registration.check_compatible(ns, reg, reg.write_policy or ns.config.cache.write_policy.value)
        if ns.session is None:
            return False
        if ns.session.closing:  # began after `_closes_ended` looked
            raise unavailable(f"namespace {reg.namespace}'s session is closing (its engine went); register again",
                              reasons.NAMESPACE_BUSY)
        if not reg.replace_existing:
            raise precondition(
                reason=reasons.NAMESPACE_ATTACHED, message=f"namespace {reg.namespace} is attached to a live session (engine "
                f"{ns.session.engine or 'unnamed'}); after an engine restart pass replace_existing")
        registration.check_may_replace(reg, [ns.session])
        return True

    def add_namespace(self, ns, reg: registration.Registration):
        """Enter the namespace `reg` created (managed or engine-managed) in the registry;
        its residency changes are reported as KV events from now on (when they are on).
        With storage on and no `model` in `reg`, a warning: its keys are salted by the
        namespace's name, so every engine of that name on any daemon sharing the store
        is served this one's KV, whatever weights it runs. Returns `ns`."""
        if self.storage is not None and not reg.model:
            log_event(log, "namespace.no_model", logging.WARNING, namespace=ns.name,
                      note="its storage keys are salted by the namespace name alone: any engine registering "
                      "that name on a daemon sharing this store is served its KV, whatever its weights; pass "
                      "model= (the weights' id, revision, quantization)")
        self.namespaces[ns.name] = ns
        ns.owner = reg.owner
        self.locks.pool_entered(ns.name)
        if self.metrics is not None:
            self.metrics.add_namespace(ns.name)
        if self.events is not None:
            ns.report_to(self.events)
        return ns

    async def drop_namespace(self, name: str, store: bool = False) -> Dropped:
        """Forget namespace `name`, which no session may be attached to: with `store`,
        its host copies that storage lacks are stored first (shutdown_store.py); then it
        closes (host pool freed, routers told it is cleared). Registrations wait
        meanwhile. Runs to its end whoever stops waiting (cut part-way, the namespace
        left the registry with its pool never freed). NOT_FOUND, FAILED_PRECONDITION (a
        session attached), UNAVAILABLE (shutting down)."""
        return await asyncio.shield(self.run_in_background(self._drop_namespace(name, store)))

    async def _drop_namespace(self, name: str, store: bool) -> Dropped:
        await self._closes_ended(name)  # their engines went: dropped once the closes end
        async with self.locks.hold(name):
            if not self.accepting:
                raise unavailable("the daemon is shutting down", reasons.SHUTTING_DOWN)
            ns = self.namespace(name)
            attached = [s for s in self.sessions.all() if s.namespace is ns]
            if attached:
                engines = ", ".join(sorted({s.engine or "unnamed" for s in attached}))
                raise precondition(reason=reasons.NAMESPACE_ATTACHED,
                                   message=f"namespace {name} has {len(attached)} live session(s) (engines: {engines}); "
                                   "stop those engines (or close their sessions) first")
            dropped = await self.forget_namespace(ns, store)
        log_event(log, "namespace.dropped", namespace=name, host_tokens=dropped.host_tokens,
                  freed_host_bytes=dropped.freed_host_bytes, stored_tokens=dropped.stored_tokens)
        return dropped

    async def forget_namespace(self, ns: Namespace, store: bool) -> Dropped:
        """Drop `ns`, which no session is attached to (its lock held): with `store`, its
        host copies storage lacks are stored first. Its pool counts against the host
        memory budget until it is freed."""
        stored = 0
        if store and self.config.shutdown_store_timeout > 0:
            stored = await store_host_copies(ns.core, time.monotonic() + self.config.shutdown_store_timeout,
                                             event="namespace")
        page_size = ns.config.layout.page_size
        dropped = Dropped(ns.cache.host.num_used * page_size, ns.host_pool.nbytes, stored * page_size)
        del self.namespaces[ns.name]
        self.locks.reserve(ns.name, host_bytes=ns.host_pool.nbytes, owner=ns.owner)  # until the lock's block ends
        self.detached.forget(ns.name)
        await ns.close()
        if self.metrics is not None:
            self.metrics.forget_namespace(ns.name)
        return dropped

    # -- sessions ----------------------------------------------------------------------

    def new_session(self, ns, reg: registration.Registration) -> Session:
        """The session of the Register `reg` that `admit` let into `ns`."""
        session = self.sessions.new(ns, reg.engine, reg.owner, reg.token)
        self.locks.session_made(ns.name)
        return session

    def session(self, session_id: str) -> Session:
        """The live session with this id; UNAUTHENTICATED saying why otherwise."""
        return self.sessions.get(session_id)

    async def close_session(self, session: Session, reason: str, *, by_close: bool = False,
                            replaced: bool = False) -> None:
        """End the session in its namespace (load-backs finished after their copies,
        leases released, device buffers closed) and forget it. The close is a task the
        daemon owns, run to its end whoever stops waiting (a Close past its deadline, a
        replacing Register cancelled): cut part-way, it left the session forgotten with
        its load-backs, pins and device buffers held, and answered a retried Close while
        a copy still wrote the engine's pages. Idempotent; concurrent calls wait for the
        first's task. Streams of the session still open end once it closed: with OK
        after a Close call (`by_close`: the engine's own, most likely, or an operator's;
        either way the engine knows or can read that it was closed), FAILED_PRECONDITION
        when another engine's Register took its place (`replaced`: the engine must not take
        it back), else ABORTED naming `reason` (register again)."""
        if session.closer is None:
            session.closer = self.run_in_background(self._end_session(session, reason, by_close, replaced))
        await self.closed(session)

    @staticmethod
    async def closed(session: Session) -> None:
        """Wait until a closing session's close ended (at once for one not closing).
        Raises what the close raised (logged by `run_in_background` as well)."""
        if session.closer is not None:
            await asyncio.shield(session.closer)

    async def _closes_ended(self, name: str) -> None:
        """Wait, holding no lock (a close waits for its copies: other namespaces'
        Registers must not), until no session of namespace `name` is closing."""
        while closing := [s for s in self.sessions.all() if s.namespace.name == name and s.closing]:
            for session in closing:
                with contextlib.suppress(Exception):  # a failed close was logged; the session is gone
                    await self.closed(session)

    async def _end_session(self, session: Session, reason: str, by_close: bool = False,
                           replaced: bool = False) -> None:
        ns = session.namespace
        for other in ns.partners(session):  # the other ranks of a tensor-parallel engine end with it,
            self.close_in_background(other, f"rank {session.rank} of its engine's tensor-parallel group "
                                            f"was closed ({reason})", replaced)  # closing from now: no call is taken
        try:
            await ns.end_session(session)
        except Exception as e:  # a bug: what it held may be held still (CheckInvariants says what)
            log_event(log, "session.close_failed", logging.ERROR, namespace=ns.name, session=session.id[:8],
                      reason=reason, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            if ns.session is session:
                ns.session = None
            self.sessions.forget(session, reason)
            if not any(s.namespace is ns for s in self.sessions.all()):
                self.detached.mark(ns.name, time.monotonic())
            for stream in (session.ack_stream, session.session_stream):  # still open: a replaced
                if stream is not None and self.accepting:  # engine's, or a Close from another client
                    stream.session_closed(reason, session_end_code(by_close, replaced))  # (a shutdown: its own)
        log_event(log, "session.closed", namespace=ns.name, session=session.id[:8], reason=reason)

    def close_in_background(self, session: Session, reason: str, replaced: bool = False) -> None:
        """`close_session` without waiting; the session counts as closing at once (a
        stream opened meanwhile is refused, not bound to a session about to close)."""
        if session.closer is None:
            session.closer = self.run_in_background(self._end_session(session, reason, replaced=replaced))

    def close_revoked(self, allows) -> None:
        """Close every session whose token no longer grants its namespace (`allows(token,
        namespace)`, after a token file reload): an engine with nothing to send would
        otherwise keep its session, leases and mappings, its token checked only on its
        next message. Its streams end ABORTED; registering again is UNAUTHENTICATED."""
        for session in self.sessions.all():
            if not session.closing and not allows(session.token, session.namespace.name):
                self.close_in_background(session, "its token no longer grants the namespace (token file reloaded)")

    # -- operators ---------------------------------------------------------------------

    def namespace(self, name: str) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            raise not_found(f"no namespace {name!r}", reasons.NAMESPACE_UNKNOWN, namespace=name)
        return ns

    def selected(self, name: str) -> list[Namespace]:
        """The named namespace ("": every one); NOT_FOUND for an unknown name."""
        return [self.namespace(name)] if name else list(self.namespaces.values())

    def check_invariants(self, name: str) -> list[Violation]:
        """The violations of the selected namespaces, each counted in the metrics."""
        out = [Violation(ns.name, v) for ns in self.selected(name) for v in ns.check_invariants()]
        if self.metrics is not None:
            for v in out:
                self.metrics.invariant_violations.labels(v.namespace).inc()
        return out

    # -- shutdown ----------------------------------------------------------------------

    def stop_accepting(self) -> None:
        self.accepting = False
        self.stopping.set()

    async def drain(self) -> None:
        for ns in list(self.namespaces.values()):
            await ns.drain()

    async def close(self) -> None:
        """Close every session, store what only the host tier holds (shutdown_store.py,
        for up to `shutdown_store_timeout` seconds), then close every namespace (device
        handles, pinned pool). Idempotent."""
        self.stop_accepting()
        await self.expiry.stop()
        await self.idle_checks.stop()
        for session in self.sessions.all():
            await self.close_session(session, "daemon shutting down")
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.config.shutdown_store_timeout > 0:
            deadline = time.monotonic() + self.config.shutdown_store_timeout
            for ns in list(self.namespaces.values()):
                await store_host_copies(ns.core, deadline)
        for ns in list(self.namespaces.values()):
            await ns.close()  # KV-event subscribers forget what it held
        self.namespaces.clear()

    def uptime(self) -> float:
        return time.monotonic() - self.started


__all__ = ["Daemon", "Dropped", "Violation"]
