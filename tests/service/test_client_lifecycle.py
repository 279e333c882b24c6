"""A client's end against a real daemon: a blocking Client or an AsyncClient dropped
without `close` ends its session once collected (its streams end, so the daemon closes
it and the namespace is free again), and an AsyncClient used on another event loop than
its own says so and still closes its session."""

import asyncio

import pytest

from radixkv import errors
from radixkv.aio import AsyncClient
from radixkv.client import Client
from radixkv.types import pack
from tests.service.test_client_e2e import LAYOUT


def test_a_client_dropped_without_close_ends_its_session(daemon):
    """An engine object (and its Client) dropped without `close`: once collected, its
    streams end and the daemon closes the session, so its leases are released and a
    restarted engine in the same process can register the namespace again."""
    import gc

    from radixkv.kvbuffers import ShmKvBuffers
    from tests.support.daemon import wait_for
    buffers = ShmKvBuffers.create(LAYOUT, 16)
    try:
        def engine():
            c = Client(daemon, timeout=10)
            c.register("dropped/ns", LAYOUT, buffers.specs(), 16, host_pool_pages=16)
            c.insert(pack(range(8)), [1, 2])
            [m] = c.match([pack(range(8))], lease=True)
            assert m.lease

        engine()
        gc.collect()
        with Client(daemon, timeout=10) as operator:
            wait_for(lambda: operator.stats("dropped/ns").sessions == 0, 10, "the session closed")
        with Client(daemon, timeout=10) as again:
            again.register("dropped/ns", LAYOUT, buffers.specs(), 16, host_pool_pages=16)
            [ns] = again.stats("dropped/ns").namespaces
            assert ns.leases == 0 and ns.device_pages_held == 0
    finally:
        buffers.close()


def test_an_async_client_dropped_without_close_ends_its_session(daemon):
    """As a blocking Client: an AsyncClient collected without `close` (a request handler
    that crashed) kept its session, so the next engine's Register was refused."""
    import gc

    from radixkv.kvbuffers import ShmKvBuffers
    buffers = ShmKvBuffers.create(LAYOUT, 16)

    async def main():
        async def engine():
            c = AsyncClient(daemon, timeout=10)
            await c.register("dropped/aio", LAYOUT, buffers.specs(), 16, host_pool_pages=16)
            await c.insert(pack(range(8)), [1, 2])
            [m] = await c.match([pack(range(8))], lease=True)
            assert m.lease

        await engine()
        gc.collect()
        async with AsyncClient(daemon, timeout=10) as again:
            for _ in range(500):  # the dropped client's streams end on this loop's next turns
                if (await again.stats("dropped/aio")).sessions == 0:
                    break
                await asyncio.sleep(0.02)
            await again.register("dropped/aio", LAYOUT, buffers.specs(), 16, host_pool_pages=16)
            [ns] = (await again.stats("dropped/aio")).namespaces
            assert ns.leases == 0 and ns.device_pages_held == 0

    try:
        asyncio.run(main())
    finally:
        buffers.close()


def test_an_async_client_used_on_another_event_loop_says_so_and_closes_without_raising(daemon):
    """An AsyncClient's channel and streams belong to the loop it was first used on: used
    in a second `asyncio.run`, its calls raised raw RuntimeErrors ("Event loop is
    closed"), and so did the `close()` documented never to raise."""
    from radixkv.kvbuffers import ShmKvBuffers
    from tests.support.daemon import wait_for
    buffers = ShmKvBuffers.create(LAYOUT, 16)

    async def first() -> AsyncClient:
        c = AsyncClient(daemon, timeout=10)
        await c.register("loops/ns", LAYOUT, buffers.specs(), 16, host_pool_pages=16)
        return c

    async def second(c: AsyncClient) -> None:
        with pytest.raises(errors.FailedPrecondition, match="belongs to the event loop it was first used on"):
            await c.match([pack(range(4))])
        await c.close()

    try:
        c = asyncio.run(first())
        asyncio.run(second(c))
        with Client(daemon, timeout=10) as operator:  # its streams ended: the daemon closed the session
            wait_for(lambda: operator.stats("loops/ns").sessions == 0, 10, "the session closed")
    finally:
        buffers.close()
