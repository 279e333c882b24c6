"""The Session stream: an engine's Match, LoadBack, Insert, Evict and Release (and Echo)
sent as messages on one long-lived stream per session instead of a unary RPC each
(`Client(..., stream=True)`, `AsyncClient(..., stream=True)`); the unary RPCs stay the
default (grpcurl, engines that want them).

The requests are the session's plans' (`radixkv.session`, built once by
`radixkv.messages`): the plan marks a call `on_stream` and the shell hands it here.
`CallLedger` is what both shells share, without I/O: request ids, wrapping a request
into a `SessionRequest`, unwrapping an answer into the response message or the typed
error of its in-band status, and why the stream ended. `CallStream` (blocking; a reader
thread) and `radixkv.aio.AsyncCallStream` (a reader task) do the I/O.

Any number of calls may be in flight (pipelined); the daemon answers them in order.
Once the stream ended (daemon gone or shutting down, session closed, client closed)
every unanswered call and every later one fails with Unavailable saying why, and
`on_broken(reason)` tells the session, whose recovery probes it and registers again (a
new registration opens a new stream). The daemon closes the session when its stream
ends, as it does when its ack stream ends. A call not answered within its timeout
raises DeadlineExceeded; its late answer is dropped.
"""

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from radixkv.v1 import radixkv_pb2 as pb

from .errors import DeadlineExceeded, RadixKVError, Unavailable, code_from_int, error_for, from_rpc_error

# RadixKV method -> its field of the SessionRequest / SessionResponse oneofs
STREAM_METHODS = {"Match": "match", "LoadBack": "load_back", "Insert": "insert", "Evict": "evict",
                  "Release": "release", "Echo": "echo"}
_CLOSE = object()


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
            return error_for(code_from_int(response.error.code), response.error.message)
        if kind is None:
            return RadixKVError(f"the daemon answered call {response.id} with nothing")
        return getattr(response, kind)

    def end(self, reason: str) -> bool:
        """No more answers will come; the first reason stays. True if this call ended it."""
        if self.ended is not None:
            return False
        self.ended = reason
        return True

    def broken(self) -> Unavailable:
        return Unavailable(f"no answer on the session stream: {self.ended}")


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

    def call(self, method: str, request, timeout: float | None):
        """Send one call and wait for its answer (the response message); raises the
        call's RadixKVError, Unavailable once the stream ended, DeadlineExceeded."""
        answer: Future = Future()
        with self._lock:
            rid, message = self._ledger.request(method, request)
            self._pending[rid] = answer
        self._queue.put(message)
        try:
            result = answer.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(rid, None)
            raise DeadlineExceeded(f"{method}: no answer on the session stream within {timeout}s") from None
        if isinstance(result, RadixKVError):
            raise result
        return result

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
        with self._lock:
            by_daemon = self._ledger.end(reason)
        self._queue.put(_CLOSE)  # stop the request iterator
        self._fail_pending()
        if by_daemon and self._on_broken is not None:
            self._on_broken(reason)

    def _fail_pending(self) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
            error = self._ledger.broken()
        for answer in pending:
            if not answer.done():
                answer.set_result(error)


__all__ = ["STREAM_METHODS", "CallLedger", "CallStream", "stream_end_reason"]
