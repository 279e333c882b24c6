"""The session's ack stream for the blocking client, driven by a background thread.

One long-lived `Acks` stream per session, opened right after Register (`open`), so the
daemon notices a dead engine by its stream. `wait` queues an ack for every id not acked
yet and blocks until the daemon answers each; answers are kept, so waiting again on an
id returns the same `LoadOutcome`. The daemon answers an ack only after that copy (and
the copies it depends on) completed.

Failure is never reported as success: if the stream breaks (daemon gone, session
closed) or the client closes, every unanswered ack resolves as a failed load with a
reason, and later acks resolve the same way at once. Only ids this session's load-backs
returned (`issue`) are sent: after a daemon restart the new daemon numbers transfers
from 1 again, and an old id must not acknowledge a new daemon's transfer.
"""

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
    """What one session knows of its load-backs: ids its LoadBack returned and not yet
    answered, and recent answers (kept for repeated waits, `cap` of each at most).
    Shared by the blocking and asyncio ack streams; not thread-safe by itself."""

    def __init__(self, cap: int):
        self._cap = max(1, cap)
        self._outcomes: OrderedDict[int, LoadOutcome] = OrderedDict()
        self._issued: OrderedDict[int, None] = OrderedDict()

    def issue(self, transfer: int) -> None:
        self._outcomes.pop(transfer, None)  # an id refused before it was issued to us
        self._issued[transfer] = None
        while len(self._issued) > self._cap:
            self._issued.popitem(last=False)

    def outcome(self, transfer: int) -> LoadOutcome | None:
        return self._outcomes.get(transfer)

    def issued(self, transfer: int) -> bool:
        return transfer in self._issued

    def record(self, outcome: LoadOutcome) -> None:
        t = outcome.transfer
        self._issued.pop(t, None)
        self._outcomes[t] = outcome
        self._outcomes.move_to_end(t)
        while len(self._outcomes) > self._cap:
            self._outcomes.popitem(last=False)

    @staticmethod
    def not_ours(transfer: int) -> LoadOutcome:
        """Never acknowledge an id this session's load_back did not return: a restarted
        daemon numbers transfers from 1 again, so it could name another's load."""
        return LoadOutcome.failure(
            transfer, f"transfer {transfer} was not started by this session (a lost session's, "
            "or never returned by load_back): recompute its tokens")


class AckStream:
    """Acks of one session. Thread-safe: any thread may `wait`; `close` once at the end."""

    def __init__(self, stub, session: str, *, outcome_cache: int = DEFAULT_OUTCOME_CACHE,
                 close_timeout: float = 30.0, on_broken: Callable[[str], None] | None = None):
        self._stub = stub
        self._session = session
        self._close_timeout = close_timeout
        self._on_broken = on_broken  # called (reader thread) when the daemon ends the stream
        # `_cond` guards every field below; the reader thread and waiters share them.
        self._cond = threading.Condition()
        self._ledger = AckLedger(outcome_cache)
        self._sent: set[int] = set()  # acked, not answered yet
        self._waiters: list[dict[int, LoadOutcome | None]] = []
        self._broken: str | None = None  # why no more answers will come
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._call = None
        self._reader: threading.Thread | None = None

    # -- public ------------------------------------------------------------------------

    def open(self) -> None:
        """Open the stream now (it names the session, acknowledging nothing)."""
        with self._cond:
            if self._call is None and self._broken is None:
                self._start()

    def issue(self, transfer: int) -> None:
        """Record a transfer id this session's LoadBack returned (0 is ignored)."""
        if not transfer:
            return
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
            missing = [t for t, o in result.items() if o is None]
            if not missing:
                return result  # type: ignore[return-value]
            self._waiters.append(result)
            try:
                for t in missing:
                    if t not in self._sent and not self._ledger.issued(t):
                        self._resolve(AckLedger.not_ours(t))
                self._send(t for t in missing if t not in self._sent and self._ledger.issued(t))
                while any(o is None for o in result.values()):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        pending = sorted(t for t, o in result.items() if o is None)
                        raise DeadlineExceeded(f"load-backs {pending} not answered within {timeout}s")
                    self._cond.wait(left)
            finally:
                self._waiters.remove(result)
            return result  # type: ignore[return-value]

    def close(self, reason: str = "the client closed") -> None:
        """End the stream (the daemon then finishes this session's copies and closes
        it), wait for the daemon to end its side, and fail whatever stayed unanswered.
        Idempotent."""
        with self._cond:
            if self._broken is None:
                self._broken = reason
            reader, call = self._reader, self._call
            if call is not None:
                self._queue.put(_CLOSE)
        if reader is not None:
            reader.join(self._close_timeout)
            if reader.is_alive():
                call.cancel()
                reader.join(self._close_timeout)
        with self._cond:
            self._fail_sent(self._broken or reason)

    def abandon(self, reason: str) -> None:
        """The session is gone: fail every unanswered ack now and drop the stream
        without waiting for the daemon. Idempotent."""
        with self._cond:
            if self._broken is None:
                self._broken = reason
            call = self._call
            if call is not None:
                self._queue.put(_CLOSE)
            self._fail_sent(self._broken)
        if call is not None:
            call.cancel()

    # -- internals (callers hold `_cond` where noted) -----------------------------------

    def _send(self, ids: Iterable[int]) -> None:
        """Queue acks (holding `_cond`); with the stream broken, fail them at once."""
        for t in ids:
            if self._broken is not None:
                self._resolve(LoadOutcome.failure(t, f"not acknowledged: {self._broken}"))
                continue
            if self._call is None:
                self._start()
            self._sent.add(t)
            self._queue.put(t)

    def _start(self) -> None:
        """Open the stream and its reader thread (holding `_cond`)."""
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
        reason = "the daemon ended the ack stream (session closed)"
        try:
            for resp in self._call:
                with self._cond:
                    self._resolve(LoadOutcome.from_pb(resp))
        except grpc.RpcError as e:
            reason = f"ack stream broke: {from_rpc_error(e)}"
        except Exception as e:  # a reader that dies must still fail the waiters
            reason = f"ack stream reader failed: {e!r}"
        with self._cond:
            by_daemon = self._broken is None
            if by_daemon:
                self._broken = reason
            self._queue.put(_CLOSE)  # the stream is over; stop the request generator
            self._fail_sent(self._broken)
        if by_daemon and self._on_broken is not None:
            self._on_broken(reason)

    def _fail_sent(self, reason: str) -> None:
        """Resolve every unanswered ack as a failed load (holding `_cond`)."""
        for t in list(self._sent):
            self._resolve(LoadOutcome.failure(t, f"no answer from the daemon: {reason}"))

    def _resolve(self, outcome: LoadOutcome) -> None:
        """Record an answer and wake waiters (holding `_cond`)."""
        t = outcome.transfer
        self._sent.discard(t)
        self._ledger.record(outcome)
        for w in self._waiters:
            if t in w and w[t] is None:
                w[t] = outcome
        self._cond.notify_all()
