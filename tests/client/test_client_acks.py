"""The clients' ack streams against a scripted in-process server (no daemon needed).

What an engine relies on: an answered ack gives the daemon's verdict; waiting again
gives the same outcome without acking twice; a broken stream or an unreachable daemon
gives failed outcomes, never success.
"""

import asyncio
import threading
import time
from concurrent import futures

import grpc
import pytest

from radixkv import errors
from radixkv.aio import AsyncClient
from radixkv.client import Client
from radixkv.layout import KvLayout
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

LAYOUT = KvLayout(1, 1, 8, "float16", 4)
SILENT, BREAK, FAIL, LATE = 777, 666, 13, 42  # never answered / aborts the stream / load failed / once `late` set


class ScriptedDaemon(radixkv_pb2_grpc.RadixKVServicer):
    def __init__(self):
        self.acked: list[int] = []
        self.closed = threading.Event()
        self.late = threading.Event()  # LATE is answered once set

    def Register(self, request, context):
        return pb.RegisterResponse(session="s1", daemon_instance="fake")

    def Close(self, request, context):
        self.closed.set()
        return pb.CloseResponse()

    def LoadBack(self, request, context):
        return pb.LoadBackResponse(transfer=request.node)  # the test picks the transfer id

    def Acks(self, request_iterator, context):
        for req in request_iterator:
            if req.transfer == 0:  # the client opens the stream with it at register
                continue
            self.acked.append(req.transfer)
            if req.session != "s1":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad session")
            if req.transfer == BREAK:
                context.abort(grpc.StatusCode.INTERNAL, "stream torn down")
            if req.transfer == SILENT:
                continue
            if req.transfer == LATE:
                self.late.wait(10)
            if req.transfer == FAIL:
                yield pb.AckResponse(transfer=req.transfer, load_failed=True, message="copy failed",
                                     failed_pages=pack([3, 4]))
            else:
                yield pb.AckResponse(transfer=req.transfer)


@pytest.fixture
def scripted(tmp_path):
    daemon = ScriptedDaemon()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    radixkv_pb2_grpc.add_RadixKVServicer_to_server(daemon, server)
    target = f"unix://{tmp_path}/fake.sock"
    server.add_insecure_port(target)
    server.start()
    yield target, daemon
    server.stop(0)


TRANSFERS = (1, 2, 5, FAIL, SILENT, BREAK, LATE)


def registered(target, timeout: float = 5) -> Client:
    """A client whose session started load-backs with the ids TRANSFERS (a client acks
    only ids its own load-backs returned)."""
    c = Client(target, timeout=timeout)
    c.register("ns", LAYOUT, [("seg", 0, 64)], 4)
    for t in TRANSFERS:
        c.load_back(t, [])
    return c


def test_answers_are_the_daemons_and_kept(scripted):
    target, daemon = scripted
    with registered(target) as c:
        out = c.wait([1, 0, FAIL, 1], timeout=5)
        assert sorted(out) == [1, FAIL]
        assert out[1].ok and out[1].reason == ""
        assert not out[FAIL].ok and out[FAIL].reason == "copy failed" and list(out[FAIL].failed_pages) == [3, 4]
        again = c.wait([FAIL, 2], timeout=5)
        assert again[FAIL] == out[FAIL] and again[2].ok
        assert sorted(daemon.acked) == [1, 2, FAIL]  # each id acked once
    assert daemon.closed.is_set()


def test_a_broken_stream_fails_pending_and_later_waits(scripted):
    target, _ = scripted
    with registered(target) as c:
        out = c.wait([SILENT, BREAK], timeout=5)
        assert not out[SILENT].ok and not out[BREAK].ok
        assert "stream torn down" in out[SILENT].reason
        later = c.wait([5], timeout=5)
        assert not later[5].ok


def test_wait_times_out_then_close_fails_the_unanswered(scripted):
    target, _ = scripted
    c = registered(target)
    with pytest.raises(errors.DeadlineExceeded):
        c.wait([SILENT], timeout=0.2)
    done = {}
    t = threading.Thread(target=lambda: done.update(c.wait([SILENT])))
    t.start()
    c._session.acks()._close_timeout = 0.5  # the scripted daemon never ends its side
    c.close()
    t.join(5)
    assert not done[SILENT].ok
    c.close()  # idempotent
    with pytest.raises(errors.FailedPrecondition):
        c.wait([1])


def test_a_waiter_that_gives_up_leaves_another_waiting_on_the_same_load_to_its_answer(scripted):
    """Two requests may wait on one load; the first giving up (timeout, Ctrl-C) took the
    other's place in the waiting list (equal dicts), so the answer never woke it."""
    target, daemon = scripted
    with futures.ThreadPoolExecutor(1) as pool, registered(target) as c:  # closed first: no wait outlives it
        c._session.acks()._close_timeout = 0.5  # the scripted daemon never ends its side
        other = pool.submit(c.wait, [LATE], timeout=10)
        _poll(lambda: LATE in daemon.acked)  # the other request waits, its ack sent
        with pytest.raises(errors.DeadlineExceeded):
            c.wait([LATE], timeout=0.2)
        daemon.late.set()
        assert other.result(5)[LATE].ok


def test_a_wait_gives_up_after_the_clients_timeout_by_default(scripted):
    """A daemon that keeps its stream open but never answers (frozen) does not hold an
    engine's wait for good: every call waits at most the client's timeout."""
    target, _ = scripted
    with futures.ThreadPoolExecutor(1) as pool, registered(target, timeout=0.3) as c:  # closed first
        c._session.acks()._close_timeout = 0.5  # the scripted daemon never ends its side
        waiting = pool.submit(c.wait, [SILENT])
        with pytest.raises(errors.DeadlineExceeded, match=r"\[777\] not answered within 0.3s"):
            waiting.result(5)


def _poll(cond, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_ids_not_started_by_this_session_are_refused_locally(scripted):
    """After a daemon restart the new daemon numbers transfers from 1 again: an id the
    session's own load-backs did not return must never be acknowledged (it could name
    another load), so it fails at once without reaching the daemon."""
    target, daemon = scripted
    with registered(target) as c:
        out = c.wait([99, 1], timeout=5)
        assert not out[99].ok and "not started by this session" in out[99].reason
        assert out[1].ok and daemon.acked == [1]
        c.load_back(99, [])  # now it is ours: acknowledged normally
        assert c.wait([99], timeout=5)[99].ok and daemon.acked == [1, 99]


def test_unreachable_daemon(tmp_path):
    c = Client(f"unix://{tmp_path}/nobody.sock", timeout=1)
    with pytest.raises(errors.Unavailable):
        c.wait_ready(timeout=0.5)
    with pytest.raises(errors.Unavailable):
        c.register("ns", LAYOUT, [("seg", 0, 64)], 4)
    with pytest.raises(errors.FailedPrecondition):
        c.match([[1, 2, 3, 4]])
    c.close()


def test_async_client_acks(scripted):
    target, daemon = scripted

    async def main():
        async with AsyncClient(target, timeout=5) as c:
            await c.register("ns", LAYOUT, [("seg", 0, 64)], 4)
            for t in TRANSFERS:
                await c.load_back(t, [])
            out = await c.wait([1, FAIL], timeout=5)
            assert out[1].ok and not out[FAIL].ok
            assert (await c.wait([1]))[1] is out[1]
            with pytest.raises(errors.DeadlineExceeded):
                await c.wait([SILENT], timeout=0.2)
            broken = await c.wait([SILENT, BREAK], timeout=5)
            assert not broken[SILENT].ok and not broken[BREAK].ok

    asyncio.run(main())
    assert daemon.acked.count(SILENT) == 1
