"""A session the daemon closes while its engine still holds its streams open (a Register
with replace_existing took its namespace, or another client closed it by id) ends those
streams, saying why: the engine learns at once that its session is gone, and a replaced
engine that hangs on holds no stream, task or RPC slot in the daemon (with
`--max-concurrent-rpcs`, superseded engines' streams once filled the daemon up)."""

import threading

import grpc
import pytest
from radixkv import errors
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

from tests.support.daemon import wait_for
from tests.support.engine import LAYOUT

NUM_PAGES = 16  # conftest's `buffers`
NAMESPACE = "closed/streams"


@pytest.fixture
def stub(daemon):
    """The generated stub alone, as grpcurl or an engine without the client calls."""
    channel = grpc.insecure_channel(daemon)
    yield pb_grpc.RadixKVStub(channel)
    channel.close()


def register(client: Client, buffers, replace: bool = False) -> None:
    client.register(NAMESPACE, LAYOUT, buffers.specs(), NUM_PAGES, host_pool_pages=16, replace_existing=replace)


@pytest.mark.parametrize("stream", [False, True])
def test_a_replaced_engine_is_told_at_once_and_its_streams_end(daemon, buffers, stream):
    old = Client(daemon, timeout=10, stream=stream)
    new = Client(daemon, timeout=10)
    try:
        register(old, buffers[0])
        register(new, buffers[1], replace=True)
        # No call of the old engine's needed: its streams ended, so it knows.
        wait_for(lambda: old.session_lost, 10, "the replaced engine to see its session end")
        # Its next call registers again, which the namespace's new session refuses, saying both.
        with pytest.raises(errors.FailedPrecondition, match="replaced by a new registration.*attached to a live"):
            old.match([b"\0" * 64])
        assert new.stats(NAMESPACE).sessions == 1
        assert new.check_invariants() == []
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("stream", [False, True])
def test_two_engines_registering_with_replace_existing_do_not_trade_the_namespace(daemon, buffers, stream):
    """Engines register with replace_existing (to take their own namespace back after a
    restart). A replaced one registered again with it too, took the namespace back, the
    other then did the same: the two traded it for as long as both ran, each losing its
    device tier every time. A replaced engine now registers again without it: refused
    while the other's session lives, which keeps its namespace (found by a review from
    an engine's seat)."""
    old = Client(daemon, timeout=10, stream=stream)
    new = Client(daemon, timeout=10)
    try:
        register(old, buffers[0], replace=True)
        register(new, buffers[1], replace=True)  # a restarted engine while the old one still runs
        wait_for(lambda: old.session_lost, 10, "the replaced engine to see its session end")
        refusals = []

        def refused_twice() -> bool:  # each call is an attempt once its backoff allows one
            try:
                old.match([b"\0" * 64])
            except errors.FailedPrecondition as e:
                refusals.append(e)
            except errors.Unavailable:
                pass  # not due yet
            return len(refusals) >= 2
        wait_for(refused_twice, 20, "two refused attempts of the replaced engine")
        assert all("attached to a live session" in str(e) for e in refusals), refusals
        [info] = new.stats(NAMESPACE).namespaces[0].sessions
        assert info.session == new.registration.session
        new.match([b"\0" * 64])  # its session was never taken back
        assert not new.session_lost
    finally:
        old.close()
        new.close()


def test_a_session_closed_by_another_client_is_told_to_its_engine_at_once(daemon, buffers, stub):
    engine = Client(daemon, timeout=10)
    try:
        register(engine, buffers[0])
        # The operator's way (docs/operations.md): Stats lists the session, Close ends it.
        [info] = engine.stats(NAMESPACE).namespaces[0].sessions
        stub.Close(pb.CloseRequest(session=info.session), timeout=10)
        wait_for(lambda: engine.session_lost, 10, "the engine to see its session end")
        with pytest.raises(errors.SessionLost, match="the daemon ended the ack stream"):
            engine.match([b"\0" * 64])
    finally:
        engine.close()


@pytest.mark.parametrize("how", ["replaced", "closed"])
def test_raw_streams_end_failed_precondition_when_replaced_and_ok_after_a_close(daemon, buffers, stub, how):
    new = Client(daemon, timeout=10)
    done = threading.Event()
    try:
        session, acks, calls = open_streams(stub, buffers[0], done)
        if how == "replaced":
            register(new, buffers[1], replace=True)
        else:
            stub.Close(pb.CloseRequest(session=session), timeout=10)
        for call in (acks, calls):
            if how == "replaced":
                with pytest.raises(grpc.RpcError) as ended:
                    list(call)
                assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ended.value
                assert f"session {session} was closed: replaced by a new registration" in ended.value.details()
            else:  # ended by the daemon (an open stream ran into its 10 s deadline before)
                assert list(call) == [] and call.code() == grpc.StatusCode.OK
    finally:
        done.set()
        new.close()


def test_a_raw_stream_ends_aborted_when_its_session_ends_for_another_reason(daemon, buffers, stub):
    """FAILED_PRECONDITION says "replaced: do not take the namespace back"; a session the
    daemon closed because its engine's other stream ended (or a rank of its group, or
    idleness) ended its streams so too, and an engine following the proto stopped using
    the cache. It is ABORTED now: register again (found by a review from the seat of an
    engine written against the proto alone)."""
    done, calls_done = threading.Event(), threading.Event()
    try:
        session, acks, calls = open_streams(stub, buffers[0], done, calls_done)
        calls_done.set()  # the Session stream half-closes: the daemon closes the session
        assert list(calls) == []
        with pytest.raises(grpc.RpcError) as ended:
            list(acks)
        assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value
        assert f"session {session} was closed: session stream ended" in ended.value.details()
    finally:
        done.set()


def test_raw_streams_end_unavailable_when_the_daemon_shuts_down(daemon_factory, buffers):
    """As the proto says: an engine can tell a shutdown (register with its successor)
    from a Close (the Acks stream ended OK, as after a Close, before)."""
    d = daemon_factory()
    channel = grpc.insecure_channel(d.target)
    done = threading.Event()
    try:
        _, acks, calls = open_streams(pb_grpc.RadixKVStub(channel), buffers[0], done)
        assert d.stop() == 0
        for call in (acks, calls):
            with pytest.raises(grpc.RpcError) as ended:
                list(call)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
            assert "the daemon is shutting down" in ended.value.details()
    finally:
        done.set()
        channel.close()


def open_streams(stub, buffers, done: threading.Event, calls_done: threading.Event | None = None):
    """(session, Acks call, Session call): a session registered through the raw stub, both
    its streams bound (each answered once) and held open until `done` (the Session
    stream until `calls_done`, when given)."""
    layout = pb.KvLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                         head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, page_size=LAYOUT.page_size)
    reply = stub.Register(pb.RegisterRequest(
        namespace=NAMESPACE, backend="shm", num_device_pages=NUM_PAGES, layout=layout, host_pool_pages=16,
        buffers=[pb.DeviceBuffer(handle=s.handle, offset=s.offset, size=s.size) for s in buffers.specs()]),
        timeout=10)
    session = reply.session
    unknown = pb.AckRequest(session=session, transfer=12345)
    acks = stub.Acks(held_open([pb.AckRequest(session=session), unknown], done), timeout=10)
    assert next(acks).code == grpc.StatusCode.NOT_FOUND.value[0]  # the Acks stream is bound now
    match = pb.MatchRequest(session=session, prompts=[pb.Prompt(tokens=b"\0" * 64)])
    calls = stub.Session(held_open([pb.SessionRequest(id=1, match=match)], calls_done or done), timeout=10)
    assert next(calls).id == 1  # and so is the Session stream
    return session, acks, calls


def held_open(requests, done: threading.Event):
    """A request stream that sends `requests`, then stays open (no half-close) until `done`."""
    yield from requests
    done.wait(60)


def test_superseded_engines_that_stay_connected_do_not_fill_the_rpc_limit(daemon_factory):
    """Each replaced engine's streams took one of `--max-concurrent-rpcs` for as long as
    its process stayed connected: eight replacements refused every call after."""
    d = daemon_factory("--max-concurrent-rpcs", "8")
    made, clients = [], []
    try:
        for _ in range(12):
            made.append(ShmKvBuffers.create(LAYOUT, NUM_PAGES))
            c = Client(d.target, timeout=10)
            clients.append(c)
            register(c, made[-1], replace=True)  # the one before stays connected
        assert clients[-1].stats(NAMESPACE).sessions == 1
        wait_for(lambda: all(old.session_lost for old in clients[:-1]), 10, "the replaced engines told")
    finally:
        for c in clients:
            c.close()
        for b in made:
            b.close()
