"""The Acks stream of one engine session.

One reader (this handler's coroutine), one task per ack (waiting for its copy, then
finishing the transfer on the core), one writer draining a queue of answers. When the
stream ends (engine half-close, cancellation, daemon shutdown) the session is closed
in the background, which finishes its remaining load-backs and releases its leases.

Clients open the stream right after Register with a message naming the session and
transfer 0 (acknowledges nothing), so an engine that dies is noticed at once: its
connection drops, the stream is cancelled and the session closed.

A session the daemon closes while its stream is open ends the stream once the acks in
hand are answered: with FAILED_PRECONDITION naming why when a Register with
replace_existing took its namespace, with OK after a Close call (the engine's own, or an
operator's). The engine learns at once that its session is gone, and a replaced engine
that hangs on holds no stream, tasks or RPC slot.

Memory stays bounded: at most `max_acks_in_flight` acks per stream are unanswered
(waiting for copies, or answers not yet written); past that the reader stops reading
and gRPC flow control holds the engine back.

A load-back the daemon finished itself (ack_timeout, see expiry.py) is told on the
stream at once, unasked (`expired`, `unsolicited`); its late ack gets the same answer,
with the failed copy's pages (the engine's again) in both. At most `max_acks_in_flight`
such pushes wait to be written: an engine that stopped reading learns of later expiries
from its acks' answers (a stuck engine's expiries queued a push each, without bound).
"""

import asyncio
import logging
from collections.abc import Callable

import grpc
from radixkv.v1 import radixkv_pb2 as pb

from ..core.errors import CacheError
from ..logs import log_event
from . import convert, reasons
from .daemon import Daemon
from .errors import ServiceError, SessionEnd, internal, status_of, unavailable
from .tenants import EVERYTHING, Grant

log = logging.getLogger("radixkv.acks")


class AckStream:
    def __init__(self, daemon: Daemon, context, grant: Callable[[], Grant] = lambda: EVERYTHING):
        self.daemon = daemon
        self.context = context
        self._grant = grant  # what the caller's token grants now (a reload may revoke it)
        self.session = None
        self.replies: asyncio.Queue = asyncio.Queue()
        self.acks: set[asyncio.Task] = set()
        self.slots = asyncio.Semaphore(daemon.config.max_acks_in_flight)
        self.ended = False
        self.unasked = 0  # pushes queued and not yet written (see `expired`)
        self._closed = SessionEnd()

    @property
    def grant(self) -> Grant:
        """What the caller's token grants, looked up for each message: a token the token
        file no longer holds is UNAUTHENTICATED at once, also on a stream opened before."""
        return self._grant()

    def session_closed(self, reason: str, code: grpc.StatusCode | None) -> None:
        """The daemon closed this stream's session (`Daemon._end_session`): end the
        stream once the acks in hand are answered, with `code` (`errors.session_end_code`)
        saying `reason`, or OK for None."""
        self._closed.say(self.session.id, reason, code)

    async def _told_to_end(self) -> None:
        """Returns once the daemon shuts down or closed the session."""
        waits = {asyncio.ensure_future(self.daemon.stopping.wait()), asyncio.ensure_future(self._closed.event.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def run(self) -> None:
        writer = asyncio.create_task(self._write())
        stopping = asyncio.create_task(self._told_to_end())
        reason = "ack stream ended"
        read = None
        ended_by_daemon = False  # its session closed, or the daemon shutting down
        try:
            while True:
                if not await self._room(stopping):
                    reason, ended_by_daemon = self._ending_reason(), True
                    break
                read = asyncio.create_task(self.context.read())
                done, _ = await asyncio.wait({read, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if read not in done:
                    read.cancel()
                    reason, ended_by_daemon = self._ending_reason(), True
                    break
                request = read.result()
                if request is grpc.aio.EOF:
                    break
                self._accept(request)
            if self.acks:
                await asyncio.gather(*self.acks)
            await self.replies.put(None)
            await writer
            if self._closed.status is not None:
                raise self._closed.status
            if ended_by_daemon and not self._closed:  # as the Session stream ends then
                raise unavailable("the daemon is shutting down: the ack stream ends", reasons.SHUTTING_DOWN)
        except asyncio.CancelledError:
            reason = "ack stream cancelled (engine gone?)"
            raise
        finally:
            self.ended = True
            for task in (stopping, read, writer):  # none left pending or unretrieved
                if task is not None and not task.done():
                    task.cancel()
                elif task is not None and not task.cancelled():
                    task.exception()
            if self.session is not None:
                if self.session.ack_stream is self:
                    self.session.ack_stream = None
                self.daemon.close_in_background(self.session, reason)

    def _ending_reason(self) -> str:
        return "its session was closed" if self._closed else "daemon shutting down"

    async def _room(self, stopping: asyncio.Task) -> bool:
        """Take a slot for the next ack (waiting while the stream is full); False when
        the daemon began shutting down (or closed the session) meanwhile."""
        if not self.slots.locked():
            await self.slots.acquire()
            return True
        acquire = asyncio.ensure_future(self.slots.acquire())
        await asyncio.wait({acquire, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if acquire.done():
            return True
        acquire.cancel()
        return False

    def _accept(self, request) -> None:
        """Start handling one ack. Raises ServiceError (ending the stream with that
        status) when the first message names no usable session, or one the caller's
        token may not act as (any message: a reload may revoke the token)."""
        if self.session is None:
            session = self.daemon.session(request.session)
            self.grant.check_session(session)
            if session.has_ack_stream:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"session {session.id} already has an ack stream", reasons.STREAM_EXISTS)
            session.has_ack_stream = True
            session.ack_stream = self
            self.session = session
        else:
            self.grant.check_session(self.session)
        if request.session and request.session != self.session.id:
            self.replies.put_nowait(pb.AckResponse(
                transfer=request.transfer, code=grpc.StatusCode.PERMISSION_DENIED.value[0],
                message=f"this ack stream belongs to session {self.session.id}"))
            return
        if not request.transfer:  # opens the stream; acknowledges nothing
            self.slots.release()
            return
        task = asyncio.create_task(self._ack(request.transfer))
        self.acks.add(task)
        task.add_done_callback(self.acks.discard)

    async def _ack(self, transfer: int) -> None:
        try:
            result = await self.session.namespace.ack(self.session, transfer)
        except (CacheError, ServiceError) as e:
            expired = self.session.expired_transfer(transfer)
            if expired is not None:
                self.replies.put_nowait(expired_response(transfer, expired, unsolicited=False))
                return
            refusal = status_of(e)
            self.replies.put_nowait(pb.AckResponse(transfer=transfer, code=refusal.code.value[0],
                                                   message=refusal.message))
            return
        except Exception as e:  # a bug: answer it rather than leave the engine waiting
            log.exception("internal error acknowledging transfer %s", transfer)
            refusal = internal("Acks", e)
            self.replies.put_nowait(pb.AckResponse(transfer=transfer, code=refusal.code.value[0],
                                                   message=refusal.message))
            return
        if result.error is not None:  # its copy's `copy.failed` line said why, at WARNING
            log_event(log, "load.failed", logging.DEBUG, session=self.session.id[:8],
                      transfer=transfer, reason=result.error)
        self.replies.put_nowait(convert.ack_response(transfer, result))

    def expired(self, transfer: int, outcome) -> None:
        """Tell the engine now that the daemon finished its `transfer` (expired; `outcome`:
        an expiry.ExpiredTransfer), unless `max_acks_in_flight` such pushes wait unwritten
        already (the transfer's ack gets the same answer)."""
        if not self.ended and self.unasked < self.daemon.config.max_acks_in_flight:
            self.unasked += 1
            self.replies.put_nowait(_Unasked(expired_response(transfer, outcome, unsolicited=True)))

    async def _write(self) -> None:
        while (reply := await self.replies.get()) is not None:
            unasked = isinstance(reply, _Unasked)  # answers no ack: holds no slot
            self.unasked -= unasked
            try:
                await self.context.write(reply.reply if unasked else reply)
            except Exception as e:  # the engine is gone (the stream ends with it)
                log_event(log, "acks.write_failed", logging.DEBUG, error=type(e).__name__)
                return
            if not unasked:
                self.slots.release()


class _Unasked:
    """A reply the daemon sends without an ack for it."""

    __slots__ = ("reply",)

    def __init__(self, reply):
        self.reply = reply


def expired_response(transfer: int, outcome, unsolicited: bool) -> pb.AckResponse:
    """The answer for a transfer the daemon finished at its ack_timeout (`outcome`: an
    expiry.ExpiredTransfer saying what became of it)."""
    return pb.AckResponse(transfer=transfer, code=grpc.StatusCode.NOT_FOUND.value[0],
                          message=f"transfer {transfer} {outcome.message}", load_failed=outcome.load_failed,
                          failed_pages=outcome.failed_pages, expired=True, unsolicited=unsolicited)
