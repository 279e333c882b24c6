"""A tensor-parallel engine's ranks end together: once one rank's session begins
closing, rank 0 starts nothing more, and every rank's buffers are closed when the
group's sessions have ended, whatever rank 0 was doing."""

import asyncio

import grpc
import pytest

from radixkv.types import pack
from radixkv_server.core.pages import unpack
from radixkv_server.service.calls import Prompt
from radixkv_server.service.errors import ServiceError
from tests.service_inproc.inproc import Engine, prompt, run, running_daemon


def test_rank_0_starts_no_load_once_a_rank_left_and_every_ranks_buffers_close():
    async def scenario():
        async with running_daemon(fault_copy_delay=0.2) as daemon:
            driver, other = await _ranks(daemon)
            ns = driver.ns
            await driver.insert(prompt(0, 2), [0, 1])
            await ns.drain()  # the backup
            assert len(unpack((await driver.evict(2)).freed_pages)) == 2
            [m] = await ns.match(driver.session, [Prompt(prompt(0, 2))], False)
            first = await ns.load_back(driver.session, m.result.host_node, pack([2, 3]))
            assert first.result.transfer  # copying for 0.2 s

            daemon.close_in_background(other.session, "rank 1's process went")
            await asyncio.sleep(0)  # one turn of the loop: the close starts, and waits for that load
            assert ns.copies.in_flight(first.result.transfer)
            with pytest.raises(ServiceError) as refused:
                await ns.load_back(driver.session, m.result.host_node, pack([4, 5]))
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION

            for engine in (driver, other):
                await daemon.closed(engine.session)
            assert ns.copies.device is None, "the ranks' buffers (a dead engine's GPU memory) are still open"
            assert not ns.attached
            assert daemon.check_invariants("") == []
            for engine in (driver, other):
                engine.buffers.close()
    run(scenario())


def test_no_ranks_close_ends_while_a_copy_still_reads_the_ranks_pages():
    async def scenario():
        async with running_daemon(fault_copy_delay=0.3) as daemon:
            driver, other = await _ranks(daemon)
            ns = driver.ns
            await driver.insert(prompt(0, 2), [0, 1])
            [backup] = [t for t in ns.cache.transfers if ns.copies.in_flight(t)]  # reads both ranks' pages

            daemon.close_in_background(other.session, "rank 1's process went")  # it detaches the group
            await daemon.close_session(driver.session, "rank 0's Close")  # the engine may reuse its pages now
            assert not ns.copies.in_flight(backup), "rank 0's Close answered while the backup read its pages"
            assert ns.copies.device is None
            for engine in (driver, other):
                await daemon.closed(engine.session)
                engine.buffers.close()
            assert daemon.check_invariants("") == []
    run(scenario())


async def _ranks(daemon) -> list[Engine]:
    """Ranks 0 and 1 of one write-through engine (the policy is the engine's to ask)."""
    return [await Engine.register(daemon, "tp", tp_rank=r, tp_size=2, instance="e", write_policy="write_through")
            for r in (0, 1)]
