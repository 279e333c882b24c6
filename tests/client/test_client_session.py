"""The client's session core without I/O: plans run against a scripted daemon.

Both `Client` and `AsyncClient` run these plans, so what an engine relies on after a
daemon restart is checked here once: a failed call whose session is gone registers
again and raises `DaemonRestarted` (or `SessionLost`) exactly once, unanswered acks of
the old session fail, calls before the next attempt is due fail at once, and a call
that failed on its own leaves the session alone.
"""

import pytest

from radixkv import errors
from radixkv.layout import KvLayout
from radixkv.reconnect import Backoff
from radixkv.session import PlanRun, Rpc, Session, Sleep
from radixkv.v1 import radixkv_pb2 as pb

LAYOUT = KvLayout(1, 1, 8, "float16", 4)


class Acks:
    """The ack stream a shell would open: records what the session does with it."""

    def __init__(self, session: str, on_broken=None):
        self.session = session
        self.on_broken = on_broken  # what the shell's reader calls when the daemon ends the stream
        self.issued: list[int] = []
        self.abandoned: str | None = None

    def issue(self, transfer: int) -> None:
        self.issued.append(transfer)

    def abandon(self, reason: str) -> None:
        self.abandoned = reason


class Daemon:
    """Answers the steps of a plan like a daemon at `instance` would; `down` makes every
    call fail with Unavailable, `forget` makes it forget every session."""

    def __init__(self):
        self.instance, self.sessions, self.calls = "d1", set(), []
        self.registered = 0  # sessions this instance made
        self.down = False

    def forget(self, instance: str) -> None:
        self.instance, self.sessions, self.registered = instance, set(), 0

    def __call__(self, step):
        self.calls.append(step.method if isinstance(step, Rpc) else "sleep")
        if isinstance(step, Sleep):
            return None
        if self.down:
            raise errors.Unavailable("connection refused")
        if step.method == "Register":
            self.registered += 1
            session = f"s{self.registered}-{self.instance}"
            self.sessions.add(session)
            return pb.RegisterResponse(session=session, daemon_instance=self.instance)
        if step.method == "Close":  # idempotent, as the daemon's
            self.sessions.discard(step.request.session)
            return pb.CloseResponse()
        if step.request.session not in self.sessions:
            raise errors.Unauthenticated("unknown session")
        if step.method == "LoadBack":
            return pb.LoadBackResponse(transfer=7)
        return pb.MatchResponse(results=[pb.MatchResult()] * len(step.request.prompts))


def run(plan, daemon: Daemon):
    steps = PlanRun(plan)
    while (step := steps.next()) is not None:
        try:
            steps.answer(daemon(step))
        except errors.RadixKVError as e:
            steps.fail(e)
    return steps.result


@pytest.fixture
def setup():
    daemon, streams, lost = Daemon(), [], []

    def open_acks(session, on_broken):
        streams.append(Acks(session, on_broken))
        return streams[-1]

    s = Session("unix:///x", timeout=5, reconnect=Backoff(initial=60, maximum=60, jitter=0),
                on_session_lost=lost.append, open_acks=open_acks)
    run(s.register("ns", LAYOUT, [("seg", 0, 64)], 4, backend="shm", device=0, write_policy="",
                   host_pool_pages=0, replace_existing=False, engine="", model=""), daemon)
    return s, daemon, streams, lost


def test_a_restarted_daemon_is_reported_once_and_the_session_replaced(setup):
    s, daemon, streams, lost = setup
    assert run(s.load_back(1, [0]), daemon).transfer == 7 and streams[0].issued == [7]
    daemon.forget("d2")
    with pytest.raises(errors.DaemonRestarted) as info:
        run(s.match([[1, 2, 3, 4]], False, False), daemon)
    # The call, the probe, closing the lost session (the daemon is done with it), the new one.
    assert daemon.calls[-4:] == ["Match", "Match", "Close", "Register"]
    assert info.value.registration.session == s.id == "s1-d2"
    assert (info.value.old_instance, info.value.new_instance) == ("d1", "d2")
    assert lost == [info.value]
    assert streams[0].abandoned and len(streams) == 2 and streams[1].session == "s1-d2"
    assert len(run(s.match([[1, 2, 3, 4]], False, False), daemon)) == 1  # and calls work again


def test_an_old_sessions_stream_ending_late_leaves_the_new_session_alone(setup):
    """The daemon ends a replaced session's streams itself; a reader that reports it only
    after the session was registered again must not mark the new one lost."""
    s, daemon, streams, lost = setup
    daemon.forget("d2")
    with pytest.raises(errors.DaemonRestarted):
        run(s.match([[1, 2, 3, 4]], False, False), daemon)
    streams[0].on_broken("the daemon ended the ack stream (session closed)")  # the old reader, late
    assert not s.lost
    assert len(run(s.match([[1, 2, 3, 4]], False, False), daemon)) == 1 and len(lost) == 1
    streams[1].on_broken("the daemon ended the ack stream (session closed)")  # the live one's
    assert s.lost


def test_a_reconnect_attempt_a_stopping_daemon_cancelled_is_unavailable_and_tried_again(setup):
    """A daemon shutting down cancels the Register in flight (CANCELLED): the daemon went
    away, as with Unavailable; raised as Cancelled, engines took it for their own call's
    fault (the soak counted it as an unexplained error)."""
    s, daemon, streams, lost = setup
    daemon.forget("d2")

    def stopping(step):
        if isinstance(step, Rpc) and step.method == "Register":
            raise errors.Cancelled("the daemon is shutting down")
        return daemon(step)

    with pytest.raises(errors.Unavailable, match="reconnect attempt 1 failed: the daemon is shutting down"):
        run(s.match([[1, 2, 3, 4]], False, False), stopping)
    assert s.lost and lost == []  # still lost: the next attempt registers


def test_a_reconnect_attempt_a_stalled_daemon_left_unanswered_is_unavailable(setup):
    """A daemon that stopped answering (frozen, not gone) let the lost session's Close
    run out its deadline: raised as DeadlineExceeded, engines did not take it for the
    outage it is (Unavailable: serve a miss, the next attempt is due after a backoff)."""
    s, daemon, streams, lost = setup
    daemon.forget("d2")

    def stalled(step):
        if isinstance(step, Rpc) and step.method == "Close":
            raise errors.DeadlineExceeded("Close: no answer within 3s")
        return daemon(step)

    with pytest.raises(errors.Unavailable, match="reconnect attempt 1 failed: Close: no answer within 3s"):
        run(s.match([[1, 2, 3, 4]], False, False), stalled)
    assert s.lost and lost == []


def test_a_call_that_failed_alone_keeps_the_session(setup):
    s, daemon, streams, lost = setup

    def flaky(step):
        if step.method == "Match" and step.request.prompts:
            raise errors.Unavailable("one call dropped")
        return daemon(step)

    with pytest.raises(errors.Unavailable, match="one call dropped"):
        run(s.match([[1, 2, 3, 4]], False, False), flaky)
    assert s.id == "s1-d1" and not lost and streams[0].abandoned is None


def test_calls_before_the_next_attempt_fail_at_once(setup):
    s, daemon, streams, lost = setup
    daemon.down = True
    with pytest.raises(errors.Unavailable, match="reconnect attempt 1 failed"):
        run(s.match([[1, 2, 3, 4]], False, False), daemon)
    sent = len(daemon.calls)
    with pytest.raises(errors.Unavailable, match="next reconnect attempt in"):
        run(s.match([[1, 2, 3, 4]], False, False), daemon)
    assert len(daemon.calls) == sent  # nothing was sent: the engine treats it as a miss
    # Its streams are not ended here: a daemon gone ends them itself, and one that is only
    # unreachable may still answer what is in flight. They end once a Close is answered.
    assert not streams[0].abandoned and not lost
    daemon.down = False
    s._recovery.next_at = 0.0
    with pytest.raises(errors.SessionLost):
        run(s.match([[1, 2, 3, 4]], False, False), daemon)
    assert streams[0].abandoned and daemon.calls[-2:] == ["Close", "Register"]


def test_a_closed_session_refuses_calls_and_closes_once(setup):
    s, daemon, _, _ = setup
    run(s.close(), daemon)
    assert daemon.calls[-1] == "Close" and s.closed
    with pytest.raises(errors.FailedPrecondition, match="closed"):
        run(s.match([[1, 2, 3, 4]], False, False), daemon)


@pytest.mark.parametrize("call, ends", [
    (lambda s: s.insert([1, 2, 3, 4], [0], extra_key=b"", chunked=False, release_lease=0, lease=False), True),
    (lambda s: s.evict(1), True),
    (lambda s: s.release([3]), True),
    (lambda s: s.match([[1, 2, 3, 4]], True, False), True),
    (lambda s: s.match([[1, 2, 3, 4]], False, False), False),
])
def test_a_call_left_unanswered_ends_the_session_when_it_moves_pages_or_leases(setup, call, ends):
    """No answer in time: the daemon may still carry the call out. One that moves pages
    or leases ends the session: the next call closes it, then (the daemon done with it)
    ends its streams and registers again; a plain Match leaves it alone."""
    s, daemon, streams, lost = setup

    def slow(step):
        if isinstance(step, Rpc) and step.method not in ("Register", "Close"):
            raise errors.DeadlineExceeded("no answer")
        return daemon(step)

    with pytest.raises(errors.DeadlineExceeded):
        run(call(s), slow)
    assert streams[0].abandoned is None  # what else is in flight may still be answered
    if ends:
        with pytest.raises(errors.SessionLost, match="outcome is unknown"):
            run(s.match([[1, 2, 3, 4]], False, False), daemon)
        assert daemon.calls[-2:] == ["Close", "Register"] and daemon.sessions == {s.id} != {"s1-d1"}
        assert streams[0].abandoned is not None
    else:
        assert len(run(s.match([[1, 2, 3, 4]], False, False), daemon)) == 1 and not lost


def test_without_recovery_a_call_left_unanswered_refuses_every_later_call_until_close():
    """reconnect=None: an Insert whose outcome is unknown (the daemon may still adopt its
    pages) left the session going as if nothing happened, and the engine reused the
    pages. Every later call now says the session was ended and to close() first."""
    daemon = Daemon()
    s = Session("unix:///x", timeout=5, reconnect=None, on_session_lost=None,
                open_acks=lambda session, on_broken: Acks(session))
    run(s.register("ns", LAYOUT, [("seg", 0, 64)], 4, backend="shm", device=0, write_policy="",
                   host_pool_pages=0, replace_existing=False, engine="", model=""), daemon)

    def slow(step):
        if isinstance(step, Rpc) and step.method == "Insert":
            raise errors.DeadlineExceeded("no answer")
        return daemon(step)

    with pytest.raises(errors.DeadlineExceeded):
        run(s.insert([1, 2, 3, 4], [0], extra_key=b"", chunked=False, release_lease=0, lease=False), slow)
    for call in (lambda: s.match([[1, 2, 3, 4]], False, False), lambda: s.evict(1)):
        with pytest.raises(errors.FailedPrecondition, match=r"Insert went unanswered .* close\(\) it"):
            run(call(), daemon)
    run(s.close(), daemon)
    assert daemon.calls[-1] == "Close" and s.close_answered


@pytest.mark.parametrize("timeout", [30.0, None])
def test_a_reconnect_of_a_tensor_parallel_rank_waits_for_the_other_ranks_within_its_timeout(timeout):
    """reconnect(30) on a client of timeout 30 (or none) gave the Register all of the 30 s
    and the wait for the other ranks none: rank 0 came back with its ranks missing, and
    its calls failed until they were in."""
    daemon, registers = Daemon(), []

    def recording(step):
        if isinstance(step, Rpc) and step.method == "Register":
            registers.append((step.request.wait_for_ranks_ms, step.timeout))
        return daemon(step)

    s = Session("unix:///x", timeout=timeout, reconnect=Backoff(initial=0.01, maximum=0.01, jitter=0),
                on_session_lost=None, open_acks=lambda session, on_broken: Acks(session))
    run(s.register("ns", LAYOUT, [("seg", 0, 64)], 4, backend="shm", device=0, write_policy="", host_pool_pages=0,
                   replace_existing=False, engine="", model="", tp_rank=0, tp_size=2, instance="e",
                   wait_for_ranks=10.0), recording)
    assert registers == [(10_000, None if timeout is None else 40.0)]  # the first: its deadline and the wait
    daemon.forget("d2")
    assert isinstance(run(s.reconnect(30.0), recording), errors.DaemonRestarted)
    wait_ms, deadline = registers[-1]
    assert wait_ms == 10_000 and 24 < deadline <= 30  # the whole wait fits in reconnect's 30 s
    s._recovery.lose("the daemon restarted", 0.0)  # a shorter reconnect: the wait shrinks to fit
    run(s.reconnect(6.0), recording)
    wait_ms, deadline = registers[-1]
    assert 2_000 <= wait_ms <= 3_000 and deadline <= 6


def test_a_prefetch_finds_a_restarted_daemon_like_any_call(setup):
    """Prefetch goes through the same recovery: after a restart it registers the session
    again and raises DaemonRestarted (it failed UNAUTHENTICATED for as long as no other
    call came)."""
    s, daemon, streams, lost = setup
    daemon.forget("d2")
    with pytest.raises(errors.DaemonRestarted):
        run(s.prefetch([1, 2, 3, 4], extra_key=b"", policy="best_effort", timeout=None), daemon)
    assert daemon.calls[-3:] == ["Match", "Close", "Register"] and lost


def test_reconnect_for_one_attempt_gives_it_the_clients_timeout(setup):
    """`reconnect(timeout=0)` (one attempt, as the vLLM connector makes from a thread of
    its own) sends the Close and the Register with the client's timeout, not a sliver of
    a zero budget; `reconnect(1.5)` keeps each within what is left of 1.5 s."""
    s, daemon, streams, lost = setup
    timeouts = {}

    def record(step):
        if isinstance(step, Rpc):
            timeouts[step.method] = step.timeout
        return daemon(step)

    daemon.forget("d2")
    s._recovery.lose("the ack stream ended", 0.0)
    assert isinstance(run(s.reconnect(0), record), errors.DaemonRestarted)
    assert timeouts["Close"] == timeouts["Register"] == s.timeout == 5
    s._recovery.lose("the ack stream ended", 0.0)
    assert isinstance(run(s.reconnect(1.5), record), errors.SessionLost)
    assert 0 < timeouts["Register"] <= 1.5


def test_a_refused_attempt_at_registering_again_is_raised_as_the_refusal(setup):
    """A daemon that refuses the lost session's registration (another engine holds the
    namespace with another layout or model) answers for good: `reconnect` raises that
    refusal, not Unavailable, so the vLLM connector warns instead of waiting at debug
    level for a daemon that is already there (it said Unavailable for both)."""
    s, daemon, streams, lost = setup
    daemon.forget("d2")
    refusing = daemon.__call__

    def refuse(step):
        if isinstance(step, Rpc) and step.method == "Register":
            daemon.calls.append("Register")
            raise errors.FailedPrecondition("namespace ns has the other device tier")
        return refusing(step)

    s._recovery.lose("the ack stream ended", 0.0)
    with pytest.raises(errors.FailedPrecondition, match="the last attempt: .*has the other device tier"):
        run(s.reconnect(0), refuse)
    daemon.down = True
    s._recovery.next_at = 0.0
    with pytest.raises(errors.Unavailable, match="the last attempt: .*connection refused"):
        run(s.reconnect(0), daemon)
