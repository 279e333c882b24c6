"""Calls whose callers give up halfway (a gRPC deadline or cancel: the handler is cancelled
at its next `await`), sessions that close under a call, and calls that fail: nothing is
lost or left held. On an in-process daemon (see inproc.py), where a call is cancelled at
exactly the await a deadline would hit.

- An Evict cancelled while it waits for its write-back: the pages it freed left the tree,
  so they come with the session's next Evict (before: gone for good, the engine's pool
  smaller by as many pages).
- A Match with leases cancelled during its storage probe: its leases, whose ids the engine
  never got, are released (before: the paths stayed locked until the session ended).
- An engine-managed Insert(lease) whose session closed while it copied: refused, no lock
  left behind (before: a lock nobody held, its pages never evictable).
- A Register replacing a live session that fails (buffers that cannot be opened): the live
  session is untouched (before: closed first, its device residency dropped).
- Roots of extra keys (LoRA ids, cache salts) whose last node left are dropped (before: one
  root per extra key ever seen, kept for good).
- A default host pool that holds no page of the layout is refused (before: a namespace that
  could cache nothing).
"""

import asyncio
import tempfile

import grpc
import pytest

from radixkv.types import pack, unpack
from radixkv_server.service.calls import InsertRequest, Prompt
from radixkv_server.service.errors import ServiceError, status_of
from radixkv_server.service.registration import Registration
from radixkv_server.storage.open import open_storage

from tests.service_inproc.engine_ranks import Rank
from tests.service_inproc.inproc import (LAYOUT, NUM_PAGES, Engine, cancelled_at_first_await, prompt, run,
                                         running_daemon, until)


def locked_nodes(ns) -> list[int]:
    return [n.id for n in ns.cache.tree.iter_nodes() if n.full.lock_ref]


def test_pages_of_an_evict_whose_caller_gave_up_come_with_the_next_evict():
    async def scenario():
        async with running_daemon(fault_copy_delay=0.05) as daemon:
            e = await Engine.register(daemon, "t/evict", write_policy="write_back")
            await e.insert(prompt(0, 4), [0, 1, 2, 3])  # on device only: evicting writes it back
            await cancelled_at_first_await(e.evict(4))
            again = await e.evict(NUM_PAGES)
            assert sorted(unpack(again.freed_pages)) == [0, 1, 2, 3], "the abandoned Evict's pages"
            assert again.written_back_pages == 4
            assert (await e.match(prompt(0, 4))).result.host_tokens == 16
            assert (await e.evict(NUM_PAGES)).freed_pages == b"", "answered once"
            assert daemon.check_invariants("") == []
    run(scenario())


def test_a_match_cancelled_during_its_storage_probe_holds_no_lease():
    async def scenario():
        with tempfile.TemporaryDirectory() as pages:
            storage = open_storage(f"file://{pages}")
            try:
                async with running_daemon() as daemon:
                    daemon.storage = storage
                    e = await Engine.register(daemon, "t/probe")
                    await e.insert(prompt(0, 4), [0, 1, 2, 3])
                    match = e.ns.match(e.session, [Prompt(prompt(0, 8))], lease=True, include_storage=True)
                    await cancelled_at_first_await(match)
                    assert e.session.leases == {} and locked_nodes(e.ns) == []
                    assert sorted(unpack((await e.evict(4)).freed_pages)) == [0, 1, 2, 3], "nothing holds the path"
                    assert daemon.check_invariants("") == []
            finally:
                storage.close()
    run(scenario())


def test_an_engine_managed_insert_whose_session_closed_meanwhile_takes_no_lease():
    async def scenario():
        async with running_daemon(fault_copy_delay=0.05) as daemon:
            eng = await Rank.register(daemon, "t/em")
            ns = eng.ns
            insert = asyncio.ensure_future(ns.insert(eng.session, InsertRequest(
                prompt(0, 2), pack([0, 1]), lease=True, async_=False)))
            await until(lambda: ns.cache.transfers, "the insert's copy in flight")
            await eng.close()
            with pytest.raises(ServiceError, match="closed while this call waited") as e:
                await insert
            assert status_of(e.value)[0] == grpc.StatusCode.FAILED_PRECONDITION
            assert locked_nodes(ns) == [], "no lock that no session holds"
            other = await Rank.register(daemon, "t/em", instance="b")
            hit = await other.match(prompt(0, 2), lease=False)
            assert hit.result.host_tokens == 8, "the save itself was kept"
            assert daemon.check_invariants("") == []
    run(scenario())


@pytest.mark.parametrize("call", ["save", "load"])
def test_an_engine_managed_page_listed_twice_is_refused(call):
    async def scenario():
        async with running_daemon() as daemon:
            eng = await Rank.register(daemon, "t/dup")
            await eng.ack((await eng.save(prompt(0, 2), [0, 1])).transfer)
            hit = await eng.match(prompt(0, 2))
            with pytest.raises(ServiceError, match="device page 5 is listed twice") as e:
                if call == "save":
                    await eng.save(prompt(100, 2), [5, 5])
                else:
                    await eng.load(hit.result.host_node, [5, 5], lease=hit.lease)
            assert status_of(e.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
            assert (await eng.match(prompt(100, 2), lease=False)).result.host_tokens == 0
            assert daemon.check_invariants("") == []
    run(scenario())


def test_a_failed_replacing_register_leaves_the_live_session_alone():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/replace")
            await e.insert(prompt(0, 4), [0, 1, 2, 3])
            bad = [s._replace(handle=b"no-such-segment") for s in e.buffers.specs()]
            with pytest.raises(ServiceError, match="no-such-segment") as err:
                await daemon.register(Registration(
                    namespace="t/replace", layout=LAYOUT, backend="shm", device=0, buffers=bad,
                    num_device_pages=NUM_PAGES, write_policy="write_back", replace_existing=True))
            assert status_of(err.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
            assert not e.session.closing and e.ns.session is e.session
            assert (await e.match(prompt(0, 4))).result.device_tokens == 16, "its device residency kept"
            assert daemon.check_invariants("") == []
    run(scenario())


def test_roots_of_extra_keys_whose_nodes_all_left_are_dropped():
    async def scenario():
        async with running_daemon(host_pool_size=2 * LAYOUT.page_bytes) as daemon:
            eng = await Rank.register(daemon, "t/salts")
            tree = eng.ns.cache.tree
            for salt in range(200):  # a cache salt per request: each save evicts the last one's page
                extra = b"salt-%d" % salt
                await eng.ack((await eng.ns.insert(eng.session, InsertRequest(
                    prompt(0, 1), pack([0]), extra_key=extra, async_=True))).transfer)
            live = {n.extra_key for n in tree.iter_nodes()}
            assert len(live) <= 2
            assert len(tree.roots) <= len(live) + 2, "the b'' root, the live keys' roots, one emptied since"
            assert daemon.check_invariants("") == []
    run(scenario())


def test_a_host_pool_that_holds_no_page_of_the_layout_is_refused():
    """A pool smaller than one page (a large page at a small --host-pool-size) made a
    namespace that could never cache anything, and Register said OK."""
    async def scenario():
        async with running_daemon(host_pool_size=LAYOUT.page_bytes - 1) as daemon:
            with pytest.raises(ServiceError, match="more than the whole host pool") as e:
                await Engine.register(daemon, "t/tiny")
            assert status_of(e.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert daemon.namespaces == {}
    run(scenario())
