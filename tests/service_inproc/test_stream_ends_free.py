"""A stream the daemon ends with a status (its session replaced, closed by another call, the
daemon stopping) is freed when its call ends, by reference counting. Kept in a reference
cycle through the error it raised, each held its gRPC call context and session until the
cyclic collector ran: every engine restart left one. The collector is off while it checks."""

import asyncio
import gc
import weakref

import grpc
import pytest
from radixkv.v1 import radixkv_pb2 as pb
from radixkv_server.service.acks import AckStream
from radixkv_server.service.session_stream import SessionStream

from tests.service_inproc.inproc import Engine, run, running_daemon, until


class Context:
    """The gRPC call as a stream handler sees it: the engine's requests, and its answers."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.written = []

    async def read(self):
        return await self.inbox.get()

    async def write(self, reply) -> None:
        self.written.append(reply)


def first_request(kind: str, session: str):
    if kind == "acks":
        return pb.AckRequest(session=session, transfer=0)
    return pb.SessionRequest(id=1, match=pb.MatchRequest(session=session))


@pytest.mark.parametrize("kind", ["acks", "session"])
def test_a_stream_ended_by_its_sessions_close_is_freed_without_the_collector(kind):
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, f"t/{kind}-end")
            gc.collect()
            gc.disable()
            try:
                context = Context()
                stream = (AckStream if kind == "acks" else SessionStream)(daemon, context)
                call = asyncio.create_task(stream.run())
                context.inbox.put_nowait(first_request(kind, e.session.id))
                await until(lambda: stream.session is not None, "the stream bound by its first request")
                alive = weakref.ref(stream)
                del stream
                await daemon.close_session(e.session, "replaced by another engine", replaced=True)
                code = None
                try:
                    await call
                except Exception as ended:  # (the name is unbound after this block)
                    code = ended.code
                assert code == grpc.StatusCode.FAILED_PRECONDITION
                del call
                for _ in range(100):  # the tasks it cancelled end on the loop's next turns
                    if alive() is None:
                        break
                    await asyncio.sleep(0)
                assert alive() is None, "the ended stream waits for the cyclic garbage collector"
            finally:
                gc.enable()
                e.buffers.close()
    run(scenario())
