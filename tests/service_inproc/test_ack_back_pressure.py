"""The Acks stream's back-pressure, observed where it happens: with `max_acks_in_flight`
acks unanswered, the daemon stops reading the engine's stream (the 9th ack is not read
while 8 answers wait to be written), and reads on once the engine takes its answers.

The real `AckStream` of a real in-process Daemon; only the gRPC call's context is this
file's `Engine side`: its read() hands out the engine's acks and counts them, its
write() blocks until the engine reads (as a full HTTP/2 window would). A process test
cannot see which ack the daemon's handler has read: gRPC buffers bytes in between.
"""

import asyncio
import time

import grpc
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from radixkv_server.service.acks import AckStream

from tests.service_inproc.inproc import NUM_PAGES, Engine, prompt, run, running_daemon, until

LIMIT = 8
SENT = 20


class EngineSide:
    """The stream as the handler sees it: `reads` acks taken so far, `written` answers."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.reads = 0
        self.written: list[pb.AckResponse] = []
        self.reading = asyncio.Event()  # the engine reads its answers (writes complete)
        self.blocked_writes = 0

    async def read(self):
        item = await self.inbox.get()
        if item is not grpc.aio.EOF:
            self.reads += 1
        return item

    async def write(self, reply: pb.AckResponse) -> None:
        if not self.reading.is_set():
            self.blocked_writes += 1
            await self.reading.wait()
            self.blocked_writes -= 1
        self.written.append(reply)


def test_the_daemon_stops_reading_at_the_limit_and_resumes_when_answers_are_read():
    async def scenario():
        async with running_daemon(max_acks_in_flight=LIMIT) as daemon:
            e = await Engine.register(daemon, "t/back-pressure")
            side = EngineSide()
            stream = AckStream(daemon, side)
            handler = asyncio.create_task(stream.run())
            side.inbox.put_nowait(pb.AckRequest(session=e.session.id, transfer=0))  # opens; holds no slot
            for t in range(1, SENT + 1):
                side.inbox.put_nowait(pb.AckRequest(session=e.session.id, transfer=100 + t))
            # Every ack read is answered at once (NOT_FOUND); the answers cannot be written.
            await until(lambda: side.reads == 1 + LIMIT and not stream.acks and side.blocked_writes == 1,
                        f"{LIMIT} acks read and answered, the first answer's write blocked")
            for _ in range(200):  # the loop has every chance to read more: it must not
                await asyncio.sleep(0)
            assert side.reads == 1 + LIMIT, f"read {side.reads - 1} acks with {LIMIT} answers unwritten"
            assert side.inbox.qsize() == SENT - LIMIT and side.written == []
            side.reading.set()  # the engine reads: the daemon reads on
            await until(lambda: len(side.written) == SENT, "every ack answered")
            assert side.reads == 1 + SENT
            assert [r.transfer for r in side.written] == [100 + t for t in range(1, SENT + 1)]
            assert {r.code for r in side.written} == {grpc.StatusCode.NOT_FOUND.value[0]}
            side.inbox.put_nowait(grpc.aio.EOF)  # the engine half-closes: the session ends
            await asyncio.wait_for(handler, 10)
    run(scenario())


def test_expiries_pushed_to_an_engine_that_stopped_reading_stay_bounded():
    # --ack-timeout exists for the stuck engine: one that still calls LoadBack but no longer
    # reads its ack stream. Each expiry pushed it an answer that waited in the daemon for
    # as long as the session lived; now at most LIMIT wait, and an expired transfer's ack
    # still gets its answer.
    async def scenario():
        async with running_daemon(max_acks_in_flight=LIMIT, ack_timeout=60) as daemon:
            e = await Engine.register(daemon, "t/stuck-reader")
            side = EngineSide()
            stream = AckStream(daemon, side)
            handler = asyncio.create_task(stream.run())
            side.inbox.put_nowait(pb.AckRequest(session=e.session.id, transfer=0))
            await e.insert(prompt(0, 4), [0, 1, 2, 3])
            expired = []
            for _ in range(3 * LIMIT):
                await e.evict(NUM_PAGES)  # what the last load brought back, to the host again
                m = await e.match(prompt(0, 4))
                load = await e.ns.load_back(e.session, m.result.host_node, pack([4, 5, 6, 7]))
                tid = load.result.transfer
                await until(lambda: e.ns.cache.transfers[tid].copied, "the load's copy")
                daemon.expiry.expire(time.monotonic() + 120)
                await until(lambda: tid not in e.ns.cache.transfers, "the daemon finishing it at its ack timeout")
                expired.append(tid)
            assert stream.replies.qsize() <= LIMIT, f"{stream.replies.qsize()} pushes wait for a stuck engine"
            side.reading.set()  # the engine reads again, and acks the last load
            side.inbox.put_nowait(pb.AckRequest(session=e.session.id, transfer=expired[-1]))
            await until(lambda: any(not r.unsolicited for r in side.written), "the late ack's answer")
            pushed = [r.transfer for r in side.written if r.unsolicited]
            assert pushed == expired[:len(pushed)] and len(pushed) <= LIMIT + 1  # + the one being written
            [late] = [r for r in side.written if not r.unsolicited]
            assert (late.transfer, late.expired, late.code) == (expired[-1], True, grpc.StatusCode.NOT_FOUND.value[0])
            side.inbox.put_nowait(grpc.aio.EOF)
            await asyncio.wait_for(handler, 10)
    run(scenario())
