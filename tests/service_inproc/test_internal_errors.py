"""A bug in the daemon (an exception no caller error explains) is answered INTERNAL with
the exception's type only, on every path: a unary call, a Session stream call and an ack.
The exception's text can quote the daemon's memory, paths or another tenant's names; the
ack path sent it whole (found by a review of where statuses are made). The bug is
injected into the namespace, the real stream handlers answer it."""

import asyncio

import grpc
from radixkv.v1 import radixkv_pb2 as pb
from radixkv_server.service.acks import AckStream
from radixkv_server.service.session_stream import SessionStream

from tests.service_inproc.inproc import Engine, run, running_daemon
from tests.service_inproc.test_ack_back_pressure import EngineSide, until

SECRET = "/var/lib/tenant-b/secret-path"


def broken(*args, **kwargs):
    raise RuntimeError(f"bug while reading {SECRET}")


def test_a_bug_in_an_ack_is_answered_internal_without_its_text():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/bug-ack")
            e.session.namespace.ack = broken
            side = EngineSide()
            side.reading.set()
            handler = asyncio.create_task(AckStream(daemon, side).run())
            side.inbox.put_nowait(pb.AckRequest(session=e.session.id, transfer=0))
            side.inbox.put_nowait(pb.AckRequest(session=e.session.id, transfer=7))
            await until(lambda: side.written, "the ack answered")
            (answer,) = side.written
            assert (answer.transfer, answer.code) == (7, grpc.StatusCode.INTERNAL.value[0])
            assert answer.message == "internal error in Acks: RuntimeError"
            side.inbox.put_nowait(grpc.aio.EOF)
            await asyncio.wait_for(handler, 10)
    run(scenario())


def test_a_bug_in_a_session_stream_call_is_answered_internal_without_its_text():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/bug-stream")
            e.session.namespace.match = broken
            stream = SessionStream(daemon, context=None)
            request = pb.SessionRequest(id=3, match=pb.MatchRequest(session=e.session.id,
                                                                    prompts=[pb.Prompt(tokens=b"\0" * 16)]))
            answer = await stream.answer(request)
            assert (answer.id, answer.error.code) == (3, grpc.StatusCode.INTERNAL.value[0])
            assert answer.error.message == "internal error in Match: RuntimeError"
            assert SECRET not in str(answer)
    run(scenario())
