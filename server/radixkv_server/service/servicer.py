"""The gRPC servicer: validate, convert, call (the daemon for registration and sessions,
the session's namespace for engine operations), convert back. Nothing else.

Caller errors become status codes through `errors.status_of` (one place); anything
else is a bug, logged with its traceback and answered INTERNAL. What the caller's token
grants (tenants.py) is checked before every handler.
"""

import asyncio
import dataclasses
import functools
import logging
import time

import grpc
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

from .. import __version__
from ..core.errors import CacheError
from ..logs import log_event
from . import convert, engine_ops, reasons
from .acks import AckStream
from .daemon import Daemon
from .errors import ServiceError, internal, invalid, precondition, status_of, unauthenticated
from .inspection import inspect_namespace, namespace_stats
from .session_stream import SessionStream
from .tenants import EVERYTHING, Grant, Tokens, authorize, visible
from .watch import watch
from .wire import end_call

log = logging.getLogger("radixkv.rpc")


CLOSED_BY_CALL = "closed by a Close call"  # the engine's own, or an operator's: the daemon cannot tell
STREAMS = frozenset({"Acks", "Session", "WatchEvents"})  # live as long as an engine or watcher
REFUSAL_SAID_EVERY_S = 60.0  # a refused Register, per namespace and status, at WARNING


def rpc(method):
    """Map caller errors to statuses; log and hide anything unexpected; count and time
    every call by method and status code (not the long-lived STREAMS: their duration is
    an engine's lifetime, and each engine's exit would count as a cancelled call)."""
    name = method.__name__
    counted = name not in STREAMS

    @functools.wraps(method)
    async def handler(self, request, context):
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if self.tokens.scoped:
                authorize(self.grant(context), self.daemon.sessions, name, request)
            return await method(self, request, context)
        except (CacheError, ServiceError) as e:
            refusal = status_of(e)
            code = refusal.code
            if name == "Register":  # an engine left without its cache: the operator's business
                self.refused_register(request.namespace, code, refusal.message)
            else:
                log_event(log, "rpc.refused", logging.DEBUG, method=name, code=code.name, message=refusal.message)
            await end_call(context, refusal, name)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            raise
        except grpc.aio.InternalError as e:
            # ExecuteBatchError: a write of a call that already ended, its caller gone or
            # the server stopping (statuses go through `end_call`). It ends as cancelled.
            code = grpc.StatusCode.CANCELLED
            log_event(log, "rpc.gone", logging.DEBUG, method=name, error=str(e) or type(e).__name__)
            raise asyncio.CancelledError(f"{name}: the call ended before its answer was sent") from e
        except Exception as e:
            log.exception("internal error in %s", name)
            refusal = internal(name, e)
            code = refusal.code
            await end_call(context, refusal, name)
        finally:
            self.daemon.last_call = now = time.monotonic()
            if counted and (session := self.daemon.sessions.peek(getattr(request, "session", ""))) is not None:
                session.last_call = now  # a call longer than --idle-session-timeout keeps it too
            metrics = self.daemon.metrics
            if metrics is not None and counted:
                metrics.rpc_done(name, code.name, time.perf_counter() - start)

    return handler


class RadixKVServicer(pb_grpc.RadixKVServicer):
    """Each engine RPC: find the session (UNAUTHENTICATED if gone), then `engine_ops`
    (convert the request, call the session's namespace, convert the answer)."""

    def __init__(self, daemon: Daemon, tokens: Tokens | None = None):
        self.daemon = daemon
        self.tokens = tokens if tokens is not None else Tokens()
        self._register_refusals: dict[tuple, float] = {}  # (namespace, code) -> when last said

    def refused_register(self, namespace: str, code: grpc.StatusCode, message: str) -> None:
        """A refused Register leaves an engine without its cache (a host memory budget
        reached, a namespace another engine holds): said at WARNING, at most once a
        minute per namespace and status (an engine retrying with backoff asks again
        every few seconds); the others at DEBUG, as other refused calls are."""
        now, key = time.monotonic(), (namespace, code)
        if len(self._register_refusals) > 4096:  # names callers made up: forget them all
            self._register_refusals.clear()
        said = now - self._register_refusals.get(key, -REFUSAL_SAID_EVERY_S) >= REFUSAL_SAID_EVERY_S
        if said:
            self._register_refusals[key] = now
        log_event(log, "register.refused", logging.WARNING if said else logging.DEBUG, namespace=namespace,
                  code=code.name, message=message)

    def grant(self, context) -> Grant:
        """What the caller's token grants, looked up now (a reload may have removed it:
        UNAUTHENTICATED); every namespace when no token is needed."""
        if not self.tokens.required:
            return EVERYTHING
        grant = self.tokens.grant(context.invocation_metadata())
        if grant is None:  # the token file was reloaded since the call was admitted
            raise unauthenticated("missing or wrong token: send 'authorization: Bearer <token>' metadata",
                                  reasons.TOKEN_REJECTED)
        return grant

    @rpc
    async def Register(self, request, context):
        reg = convert.registration(request, self.daemon.config.page_size)
        grant = self.grant(context)
        done = await self.daemon.register(dataclasses.replace(
            reg, segment_uid=grant.segment_uid, owner=grant.owner, token=grant.token,
            quota=grant.quota, operator=grant.everything,
            sees=None if grant.everything else grant.allows))
        try:
            return self._registered(done)
        except BaseException:  # the engine never learns the session: it must not stay live
            self.daemon.close_in_background(done.session, "its Register was not answered")
            raise

    def _registered(self, done) -> pb.RegisterResponse:
        ns, config = done.session.namespace, self.daemon.config
        return pb.RegisterResponse(
            session=done.session.id, host_pool_pages=ns.host_pool.num_pages,
            write_policy=ns.config.cache.write_policy.value, warm=done.warm,
            dropped_device_tokens=done.dropped_device_tokens, daemon_instance=self.daemon.instance,
            storage=self.daemon.storage.kind if self.daemon.storage is not None else "",
            max_prompts_per_match=config.max_prompts_per_match, lease_timeout_ms=round(config.lease_timeout * 1000),
            ack_timeout_ms=round(config.ack_timeout * 1000),
            idle_session_timeout_ms=round(config.idle_session_timeout * 1000), device_uuid=ns.device_uuid(done.session),
            ranks_missing=ns.group.missing() if ns.group is not None else [],
            max_message_bytes=config.max_message_size, max_leases_per_session=config.max_leases_per_session)

    @rpc
    async def Close(self, request, context):
        """Answers once the session is closed (its copies over), also when it was closing
        already (its stream ended); at once for one closed before or unknown: idempotent."""
        session = self.daemon.sessions.find(request.session)
        if session is not None:
            await self.daemon.close_session(session, CLOSED_BY_CALL, by_close=True)
        return pb.CloseResponse()

    @rpc
    async def Match(self, request, context):
        return await engine_ops.match(self.daemon, self.daemon.session(request.session), request)

    @rpc
    async def Insert(self, request, context):
        return await engine_ops.insert(self.daemon, self.daemon.session(request.session), request)

    @rpc
    async def LoadBack(self, request, context):
        return await engine_ops.load_back(self.daemon, self.daemon.session(request.session), request)

    @rpc
    async def Release(self, request, context):
        return await engine_ops.release(self.daemon, self.daemon.session(request.session), request)

    @rpc
    async def Evict(self, request, context):
        return await engine_ops.evict(self.daemon, self.daemon.session(request.session), request)

    @rpc
    async def Prefetch(self, request, context):
        """Stream prefetch progress (see the proto); errors abort the stream with a status."""
        session = self.daemon.session(request.session)
        prefetch = convert.prefetch_request(request, self.daemon.config.max_extra_key_bytes)
        async for step in session.namespace.prefetch(session, prefetch):
            await context.write(convert.prefetch_progress(step))

    @rpc
    async def Stats(self, request, context):
        """The namespaces the caller may see, with what their sessions hold."""
        grant = self.grant(context)
        sessions = self.daemon.sessions.all()
        return pb.StatsResponse(
            namespaces=[self._stats(ns, grant) for ns in visible(grant, self.daemon.namespaces, request.namespace)],
            sessions=sum(1 for s in sessions if grant.allows(s.namespace.name)), version=__version__,
            uptime_seconds=self.daemon.uptime(), daemon_instance=self.daemon.instance)

    def _stats(self, ns, grant: Grant) -> pb.NamespaceStats:
        stats = namespace_stats(ns)
        attached = {s.namespace.name for s in self.daemon.sessions.all()}
        stats.detached_seconds = self.daemon.detached.seconds(ns.name, attached, time.monotonic()) or 0.0
        held = self.daemon.sessions.holdings(ns)
        stats.leases, stats.oldest_lease_seconds = held.leases, held.oldest_lease_seconds
        stats.load_backs_unacked = held.unacked_loads
        stats.tenant = self.tokens.tenant(grant, ns.owner)
        now = time.monotonic()
        stats.sessions.extend(
            pb.SessionInfo(session=grant.shows(s), engine=s.engine, role=s.role, tp_rank=s.rank, instance=s.instance,
                           age_seconds=now - s.created,
                           streams_open=s.ack_stream is not None or s.session_stream is not None,
                           leases=len(s.leases), load_backs_unacked=len(s.unacked),
                           tenant=self.tokens.tenant(grant, s.owner))
            for s in sorted(self.daemon.sessions.all(), key=lambda s: s.created) if s.namespace is ns)
        return stats

    @rpc
    async def Inspect(self, request, context):
        if not request.namespace:
            raise invalid("namespace is required")
        [ns] = visible(self.grant(context), self.daemon.namespaces, request.namespace)
        return inspect_namespace(ns, request.max_nodes or 100)

    @rpc
    async def CheckInvariants(self, request, context):
        namespaces = visible(self.grant(context), self.daemon.namespaces, request.namespace)
        violations = [v for ns in namespaces for v in self.daemon.check_invariants(ns.name)]
        for v in violations:
            log_event(log, "invariant.violated", logging.ERROR, namespace=v.namespace, violation=v.message)
        return pb.CheckInvariantsResponse(
            violations=[pb.Violation(namespace=v.namespace, message=v.message) for v in violations],
            namespaces_checked=len(namespaces))

    @rpc
    async def DropNamespace(self, request, context):
        if not request.namespace:
            raise invalid("DropNamespace needs the namespace to drop")
        grant = self.grant(context)
        visible(grant, self.daemon.namespaces, request.namespace)  # NOT_FOUND naming only what it may see
        if not grant.everything and self.tokens.granted_to_others(grant, request.namespace):
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               f"namespace {request.namespace} is granted to other tokens too: dropping it would "
                               "lose their warm host tier; only an operator's token (one granting every "
                               "namespace) may drop it", reasons.NAMESPACE_SHARED)
        if request.store and self.daemon.storage is None:
            raise precondition(reason=reasons.NO_STORAGE, message="DropNamespace with store: no storage tier is "
                               "configured (start the daemon with "
                               "--storage), so nothing would keep the host copies; drop without store to lose them")
        d = await self.daemon.drop_namespace(request.namespace, request.store)
        return pb.DropNamespaceResponse(host_tokens=d.host_tokens, freed_host_bytes=d.freed_host_bytes,
                                        stored_tokens=d.stored_tokens)

    @rpc
    async def WatchEvents(self, request, context):
        """Stream KV event batches (see the proto and watch.py); errors end it with a status,
        as a token that a reload of the token file revoked (or no longer grants the namespace)."""
        async for batch in watch(self.daemon, request):
            if self.tokens.required:
                authorize(self.grant(context), self.daemon.sessions, "WatchEvents", request)
            await context.write(batch)

    @rpc
    async def Echo(self, request, context):
        return engine_ops.echo(request)

    @rpc
    async def Acks(self, request_iterator, context):
        """Read acks until the engine half-closes (or the daemon stops); answer each
        once its transfer is finished, in completion order. The session closes when
        the stream ends, however it ends."""
        await AckStream(self.daemon, context, lambda: self.grant(context)).run()

    @rpc
    async def Session(self, request_iterator, context):
        """Answer the session's calls sent as messages, in order (session_stream.py). The
        session closes when the stream ends, however it ends."""
        await SessionStream(self.daemon, context, lambda: self.grant(context)).run()


