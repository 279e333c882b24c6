"""A tensor-parallel engine on one managed-device namespace (SGLang's way: one page table
for every rank), against a real daemon.

Each rank registers its own buffers on the one namespace; rank 0's session makes the
calls; every copy covers every rank, so what comes back to a rank's pages is that
rank's own KV. A rank that leaves ends its engine's sessions, and the host tier stays
for the engine's next start.
"""

import pytest

from radixkv import errors
from radixkv.client import Client
from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble, prompt
from tests.support.ranked_engine import RankedEngine

DEADLINE_S = 20.0


def test_every_rank_gets_its_own_kv_back_from_the_host_tier(daemon_factory):
    d = daemon_factory()
    engine = RankedEngine(tp_size=2)
    try:
        engine.register(d.target, "llama", ranks=[0])
        with pytest.raises(errors.FailedPrecondition, match="waits for rank 1 of 2 to register"):
            engine.driver.client.match([prompt(1)])
        [ns] = engine.driver.client.stats("llama").namespaces
        assert (ns.tp_size, list(ns.ranks_missing)) == (2, [1])  # what an operator sees meanwhile
        engine.register(d.target, "llama", ranks=[1])
        [ns] = engine.driver.client.stats("llama").namespaces
        assert list(ns.ranks_missing) == []
        with pytest.raises(errors.FailedPrecondition, match="rank 0's session makes its calls"):
            engine.ranks[1].client.match([prompt(1)])

        engine.driver.prefill_to_host([prompt(1), prompt(2)])
        engine.driver.evict(engine.driver.pool.num_pages)  # device copies gone; host copies stay
        for rank in engine.ranks:  # nothing of the old bytes is left on any rank
            for b in range(rank.layout.num_buffers):
                rank.page_view(b).fill_(0)
        for i in (1, 2):
            tokens, mismatches = engine.driver.load(prompt(i))
            assert tokens == 8 * PS
            assert mismatches == (0, 0), "a rank holds bytes that are not its own KV of the prompt"
        assert engine.driver.pool.errors == 0
        assert engine.driver.client.check_invariants() == []
    finally:
        engine.close()


def test_a_rank_that_leaves_ends_its_engine_and_the_next_start_is_warm(daemon_factory):
    d = daemon_factory()
    first = RankedEngine.connect(d.target, "llama")
    second = RankedEngine(tp_size=2)
    try:
        first.driver.prefill_to_host([prompt(3)])
        first.ranks[1].client.close()  # rank 1's process went
        wait_for(lambda: not _alive(d.target, first.driver), DEADLINE_S, "rank 0's session to end with rank 1's")

        second.register(d.target, "llama")
        assert second.ranks[1].registration.warm
        assert second.ranks[1].registration.dropped_device_tokens == 0  # the host held every page of it
        [m] = second.driver.client.match([prompt(3)])
        assert (m.device_tokens, m.host_tokens) == (0, 8 * PS)
        assert second.driver.load(prompt(3)) == (8 * PS, (0, 0))
    finally:
        first.close()
        second.close()


def test_ranks_that_do_not_fit_the_engine_are_refused(daemon_factory):
    d = daemon_factory()
    engine = RankedEngine.connect(d.target, "llama", ranks=[0])
    try:
        with pytest.raises(errors.FailedPrecondition, match="share one page table"):
            EngineDouble.connect(d.target, "llama", num_pages=64, tp_rank=1, tp_size=2, instance=engine.instance)
        with pytest.raises(errors.FailedPrecondition, match="shared by tp_size 2 tensor-parallel ranks"):
            EngineDouble.connect(d.target, "llama", tp_rank=1, tp_size=4, instance=engine.instance)
        with pytest.raises(errors.FailedPrecondition, match="shared by tp_size 2 tensor-parallel ranks"):
            EngineDouble.connect(d.target, "llama")
        with pytest.raises(errors.FailedPrecondition, match="rank 0 of namespace llama is attached to a live"):
            EngineDouble.connect(d.target, "llama", tp_rank=0, tp_size=2, instance=engine.instance)
        with pytest.raises(errors.InvalidArgument, match="names its engine in `instance`"):
            EngineDouble.connect(d.target, "llama", tp_rank=1, tp_size=2)  # two engines' ranks must not mix
        restarted = RankedEngine.connect(d.target, "llama", replace_existing=True)  # the old rank 0 goes
        try:
            assert not _alive(d.target, engine.driver)
            restarted.driver.prefill(prompt(4))
            assert restarted.driver.load(prompt(4)) == (8 * PS, (0, 0))
        finally:
            restarted.close()
    finally:
        engine.close()


def test_a_rank_of_another_engine_instance_does_not_join(daemon_factory):
    d = daemon_factory()
    a = RankedEngine.connect(d.target, "llama", ranks=[0], instance="engine-a")
    b = RankedEngine(tp_size=2)
    try:
        with pytest.raises(errors.FailedPrecondition, match="belong to engine instance 'engine-a'"):
            b.register(d.target, "llama", ranks=[1], instance="engine-b")  # would copy into a's page table
        b.register(d.target, "llama", instance="engine-b", replace_existing=True)  # a restarted as b
        assert not _alive(d.target, a.driver)
        b.driver.prefill(prompt(5))
        assert b.driver.load(prompt(5)) == (8 * PS, (0, 0))
    finally:
        a.close()
        b.close()


def test_after_a_daemon_restart_every_rank_registers_again_and_the_group_serves(daemon_factory):
    d = daemon_factory()
    engine = RankedEngine.connect(d.target, "llama")
    try:
        engine.driver.prefill(prompt(6))
        d.kill()
        d.start()
        wait_for(lambda: all(rank.client.session_lost for rank in engine.ranks), DEADLINE_S,
                 "every rank's client to see its stream end")
        for rank in engine.ranks[1:]:  # a rank that makes no calls registers again itself
            assert isinstance(rank.client.reconnect(timeout=DEADLINE_S), errors.DaemonRestarted)
        assert isinstance(engine.driver.client.reconnect(timeout=DEADLINE_S), errors.DaemonRestarted)
        engine.restart()  # the cache died with the daemon: every page is the engine's again
        [m] = engine.driver.client.match([prompt(6)])
        assert (m.device_tokens, m.host_tokens) == (0, 0)
        engine.driver.prefill_to_host([prompt(6)])
        engine.driver.evict(engine.driver.pool.num_pages)
        assert engine.driver.load(prompt(6)) == (8 * PS, (0, 0))
    finally:
        engine.close()


def test_a_new_engine_may_bring_another_page_count_and_a_healthy_rank_answers_the_liveness_probe(daemon_factory):
    d = daemon_factory()
    first = RankedEngine.connect(d.target, "llama")
    try:
        first.driver.prefill_to_host([prompt(7)])
        assert first.ranks[1].client.reconnect(timeout=DEADLINE_S) is None  # alive: a rank's probe is answered
    finally:
        first.close()
    smaller = RankedEngine(tp_size=2, num_pages=64)  # sized from what its GPUs had free this time
    try:
        smaller.register(d.target, "llama")
        [ns] = smaller.driver.client.stats("llama").namespaces
        assert ns.device_pages == 64
        assert smaller.driver.load(prompt(7)) == (8 * PS, (0, 0))  # the host tier stayed warm
    finally:
        smaller.close()


def _alive(target: str, rank: EngineDouble) -> bool:
    """Whether the daemon still lists the rank's session (asked as an operator: a call on
    a closed session would register it again)."""
    operator = Client(target)
    try:
        return rank.registration.session in {s.session for ns in operator.stats().namespaces for s in ns.sessions}
    finally:
        operator.close()
