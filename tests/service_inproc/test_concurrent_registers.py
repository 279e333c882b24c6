"""Registers of different namespaces run side by side (each holds only its namespace's
lock while its device buffers open and its host pool is allocated), yet the daemon's
limits hold as if they ran one at a time: a Register admitted and not done yet counts
against --max-sessions, --max-namespaces and the host memory budget, and so does a pool
being freed. A change of one namespace (a drop, a Register) waits for the one under
way on that namespace only."""

import asyncio
import contextlib

import pytest

from radixkv_server.service import reasons
from radixkv_server.service.errors import ServiceError

from tests.service_inproc.inproc import HOST_PAGES, LAYOUT, Engine, run, running_daemon, until

NAMESPACES = ["t/a", "t/b", "t/c", "t/d"]
POOL_BYTES = HOST_PAGES * LAYOUT.page_bytes
ANSWER_S = 10.0  # a Register another namespace's change must not hold


async def register_all(daemon, names):
    """Every Register at once; (engines registered, refusals)."""
    outcomes = await asyncio.gather(*(Engine.register(daemon, n) for n in names), return_exceptions=True)
    for outcome in outcomes:
        if not isinstance(outcome, (Engine, ServiceError)):
            raise outcome
    return ([o for o in outcomes if isinstance(o, Engine)], [o for o in outcomes if isinstance(o, ServiceError)])


@contextlib.contextmanager
def slow_close(ns):
    """Namespace `ns`'s close waits for the event yielded (a large pool being unpinned)."""
    freed, close = asyncio.Event(), ns.close

    async def gated():
        await freed.wait()
        await close()

    ns.close = gated
    try:
        yield freed
    finally:
        freed.set()


@pytest.mark.parametrize("limit, reason", [
    ({"max_sessions": 2}, reasons.LIMIT_REACHED),
    ({"max_namespaces": 2}, reasons.LIMIT_REACHED),
    ({"max_host_memory": 2 * POOL_BYTES}, reasons.HOST_MEMORY_BUDGET),
])
def test_registers_at_once_take_no_more_than_the_limit(limit, reason):
    async def scenario():
        async with running_daemon(reclaim_detached_after=0, **limit) as daemon:
            engines, refused = await register_all(daemon, NAMESPACES)
            assert len(engines) == 2 and [e.reason for e in refused] == [reason, reason]
            assert len(daemon.sessions) == len(daemon.namespaces) == 2
            assert daemon.locks.sessions() == 0 and daemon.locks.pools() == {}  # nothing left reserved
            await engines[0].close()
            await daemon.drop_namespace(engines[0].ns.name)
            again, refused = await register_all(daemon, [n for n in NAMESPACES if n not in daemon.namespaces])
            assert len(again) == 1 and len(refused) == 2
            for e in engines[1:] + again:
                await e.close()
    run(scenario())


def test_a_pool_being_freed_counts_against_the_budget_until_it_is():
    async def scenario():
        async with running_daemon(max_host_memory=POOL_BYTES, reclaim_detached_after=0) as daemon:
            first = await Engine.register(daemon, "t/a")
            await first.close()
            with slow_close(first.ns) as freed:
                drop = asyncio.ensure_future(daemon.drop_namespace("t/a"))
                await until(lambda: "t/a" not in daemon.namespaces, "the drop to take t/a out of the registry")
                with pytest.raises(ServiceError) as refused:  # both pools would exist for a moment
                    await asyncio.wait_for(Engine.register(daemon, "t/b"), ANSWER_S)
                assert refused.value.reason == reasons.HOST_MEMORY_BUDGET and "t/b" not in daemon.namespaces
                freed.set()
                await drop
            second = await Engine.register(daemon, "t/b")
            await second.close()
    run(scenario())


def test_a_register_waits_for_the_drop_of_its_namespace_only():
    async def scenario():
        async with running_daemon() as daemon:
            first = await Engine.register(daemon, "t/a")
            await first.close()
            with slow_close(first.ns) as freed:
                drop = asyncio.ensure_future(daemon.drop_namespace("t/a"))
                await until(lambda: "t/a" not in daemon.namespaces, "the drop to take t/a out of the registry")
                same = asyncio.ensure_future(Engine.register(daemon, "t/a"))
                other = await asyncio.wait_for(Engine.register(daemon, "t/b"), ANSWER_S)  # while t/a's drop is under way
                assert not same.done() and not drop.done()
                freed.set()
                await drop
                again = await same
            assert again.ns is not first.ns and sorted(daemon.namespaces) == ["t/a", "t/b"]
            for e in (other, again):
                await e.close()
    run(scenario())
