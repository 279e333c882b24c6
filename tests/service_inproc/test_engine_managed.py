"""Engine-managed namespaces (vLLM): the rules of sharing one namespace between engine
instances and tensor-parallel ranks, in process (real Daemon, real shm copies)."""

import dataclasses

import grpc
import pytest
from radixkv.types import pack
from radixkv_server.service.errors import ServiceError

from engine_ranks import Rank
from inproc import LAYOUT, prompt, run, running_daemon


def code(excinfo) -> grpc.StatusCode:
    return excinfo.value.code


def test_a_second_instance_loads_what_the_first_saved_in_any_layout():
    async def scenario():
        async with running_daemon() as daemon:
            a = await Rank.register(daemon, "m", kind="flashinfer", instance="a")
            b = await Rank.register(daemon, "m", kind="flashinfer", instance="b")
            sched_b = await Rank.register(daemon, "m", role="scheduler", instance="b")
            tokens = prompt(0, 3)
            a.fill([3, 4, 5], seed=1)
            saved = await a.save(tokens, [3, 4, 5])
            assert saved.transfer and saved.result.cached_tokens == 0
            assert (await a.ack(saved.transfer)).error is None
            hit = await sched_b.match(tokens)
            assert (hit.result.device_tokens, hit.result.host_tokens, hit.complete_tokens) == (0, 12, 12)
            loaded = await b.load(hit.result.host_node, [20, 21, 22], lease=hit.lease)
            assert loaded.loaded_tokens == 12 and (await b.ack(loaded.transfer)).error is None
            assert b.page_bytes([20, 21, 22]) == a.page_bytes([3, 4, 5]), "instance b got a's bytes"
            page = 3 * 4 * LAYOUT.chunk_bytes
            assert (a.ns.copies.backed_up_bytes, a.ns.copies.loaded_bytes) == (page, page), "Stats count rank copies"
            again = await b.save(tokens, [20, 21, 22])
            assert again.transfer == 0 and again.result.cached_tokens == 12, "already on host: nothing copied"
            sched_b.ns.release(sched_b.session, [hit.lease])
            assert daemon.check_invariants("") == []
            for r in (a, b, sched_b):
                await r.close()
    run(scenario())


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_other_layouts_round_trip_and_start_page_skips_what_the_engine_holds(kind):
    async def scenario():
        async with running_daemon() as daemon:
            eng = await Rank.register(daemon, "m", kind=kind)
            tokens = prompt(100, 4)
            eng.fill([0, 1, 2, 3], seed=9)
            assert (await eng.ack((await eng.save(tokens, [0, 1, 2, 3])).transfer)).error is None
            hit = await eng.match(tokens)
            loaded = await eng.load(hit.result.host_node, [10, 11, 12], lease=hit.lease, start_page=2)
            assert (loaded.loaded_tokens, loaded.device_tokens, loaded.unused_pages) == (8, 16, pack([12]))
            await eng.ack(loaded.transfer)
            assert eng.page_bytes([10, 11]) == eng.page_bytes([2, 3])
            await eng.close()
    run(scenario())


def test_tensor_parallel_prefix_hits_only_when_every_rank_saved_and_each_rank_loads_its_shard():
    async def scenario():
        async with running_daemon() as daemon:
            r0 = await Rank.register(daemon, "m", tp_rank=0, tp_size=2)
            r1 = await Rank.register(daemon, "m", tp_rank=1, tp_size=2)
            sched = await Rank.register(daemon, "m", role="scheduler", tp_size=2)
            tokens = prompt(0, 2)
            r0.fill([0, 1], seed=5)
            r1.fill([0, 1], seed=5)
            await r0.ack((await r0.save(tokens, [0, 1])).transfer)
            half = await sched.match(tokens, lease=False)
            assert (half.result.host_tokens, half.complete_tokens) == (8, 0), "rank 1's shard is missing"
            await r1.ack((await r1.save(tokens, [0, 1])).transfer)
            hit = await sched.match(tokens)
            assert hit.complete_tokens == 8
            for r in (r0, r1):
                loaded = await r.load(hit.result.host_node, [30, 31], lease=hit.lease)
                assert (await r.ack(loaded.transfer)).error is None
                assert r.page_bytes([30, 31]) == r.page_bytes([0, 1]), f"rank {r.session.rank} got its own shard"
            assert r0.page_bytes([30]) != r1.page_bytes([30])
            assert daemon.check_invariants("") == []
    run(scenario())


@pytest.mark.parametrize("start_page", [0, 1])
def test_a_load_spanning_several_saved_nodes_copies_every_page(start_page):
    """Saves of a growing prompt (as vLLM saves a chunked prefill) leave the path in
    several nodes; one load from `start_page` copies all of it, not just the first node."""
    async def scenario():
        async with running_daemon() as daemon:
            eng = await Rank.register(daemon, "m")
            tokens = prompt(0, 6)
            eng.fill(list(range(6)), seed=3)
            for end in (2, 4, 6):  # three nodes: pages 0-1, 2-3, 4-5
                saved = await eng.save(tokens[:end * 4 * 4], list(range(end)))
                assert (await eng.ack(saved.transfer)).error is None
            hit = await eng.match(tokens)
            assert hit.complete_tokens == 24
            blocks = list(range(20, 26 - start_page))
            loaded = await eng.load(hit.result.host_node, blocks, lease=hit.lease, start_page=start_page)
            assert (loaded.loaded_tokens, loaded.device_tokens) == ((6 - start_page) * 4, 24)
            assert (await eng.ack(loaded.transfer)).error is None
            assert eng.page_bytes(blocks) == eng.page_bytes(list(range(start_page, 6)))
            eng.ns.release(eng.session, [hit.lease])
            assert daemon.check_invariants("") == []
            await eng.close()
    run(scenario())


def test_a_session_end_releases_only_its_own_leases_and_transfers():
    async def scenario():
        async with running_daemon() as daemon:
            eng = await Rank.register(daemon, "m")
            other = await Rank.register(daemon, "m", instance="b")
            s1 = await Rank.register(daemon, "m", role="scheduler")
            s2 = await Rank.register(daemon, "m", role="scheduler", instance="b")
            tokens = prompt(0, 2)
            await eng.ack((await eng.save(tokens, [0, 1])).transfer)
            h1, h2 = await s1.match(tokens), await s2.match(tokens)
            pending = await other.load(h2.result.host_node, [5, 6], lease=h2.lease)
            await s1.close()
            await eng.close()
            assert h2.lease in s2.session.leases and h1.lease not in s2.session.leases
            assert (await other.ack(pending.transfer)).error is None, "another session's load survives"
            node = eng.ns.cache.node(h2.result.host_node)
            assert node.full.lock_ref == 1, "only s2's lease still locks the path"
            s2.ns.release(s2.session, [h2.lease])
            assert daemon.check_invariants("") == []
    run(scenario())


def test_evict_and_scheduler_saves_are_refused_with_clear_errors():
    async def scenario():
        async with running_daemon() as daemon:
            eng = await Rank.register(daemon, "m")
            sched = await Rank.register(daemon, "m", role="scheduler")
            with pytest.raises(ServiceError, match="engine-managed") as e:
                await eng.ns.evict(eng.session, 4)
            assert code(e) == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(ServiceError, match="ENGINE session") as e:
                await sched.save(prompt(0, 1), [0])
            assert code(e) == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(ServiceError, match="out of range") as e:
                await eng.save(prompt(0, 1), [999])
            assert code(e) == grpc.StatusCode.INVALID_ARGUMENT
    run(scenario())


@pytest.mark.parametrize("change,message", [
    (dict(tp_size=2), "tp_size"),
    (dict(layout=dataclasses.replace(LAYOUT, head_dim=32)), "another layout"),
])
def test_a_session_with_another_layout_or_tp_size_is_refused(change, message):
    async def scenario():
        async with running_daemon() as daemon:
            await Rank.register(daemon, "m")
            with pytest.raises(ServiceError, match=message) as e:
                await Rank.register(daemon, "m", role="scheduler", **change)
            assert code(e) == grpc.StatusCode.FAILED_PRECONDITION
    run(scenario())


def test_managed_and_engine_managed_sessions_do_not_mix():
    from inproc import Engine

    async def scenario():
        async with running_daemon() as daemon:
            await Rank.register(daemon, "m")
            with pytest.raises(ServiceError, match="other device tier") as e:
                await Engine.register(daemon, "m")
            assert code(e) == grpc.StatusCode.FAILED_PRECONDITION
    run(scenario())


def test_an_injected_load_fault_acks_load_failed_with_its_pages():
    async def scenario():
        async with running_daemon(fault_fail_loads=1.0) as daemon:
            eng = await Rank.register(daemon, "m")
            tokens = prompt(0, 2)
            assert (await eng.ack((await eng.save(tokens, [0, 1])).transfer)).error is None, "saves never fail"
            hit = await eng.match(tokens)
            loaded = await eng.load(hit.result.host_node, [7, 8], lease=hit.lease)
            done = await eng.ack(loaded.transfer)
            assert "injected fault" in done.error and done.failed_pages == pack([7, 8])
            assert daemon.check_invariants("") == []
    run(scenario())


def test_a_waiting_load_answers_once_copied_and_owes_no_ack():
    """LoadBack(wait): the pages hold the bytes when the answer comes, and no ack is due
    (one round trip for vLLM's synchronous loads); a failed copy is an UNAVAILABLE that
    says so; a managed-device namespace refuses the flag."""
    from inproc import Engine

    async def scenario():
        for fault in (0.0, 1.0):
            async with running_daemon(fault_fail_loads=fault) as daemon:
                eng = await Rank.register(daemon, "m")
                tokens = prompt(0, 2)
                eng.fill([0, 1], seed=4)
                assert (await eng.ack((await eng.save(tokens, [0, 1])).transfer)).error is None
                hit = await eng.match(tokens)
                if fault:
                    with pytest.raises(ServiceError, match="injected fault") as e:
                        await eng.load(hit.result.host_node, [7, 8], lease=hit.lease, wait=True)
                    assert code(e) == grpc.StatusCode.UNAVAILABLE
                else:
                    loaded = await eng.load(hit.result.host_node, [7, 8], lease=hit.lease, wait=True)
                    assert (loaded.transfer, loaded.loaded_tokens) == (0, 8)
                    assert eng.page_bytes([7, 8]) == eng.page_bytes([0, 1])
                assert eng.session.unacked == {}, "nothing left to acknowledge"
                assert daemon.check_invariants("") == []
        async with running_daemon() as daemon:
            managed = await Engine.register(daemon, "n")
            with pytest.raises(ServiceError, match="engine-managed") as e:
                await managed.session.namespace.load_back(managed.session, 1, pack([0]), wait=True)
            assert code(e) == grpc.StatusCode.INVALID_ARGUMENT
    run(scenario())


def test_a_synchronous_insert_keeps_what_it_saved_until_it_answers():
    """An engine's synchronous Insert(lease) waits for its copy; another engine's Insert
    that runs between the copy's end and the answer (the loop may run it there) needs host
    room. The saved path stays out of its reach until the first Insert answered: the save
    is answered as done, with its lease, instead of NOT_FOUND for a node evicted meanwhile."""
    from radixkv_server.service.calls import InsertRequest

    async def scenario():
        async with running_daemon(host_pool_size=4 * LAYOUT.page_bytes) as daemon:
            a = await Rank.register(daemon, "m", instance="a")
            b = await Rank.register(daemon, "m", instance="b")
            tier = a.ns.tier
            a.fill([0, 1], seed=1)
            b.fill([0, 1, 2, 3], seed=2)
            copied, squeezed = tier.copied, []

            def copied_then_another_save(transfer, error=None):
                copied(transfer, error)
                if not squeezed:  # b's Insert, run before a's Insert resumes
                    squeezed.append(tier.save(prompt(500, 4), pack([0, 1, 2, 3]), b"", owner=b.session.id, rank=0))

            tier.copied = copied_then_another_save
            answer = await a.ns.insert(a.session, InsertRequest(prompt(0, 2), pack([0, 1]), lease=True))
            tier.copied = copied
            assert squeezed and answer.lease, answer
            hit = await b.match(prompt(0, 2), lease=False)
            assert hit.complete_tokens == 2 * LAYOUT.page_size, "a's save is still there"
            loaded = await b.load(hit.result.host_node, [8, 9], wait=True)
            assert loaded.loaded_tokens == 2 * LAYOUT.page_size and b.page_bytes([8, 9]) == a.page_bytes([0, 1])
            a.ns.release(a.session, [answer.lease])
            assert daemon.check_invariants("") == []
            for r in (a, b):
                await r.close()
    run(scenario())
