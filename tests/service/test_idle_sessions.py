"""Sessions that never opened a stream (--idle-session-timeout).

A stream's end closes its session, so a dead engine's session goes with its stream. An
engine that died between Register's answer and opening its Acks stream left a session
nothing closed: its lease pinned pages, its namespace refused the restarted engine's
Register (no replace_existing), and it took a place under --max-sessions for as long as
the daemon ran. Such a session is now closed once no call named it for the timeout;
one with a stream open, idle for longer, is not.
"""

import time

import grpc

from radixkv.types import Registration
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import wait_for

from faultkit import RawSession, status, stub_for, tokens, violations

TIMEOUT = "3"


def live_sessions(stub) -> int:
    return stub.Stats(pb.StatsRequest()).sessions


def test_a_session_with_no_stream_is_closed_after_the_timeout_and_one_with_a_stream_is_not(daemon_factory):
    d = daemon_factory("--idle-session-timeout", TIMEOUT, metrics=True)
    channel, stub = stub_for(d.target)
    streamed = RawSession(stub, "idle/streamed")  # opened first: idle the longest
    orphan = RawSession(stub, "idle/orphan", open_acks=False)
    try:
        assert orphan.reply.idle_session_timeout_ms == 3000  # Register tells the engine
        assert Registration.from_pb(orphan.reply).idle_session_timeout_s == 3.0
        p = tokens(0, 4)
        orphan.insert(p, [0, 1, 2, 3])
        assert orphan.match(p, lease=True).lease
        [ns] = stub.Stats(pb.StatsRequest(namespace="idle/orphan")).namespaces
        assert ns.leases == 1

        wait_for(lambda: live_sessions(stub) == 1, 20, "the streamless session to be closed")
        code, message = status(lambda: orphan.match(p))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "--idle-session-timeout" in message and "register again" in message, message
        # What it held is released, and counted.
        [ns] = stub.Stats(pb.StatsRequest(namespace="idle/orphan")).namespaces
        assert (ns.leases, ns.counters["sessions_expired"]) == (0, 1)
        assert 'radixkv_expirations_total{kind="session",namespace="idle/orphan"} 1.0' in d.scrape()
        assert "event=session.expired " in d.log()
        # The restarted engine takes its namespace back without replace_existing; the
        # device tier went with the old engine's buffers.
        again = RawSession(stub, "idle/orphan")
        assert again.match(p).device_tokens == 0
        again.close()

        # The session with its Acks stream open was idle longer, and lives on.
        assert streamed.match(p).device_tokens == 0
        [ns] = stub.Stats(pb.StatsRequest(namespace="idle/streamed")).namespaces
        assert ns.counters["sessions_expired"] == 0
        assert violations(stub) == []
    finally:
        streamed.close()
        orphan.buffers.close()
        channel.close()


def test_calls_keep_a_streamless_session_alive(daemon_factory):
    """Back-to-back calls for three timeouts: every one is answered (a gap longer than
    the timeout between two of them would take a stall of the whole machine)."""
    d = daemon_factory("--idle-session-timeout", "2")
    channel, stub = stub_for(d.target)
    s = RawSession(stub, "idle/busy", open_acks=False)
    try:
        p = tokens(0, 4)
        s.insert(p, [0, 1, 2, 3])
        end = time.monotonic() + 6.0
        calls = 0
        while time.monotonic() < end:
            assert s.match(p).device_tokens == 16
            calls += 1
        [ns] = stub.Stats(pb.StatsRequest(namespace="idle/busy")).namespaces
        assert (ns.counters["sessions_expired"], stub.Stats(pb.StatsRequest()).sessions) == (0, 1), calls
    finally:
        s.close()
        channel.close()
