"""A namespace's host pages hold each device page's parts in the order its first engine's
buffers split them (K and V of each layer apart, or one buffer per layer holding both).
An engine that splits its pages otherwise, with the same layout and model, reads another
byte order from those host pages; it is refused FAILED_PRECONDITION. Before, such a
re-Register was accepted warm and served 16 host tokens in the wrong byte order (found
by a review from a non-Python engine's seat)."""

import grpc
import pytest
from radixkv.kvbuffers import ShmKvBuffers
from radixkv_server.service.errors import ServiceError
from radixkv_server.service.registration import Registration

from tests.service_inproc.engine_ranks import Rank, describe
from tests.service_inproc.inproc import LAYOUT, NUM_PAGES, run, running_daemon


async def register_managed(daemon, namespace: str, kind: str):
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    try:
        done = await daemon.register(Registration(
            namespace=namespace, layout=LAYOUT, backend="shm", device=0, buffers=describe(buffers, kind),
            num_device_pages=NUM_PAGES, replace_existing=True))
    except BaseException:
        buffers.close()
        raise
    return done.session, buffers


def test_a_managed_engine_splitting_its_pages_otherwise_is_refused():
    async def scenario():
        async with running_daemon() as daemon:
            session, buffers = await register_managed(daemon, "t/geometry", "sglang")  # 2 x layers parts
            await daemon.close_session(session, "the engine restarts")
            buffers.close()
            again, buffers = await register_managed(daemon, "t/geometry", "flashinfer")  # the same parts, strided
            await daemon.close_session(again, "the engine restarts")
            buffers.close()
            with pytest.raises(ServiceError) as refused:
                await register_managed(daemon, "t/geometry", "vllm")  # one part per layer
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "split over 4 buffers of 256 bytes; these buffers split them 2 x 512" in str(refused.value)
    run(scenario())


def test_an_engine_rank_splitting_its_pages_otherwise_is_refused():
    async def scenario():
        async with running_daemon() as daemon:
            scheduler = await Rank.register(daemon, "t/geometry-em", role="scheduler", tp_size=2)
            first = await Rank.register(daemon, "t/geometry-em", tp_rank=0, tp_size=2, kind="vllm")
            with pytest.raises(ServiceError) as refused:
                await Rank.register(daemon, "t/geometry-em", tp_rank=1, tp_size=2, kind="sglang", instance="b")
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            second = await Rank.register(daemon, "t/geometry-em", tp_rank=1, tp_size=2, kind="vllm")
            for rank in (scheduler, first, second):
                await rank.close()
    run(scenario())
