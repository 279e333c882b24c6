"""The Session stream of one engine session: its calls (Match, LoadBack, Insert, Evict,
Release, Echo) as messages on one long-lived bidirectional stream.

One coroutine reads a request, answers it through `engine_ops` (the very functions the
unary handlers call) and writes the answer, then reads the next: answers come in
request order, each with its request's id. A call that fails is answered in-band with
its status (`errors.status_of`, the one mapping; INTERNAL for a bug, logged) and the
stream goes on. Bytes that do not parse end the stream with INVALID_ARGUMENT (the wire
guard, wire.py). The daemon's shutdown ends it with UNAVAILABLE once the call in hand is
answered.

The stream belongs to the session its first session-bound request names (checked like
a unary call: UNAUTHENTICATED for an unknown session, PERMISSION_DENIED for a namespace
the caller's token does not grant; until then each such request is answered with its
error and the stream stays unbound). A later request naming another session is
PERMISSION_DENIED; an empty `session` means the stream's. A session has one Session
stream at most. When the stream ends, however it ends, its session is closed in the
background, as when its Acks stream ends (load-backs finished, leases released). A
session the daemon closes while the stream is open ends it, once the call in hand is
answered: with FAILED_PRECONDITION naming why when it was replaced, with OK after a Close
call.
"""

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from radixkv.v1 import radixkv_pb2 as pb

from ..core.errors import CacheError
from ..logs import log_event
from . import engine_ops, reasons
from .daemon import Daemon
from .errors import ServiceError, SessionEnd, internal, precondition, status_of, unavailable
from .sessions import Session
from .tenants import EVERYTHING, Grant

log = logging.getLogger("radixkv.rpc")

# oneof field -> (engine operation, method name for logs and metrics)
CALLS = {
    "match": (engine_ops.match, "Match"),
    "load_back": (engine_ops.load_back, "LoadBack"),
    "insert": (engine_ops.insert, "Insert"),
    "evict": (engine_ops.evict, "Evict"),
    "release": (engine_ops.release, "Release"),
}


class SessionStream:
    def __init__(self, daemon: Daemon, context, grant: Callable[[], Grant] = lambda: EVERYTHING):
        self.daemon = daemon
        self.context = context
        self._grant = grant  # what the caller's token grants now (a reload may revoke it)
        self.session: Session | None = None
        self._reading = False
        self._stopping = False
        self._closed = SessionEnd()
        self._task: asyncio.Task | None = None
        self._metrics: dict = {}  # (method, code) -> (requests counter, duration histogram)

    @property
    def grant(self) -> Grant:
        """What the caller's token grants, looked up for each message: a token the token
        file no longer holds is UNAUTHENTICATED at once, also on a stream opened before."""
        return self._grant()

    def session_closed(self, reason: str, code: grpc.StatusCode | None) -> None:
        """The daemon closed this stream's session (`Daemon._end_session`): end the
        stream once the call in hand is answered, with `code` (`errors.session_end_code`)
        saying `reason`, or OK for None."""
        if self._closed.say(self.session.id, reason, code):
            self._stop()

    def _stop(self) -> None:
        """End the stream: a read in progress is interrupted, a call in hand answered first."""
        self._stopping = True
        if self._reading and self._task is not None:
            self._task.cancel()

    def _ending_reason(self) -> str:
        """Why the daemon ends the stream, for the log."""
        return "its session was closed" if self._closed else "daemon shutting down"

    def _raise_ending(self) -> None:
        """Raise the status the daemon ends the stream with, unless OK. No frame keeps the
        error as a local: its traceback holds the frames, and so the stream (a cycle only
        the cyclic collector would free, with the call's context)."""
        status = self._closed.status if self._closed else unavailable(
            "the daemon is shutting down: the session stream ends", reasons.SHUTTING_DOWN)
        if status is not None:
            try:
                raise status from None
            finally:
                del status

    async def run(self) -> None:
        """Answer requests until the engine half-closes (or the daemon stops, or closes
        the session)."""
        self._task = asyncio.current_task()
        watcher = asyncio.create_task(self._watch_shutdown())
        reason = "session stream ended"
        try:
            while not self._stopping:
                self._reading = True
                try:
                    request = await self.context.read()
                finally:
                    self._reading = False
                if request is grpc.aio.EOF:
                    return
                await self.context.write(await self.answer(request))
            reason = self._ending_reason()
            self._raise_ending()
        except asyncio.CancelledError:
            if not self._stopping:
                reason = "session stream cancelled (engine gone?)"
                raise
            asyncio.current_task().uncancel()  # our own cancel, of a read: end with a status
            reason = self._ending_reason()
            self._raise_ending()
        finally:
            self._task = None
            watcher.cancel()
            if self.session is not None:
                if self.session.session_stream is self:
                    self.session.session_stream = None
                self.daemon.close_in_background(self.session, reason)

    async def _watch_shutdown(self) -> None:
        """On shutdown, interrupt a read in progress (a call in hand is answered first)."""
        await self.daemon.stopping.wait()
        self._stop()

    async def answer(self, request: pb.SessionRequest) -> pb.SessionResponse:
        """The answer to one request: its response, or its status."""
        kind = request.WhichOneof("call")
        method = CALLS[kind][1] if kind in CALLS else "Echo"
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        refusal = None
        response = pb.SessionResponse(id=request.id)
        try:
            if kind is None:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "a SessionRequest must set one call")
            reply = getattr(response, kind)  # filled in place (engine_ops), not copied in
            reply.SetInParent()  # set even if the answer has no fields
            if kind == "echo":
                engine_ops.echo(request.echo, reply)
                return response
            call = getattr(request, kind)
            await CALLS[kind][0](self.daemon, self._session_for(call.session), call, reply)
            return response
        except (CacheError, ServiceError) as e:
            refusal = status_of(e)
            log_event(log, "rpc.refused", logging.DEBUG, method=f"Session.{method}", code=refusal.code.name,
                      message=refusal.message)
        except Exception as e:  # a bug: answer it, keep the stream
            log.exception("internal error in Session.%s", method)
            refusal = internal(method, e)
        finally:
            self._count(method, code if refusal is None else refusal.code, time.perf_counter() - start)
        error = response.error  # replaces a partial answer
        error.code, error.message, error.reason = refusal.code.value[0], refusal.message, refusal.reason
        error.metadata.update(refusal.metadata)
        return response

    def _count(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """Count and time one call as `Session.<method>` (the children cached per stream)."""
        self.daemon.last_call = time.monotonic()
        metrics = self.daemon.metrics
        if metrics is None:
            return
        children = self._metrics.get((method, code))
        if children is None:
            name = f"Session.{method}"
            children = self._metrics[(method, code)] = (metrics.rpc_requests.labels(name, code.name),
                                                         metrics.rpc_duration.labels(name))
        children[0].inc()
        children[1].observe(seconds)

    def _session_for(self, session_id: str) -> Session:
        """The stream's session (bound by the first request naming a usable one), live."""
        if self.session is None:
            session = self.daemon.session(session_id)
            self.grant.check_session(session)
            if session.session_stream is not None:
                raise precondition(f"session {session.id} already has a session stream", reasons.STREAM_EXISTS)
            session.session_stream = self
            self.session = session
            return session
        if session_id and session_id != self.session.id:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               f"this session stream belongs to session {self.session.id}", reasons.OTHER_SESSION)
        session = self.daemon.session(self.session.id)  # UNAUTHENTICATED once it closed
        if not self.grant.everything:
            self.grant.check_session(session)
        return session


__all__ = ["CALLS", "SessionStream"]
