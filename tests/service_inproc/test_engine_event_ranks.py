"""The engine's event (issue 19) on an engine-managed namespace (the vLLM connector's
mode): an Insert's or LoadBack's `engine_event` must reach the copy engine of the
session's own rank, whose copies then run after it. Requests go in as the protobuf
messages the servicer and the Session stream hand to `engine_ops`; the device backend is
the real shared-memory one plus a log of the `after` each copy was submitted with."""

import pytest
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from radixkv_server.datapath import BACKENDS
from radixkv_server.datapath.shm import ShmDeviceBuffers
from radixkv_server.service import engine_ops

from engine_ranks import Rank
from inproc import prompt, run, running_daemon

EVENT = {"save": b"\x01" * 64, "load": b"\x02" * 64}  # the size of a CUDA IPC event handle


class LoggingShm(ShmDeviceBuffers):
    """Shared-memory buffers that log (buffers, direction, after) for every copy submitted."""

    def submit_load(self, host_pool, host_pages, device_pages, after=b""):
        SUBMITS.append((self, "load", after))
        return super().submit_load(host_pool, host_pages, device_pages, after)

    def submit_store(self, device_pages, host_pool, host_pages, after=b""):
        SUBMITS.append((self, "store", after))
        return super().submit_store(device_pages, host_pool, host_pages, after)


SUBMITS: list = []
OPENED: list[LoggingShm] = []  # in registration order: one per ENGINE session


def _open_logging(layout, num_pages, specs, device, device_uuid="", owner_uid=None):
    OPENED.append(LoggingShm(layout, num_pages, specs, owner_uid))
    return OPENED[-1]


@pytest.fixture(autouse=True)
def logging_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "shm", _open_logging)
    SUBMITS.clear()
    OPENED.clear()


async def save(rank: Rank, tokens: bytes, pages: list[int], event: bytes = b"") -> None:
    request = pb.InsertRequest(session=rank.session.id, tokens=tokens, device_pages=pack(pages),
                               engine_event=event, **{"async": True})
    answer = await engine_ops.insert(rank.daemon, rank.session, request)
    assert (await rank.ack(answer.transfer)).error is None


def test_each_ranks_engine_event_orders_that_ranks_copies():
    async def scenario():
        async with running_daemon() as daemon:
            r0 = await Rank.register(daemon, "m", tp_rank=0, tp_size=2)
            r1 = await Rank.register(daemon, "m", tp_rank=1, tp_size=2)
            b0, b1 = OPENED
            tokens = prompt(0, 2)
            await save(r0, tokens, [0, 1], EVENT["save"])
            await save(r1, tokens, [0, 1])  # no event: rank 0's (another GPU's stream) must not order it
            assert SUBMITS == [(b0, "store", EVENT["save"]), (b1, "store", b"")]
            hit = await r1.match(tokens)
            request = pb.LoadBackRequest(session=r1.session.id, node=hit.result.host_node,
                                         device_pages=pack([5, 6]), lease=hit.lease, engine_event=EVENT["load"])
            loaded = await engine_ops.load_back(daemon, r1.session, request)
            assert loaded.transfer and (await r1.ack(loaded.transfer)).error is None
            assert SUBMITS[-1] == (b1, "load", EVENT["load"])
            await save(r0, prompt(100, 1), [2])  # no event of its own: still after rank 0's latest one
            assert SUBMITS[-1] == (b0, "store", EVENT["save"])
            r1.ns.release(r1.session, [hit.lease])
            assert daemon.check_invariants("") == []
            for r in (r0, r1):
                await r.close()
    run(scenario())
