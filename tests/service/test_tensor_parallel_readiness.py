"""When a tensor-parallel managed-device engine's ranks may start: readiness on Register.

Each rank of such an engine registers on its own (one process each, as SGLang starts
them), and rank 0's calls are refused until every rank is in. `wait_for_ranks` lets a
rank's Register answer once the group is whole instead, and every answer names the
ranks still missing, so an engine need not learn readiness by failing calls.
"""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from radixkv import errors
from radixkv.client import Client
from radixkv.messages import register_request
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc
from tests.support.daemon import wait_for
from tests.support.engine import PS, RPC_TIMEOUT_S, prompt
from tests.support.ranked_engine import RankedEngine

WAIT_S = 30.0  # longer than any test here takes: an answer before it is the group's doing
DEADLINE_S = 20.0


def _missing(target: str, namespace: str) -> list[int] | None:
    """The namespace's ranks not registered (None: no such namespace yet)."""
    with Client(target, timeout=RPC_TIMEOUT_S) as c:
        found = [ns for ns in c.stats().namespaces if ns.namespace == namespace]
    return list(found[0].ranks_missing) if found else None


def _rank_zero_waits(pool: ThreadPoolExecutor, target: str, engine: RankedEngine):
    """Rank 0's Register, waiting for its group in `pool`, once the daemon has it in."""
    waiting = pool.submit(engine.register, target, "llama", ranks=[0], wait_for_ranks=WAIT_S)
    missing = list(range(1, engine.tp_size))
    wait_for(lambda: _missing(target, "llama") == missing, DEADLINE_S, "rank 0 to join and wait")
    return waiting


def test_a_waiting_rank_is_answered_once_every_rank_is_in_and_its_calls_are_served(daemon_factory):
    d = daemon_factory()
    engine = RankedEngine(tp_size=3)
    with ThreadPoolExecutor(1) as pool:
        try:
            waiting = _rank_zero_waits(pool, d.target, engine)
            engine.register(d.target, "llama", ranks=[1])
            assert not waiting.done() and engine.ranks[1].registration.ranks_missing == (2,)
            engine.register(d.target, "llama", ranks=[2])
            waiting.result(DEADLINE_S)

            # every rank of a cold namespace hears it cold, whichever came first
            assert [r.registration.warm for r in engine.ranks] == [False] * 3
            assert engine.driver.registration.ranks_missing == ()
            engine.driver.prefill_to_host([prompt(1)])  # served at once: no call failed to learn it
            [m] = engine.driver.client.match([prompt(1)])
            assert m.device_tokens == 8 * PS
            assert engine.driver.client.check_invariants() == []
        finally:
            engine.close()


def test_a_wait_that_runs_out_answers_the_missing_ranks_and_keeps_the_rank_in(daemon_factory):
    d = daemon_factory()
    engine = RankedEngine(tp_size=3)
    try:
        engine.register(d.target, "llama", ranks=[0], wait_for_ranks=0.2)
        assert engine.driver.registration.ranks_missing == (1, 2)
        engine.register(d.target, "llama", ranks=[2, 1])  # no wait: rank 1 completes the group
        assert [r.registration.ranks_missing for r in engine.ranks] == [(1, 2), (), (1,)]
        engine.driver.prefill_to_host([prompt(2)])
        assert engine.driver.load(prompt(2)) == (8 * PS, (0, 0))
    finally:
        engine.close()


def test_every_rank_hears_the_group_warm_and_the_tokens_its_start_dropped(daemon_factory):
    d = daemon_factory()
    first = RankedEngine.connect(d.target, "llama", write_policy="write_back")
    second = RankedEngine(tp_size=2)
    with ThreadPoolExecutor(1) as pool:
        try:
            first.driver.prefill(prompt(4))  # on the device only (write-back): the restart drops it
            # the second engine's rank 1 registers first and waits; rank 0 replaces the first engine
            waiting = pool.submit(second.register, d.target, "llama", ranks=[1], replace_existing=True,
                                  wait_for_ranks=WAIT_S)
            wait_for(lambda: _missing(d.target, "llama") == [0], DEADLINE_S, "rank 1 to replace the old group")
            second.register(d.target, "llama", ranks=[0])
            waiting.result(DEADLINE_S)
            assert [r.registration.warm for r in second.ranks] == [True, True]
            assert [r.registration.dropped_device_tokens for r in second.ranks] == [8 * PS] * 2
            [m] = second.driver.client.match([prompt(4)])
            assert m.device_tokens + m.host_tokens == 0
        finally:
            first.close()
            second.close()


def test_a_group_that_ends_while_a_rank_waits_answers_it_unavailable(daemon_factory):
    d = daemon_factory()
    engine = RankedEngine(tp_size=3)
    with ThreadPoolExecutor(1) as pool:
        try:
            waiting = _rank_zero_waits(pool, d.target, engine)
            engine.register(d.target, "llama", ranks=[1])
            engine.ranks[1].client.close()  # rank 1's process went: its engine's ranks end
            with pytest.raises(errors.Unavailable, match="ranks went before all 3 were in"):
                waiting.result(DEADLINE_S)
            wait_for(lambda: _missing(d.target, "llama") == [0, 1, 2], DEADLINE_S, "the group's sessions to end")

            again = RankedEngine.connect(d.target, "llama", tp_size=3)  # the engine starts again: served
            try:
                again.driver.prefill_to_host([prompt(5)])
                assert again.driver.load(prompt(5)) == (8 * PS, (0, 0))
            finally:
                again.close()
        finally:
            engine.close()


def test_a_rank_whose_caller_leaves_while_it_waits_is_closed_with_its_group(daemon_factory):
    d = daemon_factory()
    engine = RankedEngine(tp_size=2)
    try:
        engine.register(d.target, "llama", ranks=[1])
        with grpc.insecure_channel(d.target) as channel:
            rank0 = engine.driver  # registers for another engine, which replaces rank 1's
            request = register_request(
                "llama", rank0.layout, rank0.buffers.specs, rank0.pool.num_pages, backend="shm", device=0,
                write_policy="", host_pool_pages=0, replace_existing=True, engine="", model="", tp_rank=0,
                tp_size=2, instance="another engine", wait_for_ranks=WAIT_S)
            with pytest.raises(grpc.RpcError) as cut:  # it waits for a rank 1 of its own, until cut
                pb_grpc.RadixKVStub(channel).Register(request, timeout=1.0)
            assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # the session it made (never answered) is closed: no rank is left to hold the namespace
        wait_for(lambda: _missing(d.target, "llama") == [0, 1], DEADLINE_S, "the unanswered rank's session to end")
        fresh = RankedEngine.connect(d.target, "llama")
        try:
            fresh.driver.prefill_to_host([prompt(6)])
            assert fresh.driver.load(prompt(6)) == (8 * PS, (0, 0))
        finally:
            fresh.close()
    finally:
        engine.close()


def test_a_rank_waiting_longer_than_the_idle_session_timeout_is_not_closed_as_idle(daemon_factory):
    """A waiting rank's engine has no session id yet, so it opens no stream and names it
    in no call: --idle-session-timeout closed it (and its group) as an engine that died
    after Register, and the wait answered UNAVAILABLE."""
    d = daemon_factory("--idle-session-timeout", "0.3")
    engine = RankedEngine(tp_size=2)
    try:
        engine.register(d.target, "llama", ranks=[0], wait_for_ranks=2.0)  # several idle checks meanwhile
        assert engine.driver.registration.ranks_missing == (1,)
        engine.register(d.target, "llama", ranks=[1])
        engine.driver.prefill_to_host([prompt(7)])
        assert engine.driver.load(prompt(7)) == (8 * PS, (0, 0))
    finally:
        engine.close()
