"""The Session stream: an engine's Match, LoadBack, Insert, Evict and Release (and Echo)
sent as messages on one long-lived stream per session instead of a unary RPC each
(`Client(..., stream=True)`, `AsyncClient(..., stream=True)`); the unary RPCs stay the
default (grpcurl, engines that want them).

The requests are the session's plans' (`radixkv.session`, built once by
`radixkv.messages`): the plan marks a call `on_stream` and the shell hands it here.
`CallLedger` is what both shells share, without I/O: request ids, wrapping a request
into a `SessionRequest`, unwrapping an answer into the response message or the typed
error of its in-band status, and why the stream ended. `CallStream` (blocking; a reader
thread) and `AsyncCallStream` (asyncio; callers read their own answers) do the I/O.

Any number of calls may be in flight (pipelined); the daemon answers them in order.
Once the stream ended (daemon gone or shutting down, session closed, client closed)
every unanswered call and every later one fails with Unavailable saying why, and
`on_broken(reason, code)` tells the session, whose recovery probes it and registers again (a
new registration opens a new stream). The daemon closes the session when its stream
ends, as it does when its ack stream ends. A call not answered within its timeout
raises DeadlineExceeded: on `CallStream` its late answer is dropped and the stream goes
on (but the session ends when the call moves pages or leases: `radixkv.session`); on
`AsyncCallStream` the stream ends with it (see there).
"""

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from radixkv.v1 import radixkv_pb2 as pb

from .errors import (
    DeadlineExceeded, RadixKVError, Unavailable, Unimplemented, code_from_int, error_for, from_rpc_error,
)
from .plans import Plan, Rpc

# RadixKV method -> its field of the SessionRequest / SessionResponse oneofs
STREAM_METHODS = {"Match": "match", "LoadBack": "load_back", "Insert": "insert", "Evict": "evict",
                  "Release": "release", "Echo": "echo"}
_CLOSE = object()
STATUS_WAIT_S = 1.0  # how long an ended stream's status may take to come (AsyncCallStream)
RECHECK_PAUSE_S = 0.05  # before a register checks the Session stream again on a fresh one


def stream_end_reason(error: BaseException | None) -> str:
    """Why a reader saw the session stream end (`error` None: the daemon ended it)."""
    if error is None:
        return "the daemon ended the session stream"
    if isinstance(error, grpc.RpcError):
        return f"the session stream broke: {from_rpc_error(error)}"
    return f"the session stream ended: {type(error).__name__} {error}".rstrip()


class CallLedger:
    """Ids and (un)wrapping for one session stream; not thread-safe by itself."""

    def __init__(self):
        self._ids = itertools.count(1)
        self.ended: str | None = None
        self.code: grpc.StatusCode | None = None  # the stream's status, when it ended with one known
        self.unsupported = False  # the daemon has no Session stream (UNIMPLEMENTED)

    def request(self, method: str, request) -> tuple[int, pb.SessionRequest]:
        """(id, the message carrying `request`); Unavailable once the stream ended."""
        if self.ended is not None:
            raise self.broken()
        rid = next(self._ids)
        return rid, pb.SessionRequest(id=rid, **{STREAM_METHODS[method]: request})

    @staticmethod
    def result(response: pb.SessionResponse):
        """The response message, or the RadixKVError of the call's in-band status."""
        kind = response.WhichOneof("result")
        if kind == "error":
            error = response.error
            return error_for(code_from_int(error.code), error.message, error.reason, dict(error.metadata))
        if kind is None:
            return RadixKVError(f"the daemon answered call {response.id} with nothing")
        return getattr(response, kind)

    def end(self, reason: str, code: grpc.StatusCode | None = None) -> bool:
        """No more answers will come (`code`: the stream's status, when known); the first
        reason stays. True if this call ended it (and the session should be told: not when
        the daemon has no Session stream at all, which says nothing of the session)."""
        if self.ended is not None:
            return False
        self.ended, self.code = reason, code
        self.unsupported = code == grpc.StatusCode.UNIMPLEMENTED
        return not self.unsupported

    def broken(self) -> RadixKVError:
        if self.unsupported:
            return Unimplemented("the daemon has no Session stream: it is older than this client. Upgrade the "
                                 f"daemon, or make the client with stream=False ({self.ended})")
        return Unavailable(f"no answer on the session stream: {self.ended}")


def check_served(session: str, timeout: float | None) -> Plan[None]:
    """One Echo on a new session's stream: a daemon older than the Session stream answers
    it UNIMPLEMENTED, and every call on it would fail (each taken for a lost session and
    registered again, in a loop). Then `session` is closed and Unimplemented raised,
    saying what to do."""
    try:
        yield Rpc("Echo", pb.EchoRequest(), timeout, on_stream=True)
    except Unimplemented:
        try:
            yield Rpc("Close", pb.CloseRequest(session=session), timeout)
        except RadixKVError:
            pass  # the session was the daemon's to close: it goes with the client's streams
        raise


class CallStream:
    """The blocking client's session stream. Thread-safe: calls may come from any thread."""

    def __init__(self, stub, session: str, *, close_timeout: float = 30.0,
                 on_broken: Callable[[str], None] | None = None):
        self._close_timeout = close_timeout
        self._on_broken = on_broken  # called (reader thread) when the daemon ends the stream
        self._lock = threading.Lock()  # guards the ledger and `_pending`
        self._ledger = CallLedger()
        self._pending: dict[int, Future] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.Session(iter(self._queue.get, _CLOSE))
        self._reader = threading.Thread(target=self._read, name="radixkv-session-stream", daemon=True)
        self._reader.start()

    def start(self, method: str, request) -> Future:
        """Send one call without waiting: a Future that the reader thread resolves with
        the response message or the call's RadixKVError (Unavailable once the stream
        ended). No deadline: the caller decides how long to wait."""
        return self._send(method, request)[1]

    def call(self, method: str, request, timeout: float | None):
        """Send one call and wait for its answer (the response message); raises the
        call's RadixKVError, Unavailable once the stream ended, DeadlineExceeded."""
        rid, answer = self._send(method, request)
        try:
            result = answer.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(rid, None)
            raise DeadlineExceeded(f"{method}: no answer on the session stream within {timeout}s") from None
        if isinstance(result, RadixKVError):
            raise result
        return result

    def _send(self, method: str, request) -> tuple[int, Future]:
        answer: Future = Future()
        with self._lock:
            try:
                rid, message = self._ledger.request(method, request)
            except RadixKVError as e:  # the stream ended
                answer.set_result(e)
                return 0, answer
            self._pending[rid] = answer
        self._queue.put(message)
        return rid, answer

    def close(self, reason: str = "the client closed") -> None:
        """Half-close, wait for the daemon to end its side, fail what stayed unanswered.
        Idempotent."""
        with self._lock:
            self._ledger.end(reason)
        self._queue.put(_CLOSE)
        self._reader.join(self._close_timeout)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(self._close_timeout)
        self._fail_pending()

    @property
    def end_code(self) -> grpc.StatusCode | None:
        """The status the stream ended with, when known (None while it runs)."""
        return self._ledger.code

    def abandon(self, reason: str) -> None:
        """The session is gone: fail every unanswered call and drop the stream now."""
        with self._lock:
            self._ledger.end(reason)
        self._queue.put(_CLOSE)
        self._call.cancel()
        self._fail_pending()

    def _read(self) -> None:
        error = None
        try:
            for response in self._call:
                with self._lock:
                    answer = self._pending.pop(response.id, None)
                if answer is not None:
                    answer.set_result(CallLedger.result(response))
        except Exception as e:  # a reader that dies must still fail the callers
            error = e
        reason = stream_end_reason(error)
        code = error.code() if isinstance(error, grpc.RpcError) else None
        with self._lock:
            by_daemon = self._ledger.end(reason, code)
        self._queue.put(_CLOSE)  # stop the request iterator
        self._fail_pending()
        if by_daemon and self._on_broken is not None:
            self._on_broken(reason, code)

    def _fail_pending(self) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
            error = self._ledger.broken()
        for answer in pending:
            if not answer.done():
                answer.set_result(error)


class AsyncCallStream:
    """The session stream on the event loop (see `radixkv.streaming`; the bookkeeping is
    the same `CallLedger`).

    A caller reads its own answer from the stream (no reader task in between: a hop
    through one costs tens of microseconds per call); while one reads, other callers
    await their answers, which it resolves as they come, and a call that returns with
    answers still owed hands the reading to a task. Any number may be in flight.

    A call not answered within its timeout raises DeadlineExceeded and ends the stream
    (the daemon answers in order: every later answer waits behind that one), and so does
    cancelling a call while it reads: the daemon then closes the session, and the next
    call finds it lost (recovery registers again). A stream the daemon ended is noticed
    by the next call.
    """

    def __init__(self, stub, session: str, *, close_timeout: float = 30.0,
                 on_broken: Callable[[str], None] | None = None):
        self._close_timeout = close_timeout
        self._on_broken = on_broken
        self._ledger = CallLedger()
        self._pending: dict[int, asyncio.Future] = {}
        self._loop = asyncio.get_running_loop()
        self._write_lock = asyncio.Lock()  # grpc.aio takes one write at a time
        self._reading = False  # a coroutine is in `read()`
        self._reader: asyncio.Task | None = None
        # Deadlines of the calls in flight (id -> (loop time, method, timeout)), checked by
        # one timer armed for the earliest: cheaper than a timer per call.
        self._deadlines: dict[int, tuple[float, str, float]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._call = stub.Session()

    async def call(self, method: str, request, timeout: float | None):
        """Send one call and await its answer (see `CallStream.call`)."""
        rid, message = self._ledger.request(method, request)
        answer = self._loop.create_future()
        self._pending[rid] = answer
        if timeout is not None:
            self._deadlines[rid] = (deadline := self._loop.time() + timeout, method, timeout)
            if self._timer is None or deadline < self._timer.when():
                self._arm(deadline)
        try:
            async with self._write_lock:
                await self._call.write(message)
            while not answer.done():
                if self._reading:
                    await answer  # resolved by the reader, or handed the reading (see _hand_over)
                else:
                    await self._read_one()
        except asyncio.CancelledError:
            if not answer.done():
                self._end("a call on the session stream was cancelled")
                raise
            # The answer came. gRPC raises CancelledError in a read of the call it cancelled
            # itself (a deadline ended the stream): the answer stands. A cancelled task's
            # cancellation is raised on all the same.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            self._end(stream_end_reason(e), await self._status(e))
        finally:
            self._deadlines.pop(rid, None)
            self._pending.pop(rid, None)
            self._hand_over()
        result = answer.result() if answer.done() else self._ledger.broken()
        if isinstance(result, RadixKVError):
            raise result
        return result

    async def close(self, reason: str = "the client closed") -> None:
        """Half-close, wait for the daemon to end its side, fail what stayed unanswered."""
        self._ledger.end(reason)
        try:
            async with self._write_lock:
                await self._call.done_writing()
            await asyncio.wait_for(self._call.code(), self._close_timeout)
        except (asyncio.TimeoutError, grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            self._call.cancel()
        self._fail_pending()

    @property
    def end_code(self) -> grpc.StatusCode | None:
        """The status the stream ended with, when known (None while it runs)."""
        return self._ledger.code

    def abandon(self, reason: str) -> None:
        """The session is gone: fail every unanswered call and drop the stream now."""
        self._ledger.end(reason)
        self._call.cancel()
        self._fail_pending()

    async def _read_one(self) -> None:
        """Read one answer and resolve its call; at the stream's end, end the ledger."""
        self._reading = True
        try:
            response = await self._call.read()
        finally:
            self._reading = False
        if response is grpc.aio.EOF:
            self._end(stream_end_reason(None), await self._status())
            return
        answer = self._pending.pop(response.id, None)
        if answer is not None and not answer.done():
            answer.set_result(CallLedger.result(response))

    def _hand_over(self) -> None:
        """Answers are owed and nobody reads: a task reads until none is."""
        if self._pending and not self._reading and self._reader is None and self._ledger.ended is None:
            self._reader = self._loop.create_task(self._read_owed())

    async def _read_owed(self) -> None:
        try:
            while self._pending and not self._reading and self._ledger.ended is None:
                await self._read_one()
        except asyncio.CancelledError as e:  # the waiters must hear of it
            self._end(stream_end_reason(e))
        except Exception as e:
            self._end(stream_end_reason(e), await self._status(e))
        finally:
            self._reader = None

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(deadline, self._sweep)

    def _sweep(self) -> None:
        """The timer: fail the first call past its deadline (ending the stream), or arm
        the timer again for the earliest deadline still ahead."""
        self._timer = None
        if not self._deadlines:
            return
        now = self._loop.time()
        rid, (deadline, method, timeout) = min(self._deadlines.items(), key=lambda item: item[1][0])
        if deadline > now:
            self._arm(deadline)
            return
        answer = self._pending.get(rid)
        if answer is not None and not answer.done():
            answer.set_result(DeadlineExceeded(f"{method}: no answer on the session stream within {timeout}s "
                                               "(the stream ends with it)"))
        self._deadlines.clear()
        self._end(f"a {method} was not answered within {timeout}s")  # a read in progress ends too

    async def _status(self, error: BaseException | None = None) -> grpc.StatusCode | None:
        """The ended stream's status: the call's when it is over, else `error`'s. A write
        after the daemon refused the stream fails otherwise (INTERNAL "Internal error from
        Core", UsageError) or a read finds the end, while the call holds the refusal."""
        try:  # a broken stream's status follows at once (a second at most)
            return await asyncio.wait_for(asyncio.shield(self._call.code()), STATUS_WAIT_S)
        except (asyncio.CancelledError, Exception):
            return error.code() if isinstance(error, grpc.RpcError) else None

    def _end(self, reason: str, code: grpc.StatusCode | None = None) -> None:
        """The stream is over (and the daemon closes the session with it): fail what is
        owed; tell the session, unless the client ended it (close, abandon)."""
        by_daemon = self._ledger.end(reason, code)
        self._call.cancel()
        self._fail_pending()
        if by_daemon and self._on_broken is not None:
            self._on_broken(reason, code)

    def _fail_pending(self) -> None:
        """The stream ended: fail every call still owed an answer; no deadline is due."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, {}
        for answer in pending.values():
            if not answer.done():
                answer.set_result(self._ledger.broken())


__all__ = ["STREAM_METHODS", "AsyncCallStream", "CallLedger", "CallStream", "check_served", "stream_end_reason"]
