"""Session: one engine's session with the daemon, without I/O; both clients drive it.

Every client operation is written once here as a *plan*: a generator that builds the
request, yields the I/O it needs (`Rpc`, `Sleep`) and converts the answer into the
result it returns. The blocking `Client` and the asyncio `AsyncClient` are shells that
run plans (`PlanRun`): they perform each yielded step on their own channel, send the
answer back in, or throw the failed call's `RadixKVError` into the plan.

Session recovery lives here too (pacing: `radixkv.reconnect`): a call failing with
Unavailable or Unauthenticated probes the session; a lost one (or one whose stream the
daemon ended) is closed (answered once its copies are over), registered again with the
last `register`'s arguments, and the call that succeeds raises `SessionLost`
(`DaemonRestarted` for a new daemon). A call that moves pages or leases left without an
answer ends the session the same way (`_give_up`; docs/reliability.md). The ack and
session streams (`radixkv.acks`, `radixkv.streaming`) are opened per registration.
"""

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from radixkv.v1 import radixkv_pb2 as pb

from . import messages as msg
from . import operator_plans
from .channel import DEFAULT_TARGET, wait_serving
from .errors import (Cancelled, DeadlineExceeded, FailedPrecondition, RadixKVError, SessionLost, Unauthenticated,
                     Unavailable, Unimplemented)
from .layout import KvLayout
from .leases import release_leases
from .plans import Plan, PlanRun, Rpc, Sleep
from .reconnect import Backoff, Recovery, lost_message
from .streaming import RECHECK_PAUSE_S, STREAM_METHODS, check_served
from .types import EvictResult, InsertResult, LoadBackResult, MatchResult, PrefetchProgress, Registration

SERVICE = "radixkv.v1.RadixKV"
PROBE_TIMEOUT = 2.0  # seconds: is the session still alive after a failed call?
RETRY_WHILE_REGISTERING_S = 0.05  # `reconnect` looks again this soon while another call registers


class Session:
    """The state of one client: its registration, ack stream and recovery, and a plan
    per operation (see the module docstring; `Client` documents each operation).

    `open_acks(session_id, on_broken)` is the shell's: an opened ack stream (`issue`,
    `abandon`, `wait`, `close`) calling `on_broken(reason, code)` when the daemon ends it;
    `open_calls` (None: unary calls only) opens a session stream (`call`, `abandon`,
    `close`) alike. `on_broken` may come from another thread: recovery state changes
    hold `_lock`. Plans run one at a time per client."""

    def __init__(self, target: str, *, timeout: float | None, reconnect: Backoff | None,
                 on_session_lost: Callable[[SessionLost], None] | None,
                 open_acks: Callable[[str, Callable], Any],
                 open_calls: Callable[[str, Callable], Any] | None = None):
        self.target = target
        self.timeout = timeout
        self.registration: Registration | None = None
        self.closed = False
        self.ended = ""  # without recovery: why the session was ended (calls are refused)
        self.close_answered = False  # the daemon answered this client's Close
        self._register_request: pb.RegisterRequest | None = None
        self._buffers = None  # as given to register: exported afresh for each re-registration
        self._replaced = False  # another engine's Register took the namespace (see `_stream_broken`)
        self._acks = None
        self._open_acks = open_acks
        self._calls = None
        self._open_calls = open_calls
        self._recovery = Recovery(reconnect) if reconnect is not None else None
        self._lock = threading.Lock()
        self._on_session_lost = on_session_lost

    @property
    def lost(self) -> bool:
        """The session is gone and not registered again yet (see `_recover`)."""
        return self._recovery is not None and self._recovery.lost

    @property
    def id(self) -> str:
        """The session id. Raises FailedPrecondition before `register` or after `close`."""
        return self._registered(self.registration).session

    def acks(self):
        """The ack stream. Raises FailedPrecondition before `register` or after `close`."""
        return self._registered(self._acks)

    def _registered(self, value):
        self._check_open()
        if value is None:
            raise FailedPrecondition("not registered: call register() first")
        return value

    def live_stream(self):
        """The session stream when a call can go on it now without recovery first
        (registered, not closed, not lost), else None."""
        if self.closed or self.registration is None or (self._recovery is not None and self._recovery.lost):
            return None
        return self._calls

    def calls(self):
        """The session stream. Raises FailedPrecondition before `register` or after `close`."""
        self._check_open()
        if self._calls is None:
            raise FailedPrecondition("no session stream: register first, on a client made with stream=True")
        return self._calls

    # -- lifecycle ---------------------------------------------------------------------

    def wait_ready(self, timeout: float, service: str) -> Plan[None]:
        return (yield from wait_serving(self.target, timeout, service))

    def register(self, namespace: str, layout: KvLayout, buffers: Iterable, num_device_pages: int,
                 **options) -> Plan[Registration]:
        self._check_open()
        if self.registration is not None:
            raise FailedPrecondition(f"already registered (session {self.registration.session})")
        req = msg.register_request(namespace, layout, buffers, num_device_pages, **options)
        wait = req.wait_for_ranks_ms / 1000  # the daemon answers that much later at most
        reg = Registration.from_pb((yield from self._call("Register", req, self.timeout and self.timeout + wait)))
        self._register_request = req
        self._buffers = buffers
        self._attach(reg)
        if self._calls is not None:
            yield from self._check_stream(reg)
        return reg

    def _check_stream(self, reg: Registration) -> Plan[None]:
        """`check_served` on the new session's stream: Unimplemented (a daemon without the
        Session stream) closes the session and is raised. A stream ended INTERNAL before
        it was answered is checked once more on a fresh stream: gRPC reports its own
        INTERNAL ("Internal error from Core") when the Echo's write races the daemon's
        refusal of the stream, hiding the refusal's status (1 register in 7 under load).
        Any other end is the recovery's, as after any registration."""
        for last in (False, True):
            try:
                return (yield from check_served(reg.session, self.timeout))
            except Unimplemented:  # closed: unregistered again, the client stays usable (and closable)
                self.drop("the daemon has no Session stream")
                self.closed, self.registration, self._acks, self._calls = False, None, None, None
                raise
            except RadixKVError:
                if last or getattr(self._calls, "end_code", None) != grpc.StatusCode.INTERNAL:
                    return
                with self._lock:  # that stream's end marked the session lost: it says nothing yet
                    if self._recovery is not None:
                        self._recovery.recovered()
                self._calls.abandon("checked again on a new stream")
                yield Sleep(RECHECK_PAUSE_S)
                self._calls = self._open_calls(reg.session, functools.partial(self._stream_broken, reg.session))

    def reconnect(self, timeout: float) -> Plan[SessionLost | None]:
        deadline = time.monotonic() + timeout
        rec = self._recovery
        if rec is None or self._register_request is None:
            raise FailedPrecondition("reconnect needs a registered client with a reconnect backoff")
        if not rec.lost:
            probe = min(PROBE_TIMEOUT, max(0.05, timeout)) if timeout > 0 else PROBE_TIMEOUT
            try:
                yield from self._check_session(Unavailable("checking the session"), probe, quiet=False)
            except DeadlineExceeded:  # neither alive nor gone: a daemon that does not answer
                raise Unavailable(f"the daemon did not answer within {probe:g}s whether the session lives") from None
            if not rec.lost:
                return None
        while True:
            wait = RETRY_WHILE_REGISTERING_S if rec.registering else rec.wait_time(time.monotonic())
            yield Sleep(min(wait, max(0.0, deadline - time.monotonic())))
            if not rec.lost:
                return None  # another call registered it again (and raised SessionLost)
            try:  # each attempt's calls within what is left of `timeout` (0: one attempt, the client's)
                yield from self._recover(max(0.05, deadline - time.monotonic()) if timeout > 0 else None)
            except SessionLost as e:
                return e
            except RadixKVError as e:
                if time.monotonic() >= deadline:
                    message = f"no session after {timeout}s: {rec.reason}; the last attempt: {e.message}"
                    if isinstance(e, (Unavailable, DeadlineExceeded)):
                        raise Unavailable(message) from None
                    raise type(e)(message, e.code, e.reason, e.metadata) from None  # refused: as the daemon said it

    def close(self) -> Plan[list]:
        """Mark the client closed and end the session (Close); returns the streams for
        the shell to close next (session stream, ack stream; those there are): gracefully
        when the daemon answered the Close (`close_answered`: it ends them itself), else
        abandoned at once (a daemon gone or not answering would hold a graceful close).
        The caller checks `closed` first: closing is idempotent."""
        self.closed = True
        self._buffers = None  # a CUDA export holds the engine's tensors: let them go
        if self.registration is not None:
            try:
                yield Rpc("Close", pb.CloseRequest(session=self.registration.session), self.timeout)
                self.close_answered = True
            except RadixKVError:
                pass  # the daemon is gone, does not answer, or already closed the session
        return [s for s in (self._calls, self._acks) if s is not None]

    # -- engine operations -------------------------------------------------------------

    def match(self, prompts: Iterable, lease: bool, include_storage: bool, timeout="client") -> Plan[list[MatchResult]]:
        request = msg.match_request(self.id, prompts, lease, include_storage)
        resp = yield from self._call("Match", request, msg.call_timeout(timeout))
        return MatchResult.all_from_pb(resp)

    def prefetch(self, tokens, *, extra_key: bytes, policy: str,
                 timeout: float | None) -> Plan[list[PrefetchProgress]]:
        request = msg.prefetch_request(self.id, tokens, extra_key=extra_key, policy=policy, timeout=timeout)
        deadline = None if self.timeout is None else self.timeout + (timeout or 0)
        progress = yield from self._call("Prefetch", request, deadline, stream=True)
        return [PrefetchProgress.from_pb(p) for p in progress]

    def insert(self, tokens, device_pages, **options) -> Plan[InsertResult]:
        req = msg.insert_request(self.id, tokens, device_pages, **options)
        result = InsertResult.from_pb((yield from self._call("Insert", req)))
        if result.transfer:  # an engine-managed async save: acknowledged like a load
            self.acks().issue(result.transfer)
        return result

    def load_back(self, node: int, device_pages, engine_event=None, lease: int = 0,
                  start_page: int = 0, wait: bool = False) -> Plan[LoadBackResult]:
        req = msg.load_back_request(self.id, node, device_pages, engine_event, lease, start_page, wait)
        result = LoadBackResult.from_pb((yield from self._call("LoadBack", req)))
        self.acks().issue(result.transfer)
        return result

    def release(self, leases: Iterable[int]) -> Plan[None]:
        return (yield from release_leases(self._call, self.id, leases))

    def evict(self, num_pages: int, engine_event=None) -> Plan[EvictResult]:
        req = msg.evict_request(self.id, num_pages, engine_event)
        return EvictResult.from_pb((yield from self._call("Evict", req)))

    # -- operators ---------------------------------------------------------------------

    def operator(self, name: str, *args) -> Plan[Any]:
        """An operator's call, `radixkv.operator_plans.<name>(*args)`, on this session's
        call path (a lost session is recovered first, as for any call)."""
        return (yield from getattr(operator_plans, name)(self._call, *args))

    # -- one call, and a lost session --------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise FailedPrecondition("the client is closed")
        if self.ended:
            raise FailedPrecondition(f"the session was ended ({self.ended}) and the client registers no other "
                                     "(reconnect=None): close() it, which waits for the daemon's copies, before "
                                     "reusing that call's pages")

    def _call(self, method: str, request, deadline: float | None | str = "client",
              stream: bool = False) -> Plan[Any]:
        """One call with recovery: a lost session is registered again first (the call
        then raises SessionLost, or Unavailable before the next attempt is due); a call
        failing with Unavailable or Unauthenticated probes whether the session lives.
        `deadline`: the call's own ("client": the client's timeout); `stream`: a
        server-streaming call (its answers as a list)."""
        timeout = self.timeout if deadline == "client" else deadline
        self._check_open()
        if self._recovery is not None and self._recovery.lost:
            yield from self._recover()  # raises: SessionLost once registered again, else Unavailable
        on_stream = self._calls is not None and method in STREAM_METHODS
        try:
            return (yield Rpc(method, request, timeout, stream=stream, on_stream=on_stream))
        except DeadlineExceeded:
            if msg.moves_pages_or_leases(method, request):
                self._give_up(f"{method} went unanswered within {timeout}s")
            raise
        except GeneratorExit:  # the shell stopped waiting (a cancelled task): no answer either
            if msg.moves_pages_or_leases(method, request):
                self._give_up(f"the caller stopped waiting for {method}")
            raise
        except (Unavailable, Unauthenticated) as err:
            if method != "Register":
                yield from self._check_session(err)
                if self._recovery is not None and self._recovery.lost:
                    yield from self._recover()
            raise

    def _attach(self, reg: Registration) -> None:
        msg.forget_stale_events(self._register_request)
        self.registration = reg
        broken = functools.partial(self._stream_broken, reg.session)
        self._acks = self._open_acks(reg.session, broken)
        if self._open_calls is not None:
            self._calls = self._open_calls(reg.session, broken)

    def drop(self, reason: str) -> None:
        """The client was collected without `close`: end its streams (the daemon then
        closes the session). Sends nothing; any thread."""
        self.closed = True
        for stream in (self._acks, self._calls):
            if stream is not None:
                stream.abandon(reason)

    def _give_up(self, why: str) -> None:
        """A call that moves pages or leases ended without its outcome (the daemon may
        still carry it out): mark the session lost, so the next call closes it (answered
        once its copies are over), registers again and raises SessionLost. Its streams
        stay until that Close is answered (failing their calls and acks here would say the
        daemon writes no more, which it may). Without recovery, later calls are refused
        (`ended`) until close()."""
        if self.closed or self.registration is None:
            return
        if self._recovery is None:  # no recovery: nothing more goes out on this session
            self.ended = f"{why}: its outcome is unknown"
            return
        with self._lock:
            self._recovery.lose(f"{why}: its outcome is unknown, so the session was ended", time.monotonic())

    def _stream_broken(self, session: str, reason: str, code: grpc.StatusCode | None = None) -> None:
        """The daemon ended a stream of `session`, and that session (any thread); a
        replaced session's stream, reported late, says nothing of the current one. Ended
        FAILED_PRECONDITION, another engine's Register took the namespace: this engine
        registers again without `replace_existing` (taking it back would make the other
        lose it in turn, and the two trade the namespace for as long as both run)."""
        if self._recovery is not None and not self.closed:
            with self._lock:
                if self.registration is not None and self.registration.session == session:
                    self._recovery.lose(reason, time.monotonic())
                    self._replaced = self._replaced or code == grpc.StatusCode.FAILED_PRECONDITION

    def _check_session(self, err: RadixKVError, timeout: float = PROBE_TIMEOUT, quiet: bool = True) -> Plan[None]:
        """After `err`, ask the daemon whether the session lives; mark it lost if not.
        Other errors of the probe (no answer within `timeout`) say nothing: they are
        dropped, or raised when not `quiet`."""
        if self._recovery is None or self.registration is None or self._recovery.lost:
            return
        try:
            yield Rpc("Match", pb.MatchRequest(session=self.registration.session), timeout)
            return  # alive: `err` was about that call alone
        except (Unavailable, Unauthenticated):
            with self._lock:
                self._recovery.lose(f"{err.code.name}: {err.message}", time.monotonic())
        except RadixKVError:
            if not quiet:
                raise

    def _recover(self, within: float | None = None) -> Plan[None]:
        """Try to register again if an attempt is due. Raises SessionLost on success,
        Unavailable (or the daemon's refusal) otherwise; never returns. One call registers
        at a time: calls of other tasks or threads that find the session lost meanwhile
        fail Unavailable instead of registering a session each."""
        rec, reg = self._recovery, self.registration
        now = time.monotonic()
        with self._lock:
            reason = rec.reason
            if reason is None:  # registered again by another call since this one looked
                raise Unavailable("the session was lost and registered again by another call: "
                                  "drop every cached device page")
            if rec.registering:
                raise Unavailable(f"session lost ({reason}); another call is registering it again")
            due = rec.due(now)
        if not due:
            raise Unavailable(f"session lost ({reason}); next reconnect attempt in {rec.wait_time(now):.2f}s")
        with self._lock:
            if rec.registering or rec.reason is None:
                raise Unavailable(f"session lost ({reason}); another call is registering it again")
            rec.registering = True  # cleared with the outcome: failed() or recovered()
        try:  # as first registered: replace_existing only if the engine asked for it then
            # The lost session first: answered once its copies are over (at once if unknown).
            # Only then do its streams' unanswered calls and acks fail: nothing more comes.
            end = None if within is None else time.monotonic() + within
            step = self.timeout if within is None else min(within, self.timeout or within)
            yield Rpc("Close", pb.CloseRequest(session=reg.session), step)
            for stream in (self._acks, self._calls):
                if stream is not None:
                    stream.abandon(f"the session was lost ({reason})")
            wait_left = None
            if end is not None:  # the Register, then the wait for the other ranks, in what is left
                left = max(0.05, end - time.monotonic())
                step = min(step or left, left, max(PROBE_TIMEOUT, left / 2))
                wait_left = left - step
            again = msg.register_again(self._register_request, self._buffers, self._replaced, wait_left)
            new = Registration.from_pb((yield Rpc("Register", again, step and step + again.wait_for_ranks_ms / 1000)))
        except (Unavailable, Cancelled, DeadlineExceeded) as err:  # cut by a stopping daemon, or a stalled one
            with self._lock:
                rec.failed(time.monotonic())
            raise Unavailable(f"session lost ({reason}); reconnect attempt {rec.attempts} failed: "
                              f"{err.message}") from None
        except RadixKVError as err:  # refused: say why the session was lost too (replaced by another engine?)
            with self._lock:
                rec.failed(time.monotonic())
            raise type(err)(f"session lost ({reason}); registering again failed: {err.message}",
                            err.code, err.reason, err.metadata) from None
        except BaseException:  # cancelled, or the plan closed: no outcome, the next call tries
            with self._lock:
                rec.registering = False
            raise
        cls, message = lost_message(reg, new, reason)
        with self._lock:
            rec.recovered()
            self._replaced = False  # registered again: as first registered from now on
        self._attach(new)
        lost = cls(message, new, reg.daemon_instance, new.daemon_instance)
        if self._on_session_lost is not None:
            self._on_session_lost(lost)
        raise lost


__all__ = ["DEFAULT_TARGET", "PROBE_TIMEOUT", "SERVICE", "Plan", "PlanRun", "Rpc", "Session", "Sleep"]
