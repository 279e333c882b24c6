"""The session's acks: `AckLedger`, the bookkeeping both clients share (ids issued, acks
in flight, answers kept, why the stream ended), and `AckStream`, the blocking client's
stream driven by a background thread (`radixkv.aio.AsyncAckStream` is the asyncio one).

One long-lived `Acks` stream per session, opened right after Register (`open`), so the
daemon notices a dead engine by its stream. `wait` queues an ack for every id not acked
yet and blocks until the daemon answers each; answers are kept, so waiting again on an
id returns the same `LoadOutcome`. The daemon answers an ack only after that copy (and
the copies it depends on) completed.

Failure is never reported as success: if the stream breaks (daemon gone, session
closed) or the client closes, every unanswered ack resolves as a failed load with a
reason, and later acks resolve the same way at once. Only ids this session's load-backs
returned (`issue`) are sent: an old session's id must never reach a new session (the
daemon's ids start at a random point per run, so an old id is NOT_FOUND there anyway).
"""

import asyncio
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import grpc

from radixkv.v1 import radixkv_pb2 as pb

from .errors import DeadlineExceeded, from_rpc_error
from .messages import transfer_ids
from .types import LoadOutcome

# Outcomes kept for repeated waits; older ones are forgotten first.
DEFAULT_OUTCOME_CACHE = 1 << 16
_CLOSE = object()


class AckLedger:
    """What one session knows of its load-backs, for both ack streams (blocking and
    asyncio; not thread-safe by itself): ids its LoadBack returned (`issue`), acks in
    flight, answers kept for repeated waits (`cap` of each at most), and whether the
    stream ended (`ended`: why no more answers will come)."""

    def __init__(self, cap: int):
        self._cap = max(1, cap)
        self._outcomes: OrderedDict[int, LoadOutcome] = OrderedDict()
        self._issued: OrderedDict[int, None] = OrderedDict()
        self._in_flight: set[int] = set()
        self.ended: str | None = None

    def issue(self, transfer: int) -> None:
        """Record an id this session's LoadBack returned (0: nothing loaded, ignored)."""
        if not transfer:
            return
        self._outcomes.pop(transfer, None)  # an id refused before it was issued to us
        self._issued[transfer] = None
        while len(self._issued) > self._cap:
            self._issued.popitem(last=False)

    def outcome(self, transfer: int) -> LoadOutcome | None:
        return self._outcomes.get(transfer)

    def in_flight(self, transfer: int) -> bool:
        return transfer in self._in_flight

    def to_ack(self, ids: Iterable[int]) -> tuple[list[int], list[LoadOutcome]]:
        """Of `ids` neither answered nor in flight: those to send now (issued to this
        session; now in flight) and failures to `record` at once for the others: an id
        this session's load_back did not return (a restarted daemon numbers transfers
        from 1 again, so it could name another's load), or any id once the stream ended."""
        send, refused = [], []
        for t in ids:
            if t in self._outcomes or t in self._in_flight:
                continue
            if t not in self._issued:
                refused.append(LoadOutcome.failure(
                    t, f"transfer {t} was not started by this session (a lost session's, "
                    "or never returned by load_back): recompute its tokens"))
            elif self.ended is not None:
                refused.append(LoadOutcome.failure(t, f"not acknowledged: {self.ended}"))
            else:
                self._in_flight.add(t)
                send.append(t)
        return send, refused

    def record(self, outcome: LoadOutcome) -> None:
        """An answer (the daemon's, or a failure decided here) for `outcome.transfer`."""
        t = outcome.transfer
        self._issued.pop(t, None)
        self._in_flight.discard(t)
        self._outcomes[t] = outcome
        self._outcomes.move_to_end(t)
        while len(self._outcomes) > self._cap:
            self._outcomes.popitem(last=False)

    def end(self, reason: str) -> bool:
        """No more answers will come; the first reason stays. True if this call ended it."""
        if self.ended is not None:
            return False
        self.ended = reason
        return True

    def unanswered(self) -> list[LoadOutcome]:
        """A failed load for every ack in flight, to `record` once the stream ended."""
        return [LoadOutcome.failure(t, f"no answer from the daemon: {self.ended}") for t in self._in_flight]


def end_reason(error: BaseException | None) -> str:
    """Why a reader saw its ack stream end: the daemon ended it (`error` None), it broke
    with an RPC error, it was cancelled (asyncio), or the reader itself failed."""
    if error is None:
        return "the daemon ended the ack stream (session closed)"
    if isinstance(error, asyncio.CancelledError):
        return "ack stream cancelled"
    if isinstance(error, grpc.RpcError):
        return f"ack stream broke: {from_rpc_error(error)}"
    return f"ack stream reader failed: {error!r}"


class AckStream:
    """Acks of one session. Thread-safe: any thread may `wait`; `close` once at the end."""

    def __init__(self, stub, session: str, *, outcome_cache: int = DEFAULT_OUTCOME_CACHE,
                 close_timeout: float = 30.0, on_broken: Callable[[str], None] | None = None):
        self._stub = stub
        self._session = session
        self._close_timeout = close_timeout
        self._on_broken = on_broken  # called (reader thread) when the daemon ends the stream
        # `_cond` guards the ledger and the waiters; the reader thread and waiters share them.
        self._cond = threading.Condition()
        self._ledger = AckLedger(outcome_cache)
        self._waiters: list[dict[int, LoadOutcome | None]] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._call = None
        self._reader: threading.Thread | None = None

    # -- public ------------------------------------------------------------------------

    def open(self) -> None:
        """Open the stream now (it names the session, acknowledging nothing)."""
        with self._cond:
            if self._call is None and self._ledger.ended is None:
                self._start()

    def issue(self, transfer: int) -> None:
        """Record a transfer id this session's LoadBack returned (0 is ignored)."""
        with self._cond:
            self._ledger.issue(transfer)

    def wait(self, ids: Iterable[int], timeout: float | None = None) -> dict[int, LoadOutcome]:
        """Ack every id not acked yet and wait for all answers.

        Returns {id: outcome} for every distinct non-zero id (0 means "nothing loaded"
        and is skipped). Raises DeadlineExceeded after `timeout` seconds; the acks stay
        in flight and a later `wait` collects them.
        """
        wanted = transfer_ids(ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            result: dict[int, LoadOutcome | None] = {t: self._ledger.outcome(t) for t in wanted}
            if all(o is not None for o in result.values()):
                return result  # type: ignore[return-value]
            self._waiters.append(result)
            try:
                self._ack(t for t, o in result.items() if o is None)
                while any(o is None for o in result.values()):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        pending = sorted(t for t, o in result.items() if o is None)
                        raise DeadlineExceeded(f"load-backs {pending} not answered within {timeout}s")
                    self._cond.wait(left)
            finally:  # by identity: another caller may wait on equal ids with equal outcomes
                self._waiters = [w for w in self._waiters if w is not result]
            return result  # type: ignore[return-value]

    def close(self, reason: str = "the client closed") -> None:
        """End the stream (the daemon then finishes this session's copies and closes
        it), wait for the daemon to end its side, and fail whatever stayed unanswered.
        Idempotent."""
        with self._cond:
            self._ledger.end(reason)
            reader, call = self._reader, self._call
            if call is not None:
                self._queue.put(_CLOSE)
        if reader is not None:
            reader.join(self._close_timeout)
            if reader.is_alive():
                call.cancel()
                reader.join(self._close_timeout)
        with self._cond:
            self._resolve(*self._ledger.unanswered())

    def abandon(self, reason: str) -> None:
        """The session is gone: fail every unanswered ack now and drop the stream
        without waiting for the daemon. Idempotent."""
        with self._cond:
            self._ledger.end(reason)
            call = self._call
            if call is not None:
                self._queue.put(_CLOSE)
            self._resolve(*self._ledger.unanswered())
        if call is not None:
            call.cancel()

    # -- internals (callers hold `_cond`) ----------------------------------------------

    def _ack(self, ids: Iterable[int]) -> None:
        """Queue the acks the ledger says to send; record the ones it refuses."""
        send, refused = self._ledger.to_ack(ids)
        self._resolve(*refused)
        if send and self._call is None:
            self._start()
        for t in send:
            self._queue.put(t)

    def _start(self) -> None:
        """Open the stream and its reader thread."""
        self._call = self._stub.Acks(self._requests())
        self._reader = threading.Thread(target=self._read, name="radixkv-acks", daemon=True)
        self._reader.start()

    def _requests(self):
        yield pb.AckRequest(session=self._session, transfer=0)  # opens the stream
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            yield pb.AckRequest(session=self._session, transfer=item)

    def _read(self) -> None:
        """The reader thread: record answers until the stream ends, then fail the rest."""
        error = None
        try:
            for resp in self._call:
                with self._cond:
                    self._resolve(LoadOutcome.from_pb(resp))
        except Exception as e:  # a reader that dies must still fail the waiters
            error = e
        with self._cond:
            by_daemon = self._ledger.end(end_reason(error))
            self._queue.put(_CLOSE)  # the stream is over; stop the request generator
            self._resolve(*self._ledger.unanswered())
        if by_daemon and self._on_broken is not None:
            self._on_broken(end_reason(error), error.code() if isinstance(error, grpc.RpcError) else None)

    def _resolve(self, *outcomes: LoadOutcome) -> None:
        """Record answers and wake waiters."""
        for outcome in outcomes:
            t = outcome.transfer
            self._ledger.record(outcome)
            for w in self._waiters:
                if t in w and w[t] is None:
                    w[t] = outcome
        self._cond.notify_all()
