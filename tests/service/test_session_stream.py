"""The Session stream (#15): an engine's calls as messages on one stream per session,
against a real daemon (see conftest.py).

Over the stream, Match / LoadBack / Insert / Evict / Release answer exactly as the unary
RPCs do (the same results, the same bytes on the device, the same status code and
message for a bad call, now in-band); many calls may be in flight and come back in
order; the stream's end closes its session, as the end of the ack stream does; the
daemon's shutdown ends it with UNAVAILABLE.
"""

import asyncio
import dataclasses
import queue
import threading

import grpc
import pytest

from radixkv import errors
from radixkv.aio import AsyncClient
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.reconnect import Backoff
from radixkv.types import InsertResult, MatchResult, pack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import wait_for
from tests.support.engine import LAYOUT, EngineDouble, prompt

from faultkit import RawSession, status, stub_for, tokens

C = grpc.StatusCode


class RawStream:
    """One Session stream driven message by message: send() and reply()."""

    def __init__(self, stub):
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Session(iter(self._out.get, None))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ids = 0

    def _read(self):
        try:
            for reply in self.call:
                self._in.put(reply)
            self._in.put(("end", C.OK, ""))
        except grpc.RpcError as e:
            self._in.put(("end", e.code(), e.details() or ""))

    def send(self, **call) -> int:
        self.ids += 1
        self._out.put(pb.SessionRequest(id=self.ids, **call))
        return self.ids

    def reply(self, timeout: float = 10.0):
        """The next SessionResponse, or ("end", code, message) once the stream ended."""
        return self._in.get(timeout=timeout)

    def ask(self, **call):
        """Send one call; its answer (checking the id)."""
        rid = self.send(**call)
        reply = self.reply()
        assert not isinstance(reply, tuple), reply
        assert reply.id == rid
        return reply

    def close(self):
        """Half-close; how the daemon ended the stream."""
        self._out.put(None)
        self._reader.join(10)
        end = self.reply()
        assert isinstance(end, tuple), end
        return end[1:]


def in_band(reply) -> tuple[grpc.StatusCode, str]:
    """(code, message) of an answer: OK and '' unless it is an error."""
    if reply.WhichOneof("result") != "error":
        return C.OK, ""
    return next(c for c in C if c.value[0] == reply.error.code), reply.error.message


@pytest.fixture
def raw(daemon):
    channel, stub = stub_for(daemon)
    yield stub
    channel.close()


# -- the same answers as unary ---------------------------------------------------------

def without_ids(x):
    """`x` with its node ids made booleans: each namespace numbers its nodes from a random
    start (the daemon's core/ids.py), so two namespaces' answers differ only there."""
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(without_ids(v) for v in x)
    if isinstance(x, (MatchResult, InsertResult)):
        return dataclasses.replace(x, **{f: bool(getattr(x, f)) for f in ("device_node", "host_node", "node")
                                         if hasattr(x, f)})
    return x


def engine_script(engine: EngineDouble) -> list:
    """A few steps of an engine, verifying every byte it loads; what each call answered
    (lease ids are daemon-wide, so only whether one was given)."""
    c, out = engine.client, []
    for i in (1, 2, 3):
        out.append(engine.prefill(prompt(i, 4)))
    results = c.match([pack(prompt(1, 4)), pack(prompt(2, 6)), pack(prompt(9, 2))], lease=True)
    out.append([(r.device_tokens, list(r.device_pages), r.host_tokens, bool(r.lease)) for r in results])
    c.release([r.lease for r in results])
    out.append(sorted(engine.evict(8)))
    out.append(engine.load(prompt(1, 4)))  # (tokens on device, (byte, chunk) mismatches)
    out.append(engine.load(prompt(2, 4)))
    out.append(c.match([pack(prompt(3, 4))]))
    for bad in (lambda: c.release([424242]), lambda: c.load_back(999999, [0]),
                lambda: c.insert(pack(prompt(5, 1)), [0, 1])):
        with pytest.raises(errors.RadixKVError) as e:
            bad()
        out.append((type(e.value), e.value.message))
    out.append(engine.counters())
    return out


def test_engine_steps_answer_as_unary(daemon):
    engines = {}
    try:
        for name, stream in (("unary", False), ("stream", True)):
            e = engines[name] = EngineDouble(LAYOUT, 64)
            e.register(Client(daemon, timeout=10, stream=stream), f"same/{name}", write_policy="write_through",
                       host_pool_pages=128)
        unary, streamed = engine_script(engines["unary"]), engine_script(engines["stream"])
        assert without_ids(streamed) == without_ids(unary)
        assert streamed[5][1] == (0, 0) and streamed[5][0] == 16  # loaded back, every byte right
        for e in engines.values():
            assert e.pool.errors == 0
            assert e.client.check_invariants() == []
    finally:
        for e in engines.values():
            e.close()


def test_async_client_pipelines_many_calls(daemon):
    async def run():
        async with AsyncClient(daemon, timeout=10, stream=True) as streamed, AsyncClient(daemon, timeout=10) as unary:
            engines = [EngineDouble(LAYOUT, 64) for _ in range(2)]
            try:
                for c, e, ns in ((streamed, engines[0], "pipe/stream"), (unary, engines[1], "pipe/unary")):
                    await c.register(ns, LAYOUT, e.buffers.specs, 64)
                    for i in range(4):
                        await c.insert(pack(prompt(i, 4)), list(range(4 * i, 4 * i + 4)))
                asks = [[pack(prompt(i % 6, 4))] for i in range(200)]
                got = await asyncio.gather(*(streamed.match(p) for p in asks), streamed.echo(b"x" * 100))
                want = [await unary.match(p) for p in asks]
                assert without_ids(got[:-1]) == without_ids(want) and got[-1] == b"x" * 100
                with pytest.raises(errors.NotFound, match="lease 77 is not held"):
                    await streamed.release([77])
                assert [r.device_tokens for [r] in await asyncio.gather(*(streamed.match(p) for p in asks[:6]))] \
                    == [16, 16, 16, 16, 0, 0]
            finally:
                for e in engines:
                    e.buffers.close()
    asyncio.run(run())


def test_raw_pipelined_answers_in_order(raw):
    a = RawSession(raw, "raw/pipe")
    a.insert(tokens(0, 4), [0, 1, 2, 3])
    s = RawStream(raw)
    try:
        sent = []
        for i in range(300):
            if i % 3 == 2:
                sent.append(s.send(echo=pb.EchoRequest(payload=bytes([i % 256]) * 64)))
            else:
                sent.append(s.send(match=pb.MatchRequest(session=a.id if i % 2 else "",
                                                         prompts=[pb.Prompt(tokens=tokens(0, 4 - i % 4))])))
        replies = [s.reply() for _ in sent]
        assert [r.id for r in replies] == sent
        for i, r in enumerate(replies):
            if i % 3 == 2:
                assert r.echo.payload == bytes([i % 256]) * 64
            elif i == 0:  # the stream is not bound yet: an empty session is no session
                assert in_band(r)[0] == C.UNAUTHENTICATED
            else:
                assert r.match.results[0].device_tokens == 4 * (4 - i % 4), (i, r)
        assert s.close() == (C.OK, "")
    finally:
        a.close()


# -- errors in-band ------------------------------------------------------------------------

def test_errors_come_back_in_band_as_unary_would(raw):
    a, b = RawSession(raw, "err/a"), RawSession(raw, "err/b")
    a.insert(tokens(0, 2), [0, 1])
    s = RawStream(raw)
    try:
        assert in_band(s.ask(match=pb.MatchRequest(session=a.id, prompts=[pb.Prompt(tokens=tokens(0, 2))]))) \
            == (C.OK, "")
        bad = [
            ("Match", "match", pb.MatchRequest(session=a.id, prompts=[pb.Prompt(tokens=b"\x01\x02\x03")]),
             C.INVALID_ARGUMENT),
            ("Release", "release", pb.ReleaseRequest(session=a.id, leases=[424242]), C.NOT_FOUND),
            ("LoadBack", "load_back", pb.LoadBackRequest(session=a.id, node=999999, device_pages=pack([5])),
             C.NOT_FOUND),
            ("Insert", "insert", pb.InsertRequest(session=a.id, tokens=tokens(50, 1), device_pages=pack([9, 10])),
             C.INVALID_ARGUMENT),
            ("LoadBack", "load_back", pb.LoadBackRequest(session=a.id, node=1, lease=3), C.INVALID_ARGUMENT),
        ]
        for method, field, request, code in bad:
            unary = status(lambda: getattr(raw, method)(request))
            assert unary[0] == code, (method, unary)
            assert in_band(s.ask(**{field: request})) == unary, method
        assert in_band(s.ask()) == (C.INVALID_ARGUMENT, "a SessionRequest must set one call")
        other = in_band(s.ask(evict=pb.EvictRequest(session=b.id, num_pages=1)))
        assert other == (C.PERMISSION_DENIED, f"this session stream belongs to session {a.id}")
        # the stream goes on after every error, bound to its session
        reply = s.ask(match=pb.MatchRequest(prompts=[pb.Prompt(tokens=tokens(0, 2))]))
        assert reply.match.results[0].device_tokens == 8
        assert s.ask(evict=pb.EvictRequest(num_pages=2)).evict.freed_pages == pack([0, 1])
    finally:
        s.close()
        b.close()


def test_binding_a_session(raw):
    a = RawSession(raw, "bind/a")
    first, second = RawStream(raw), RawStream(raw)
    try:
        unknown = pb.MatchRequest(session="x" * 32)
        assert in_band(first.ask(match=unknown)) == status(lambda: raw.Match(unknown))
        assert in_band(first.ask(match=unknown))[0] == C.UNAUTHENTICATED
        assert first.ask(echo=pb.EchoRequest(payload=b"ping")).echo.payload == b"ping"  # needs no session
        assert in_band(first.ask(match=pb.MatchRequest(session=a.id))) == (C.OK, "")  # binds
        assert in_band(second.ask(match=pb.MatchRequest(session=a.id))) == (
            C.FAILED_PRECONDITION, f"session {a.id} already has a session stream")
        assert second.close() == (C.OK, "")  # never bound: its end closes nothing
        assert in_band(first.ask(match=pb.MatchRequest(session=a.id))) == (C.OK, "")
    finally:
        first.close()
        a.close()


# -- the stream's end --------------------------------------------------------------------

def test_stream_end_closes_the_session(raw):
    a = RawSession(raw, "end/a")
    a.insert(tokens(0, 2), [0, 1])
    s = RawStream(raw)
    reply = s.ask(match=pb.MatchRequest(session=a.id, prompts=[pb.Prompt(tokens=tokens(0, 2))], lease=True))
    assert reply.match.results[0].lease
    assert raw.Stats(pb.StatsRequest(namespace="end/a")).namespaces[0].leases == 1
    assert s.close() == (C.OK, "")
    wait_for(lambda: raw.Stats(pb.StatsRequest()).sessions == 0, 10, "the session closed")
    ns = raw.Stats(pb.StatsRequest(namespace="end/a")).namespaces[0]
    assert (ns.leases, ns.attached) == (0, False)
    code, message = status(lambda: raw.Match(pb.MatchRequest(session=a.id)))
    assert code == C.UNAUTHENTICATED and "was closed (session stream ended)" in message
    a.close()


def test_client_close_and_recovery_after_a_restart(daemon_factory):
    d = daemon_factory()
    e = EngineDouble(LAYOUT, 32)
    e.register(Client(d.target, timeout=10, stream=True, reconnect=Backoff(0.01, 0.1)), "rec/a")
    try:
        e.prefill(prompt(1, 2))
        d.stop()
        d.start()
        with pytest.raises(errors.RadixKVError) as first:
            e.client.match([pack(prompt(1, 2))])  # the stream is gone with the daemon
        lost = first.value if isinstance(first.value, errors.SessionLost) else e.client.reconnect(10)
        assert isinstance(lost, errors.DaemonRestarted), first.value
        e.forget_cache()
        [m] = e.client.match([pack(prompt(1, 2))])  # on the new session's stream
        assert m.device_tokens == 0
        e.prefill(prompt(1, 2))
        assert e.load(prompt(1, 2)) == (8, (0, 0))
    finally:
        e.close()
    wait_for(lambda: stub_for(d.target)[1].Stats(pb.StatsRequest()).sessions == 0, 10, "no session left")


def test_async_deadline_ends_the_stream_and_recovery_follows(daemon_factory):
    """An Evict waiting for a slowed write-back outlives the call's timeout: it raises
    DeadlineExceeded, the stream (and so the session) ends, and the client registers
    again on the next call."""
    d = daemon_factory("--fault-copy-delay", "2", "--write-policy", "write_back")

    async def run():
        engine = EngineDouble(LAYOUT, 32)
        c = AsyncClient(d.target, timeout=10, stream=True, reconnect=Backoff(0.01, 0.1))
        try:
            await c.register("late/a", LAYOUT, engine.buffers.specs, 32, write_policy="write_back")
            await c.insert(pack(prompt(1, 2)), [0, 1])
            c.timeout = 0.5
            with pytest.raises(errors.DeadlineExceeded, match="no answer on the session stream within 0.5s"):
                await c.evict(2)  # write_back: copies both pages to host first, slowed
            c.timeout = 10
            with pytest.raises(errors.RadixKVError) as first:
                await c.match([pack(prompt(1, 2))])
            lost = first.value if isinstance(first.value, errors.SessionLost) else await c.reconnect(10)
            assert type(lost) is errors.SessionLost, first.value
            assert [r.device_tokens for r in await c.match([pack(prompt(1, 2))])] == [0]
        finally:
            await c.close()
            engine.buffers.close()
    asyncio.run(run())


def test_daemon_shutdown_ends_the_stream(daemon_factory):
    d = daemon_factory()
    channel, stub = stub_for(d.target)
    a = RawSession(stub, "stop/a")
    s = RawStream(stub)
    assert in_band(s.ask(match=pb.MatchRequest(session=a.id))) == (C.OK, "")
    assert d.stop() == 0
    end = s.reply()
    assert end[:2] == ("end", C.UNAVAILABLE) and "shutting down" in end[2], end
    channel.close()


def test_start_match_answers_as_match_without_waiting_and_fails_as_a_value(daemon_factory):
    """`Client.start_match` (a lookup an engine does not wait for): the same results as `match`,
    several in flight at once; None where a call cannot go on the stream (unary client,
    not registered, closed); once the daemon is gone, the Future holds the error (the
    caller falls back to `match`, which recovers), never a hang."""
    d = daemon_factory()
    assert Client(d.target, timeout=10, stream=True).start_match([pack(prompt(1, 2))]) is None, "not registered"
    e = EngineDouble(LAYOUT, 32)
    # No reconnect: the session is never marked lost, so a Match after the daemon left is
    # always sent, and its Future must hold the stream's end (a lost session gives None).
    e.register(Client(d.target, timeout=10, stream=True, reconnect=None), "start/a")
    unary = EngineDouble(LAYOUT, 32)
    unary.register(Client(d.target, timeout=10), "start/b")
    try:
        assert unary.client.start_match([pack(prompt(1, 2))]) is None, "no session stream"
        e.prefill(prompt(1, 2))
        prompts = [pack(prompt(1, 2)), pack(prompt(2, 2))]
        futures = [e.client.start_match(prompts, lease=True) for _ in range(4)]
        answers = [f.result(timeout=10) for f in futures]
        want = e.client.match(prompts)
        for got in answers:
            assert [(r.device_tokens, list(r.device_pages)) for r in got] == \
                   [(r.device_tokens, list(r.device_pages)) for r in want]
            assert got[0].lease and not got[1].lease, "a lease where a path matched"
            e.client.release([r.lease for r in got])
        d.stop()
        late = e.client.start_match(prompts)
        assert late is not None and isinstance(late.result(timeout=10), errors.RadixKVError)
    finally:
        e.close()
        unary.close()
    assert e.client.start_match(prompts) is None, "closed"


def test_a_cancelled_stream_call_raises_cancelled_even_when_its_answer_had_come(daemon_factory):
    """`task.cancel()` on a call whose answer arrived before the task ran again: the task
    still ends cancelled (a shutdown that cancels the engine's tasks must not find one
    returning as if nothing happened)."""
    d = daemon_factory()

    async def scenario():
        c = AsyncClient(d.target, timeout=5, stream=True)
        buffers = ShmKvBuffers.create(LAYOUT, 32)
        await c.register("cancel/answered", LAYOUT, buffers.specs(), 32)
        returned = cancelled = 0
        try:
            for _ in range(200):
                reader = asyncio.create_task(c.echo(b"r"))
                await asyncio.sleep(0)
                victim = asyncio.create_task(c.echo(b"v"))
                accepted = []  # cancel the victim as the reader resolves its answer
                reader.add_done_callback(lambda _t, v=victim: accepted.append(v.cancel()))
                got = await asyncio.gather(reader, victim, return_exceptions=True)
                if accepted == [True]:
                    returned += got[1] == b"v"
                    cancelled += isinstance(got[1], asyncio.CancelledError)
                if c.session_lost:
                    await c.reconnect()
        finally:
            await c.close()
            buffers.close()
        assert returned == 0 and cancelled > 0, (returned, cancelled)

    asyncio.run(scenario())

