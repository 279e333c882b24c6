"""Load-backs that expire (--ack-timeout): what becomes of the engine's device pages is
told to the engine, so no page is lost on either side.

A load-back whose copy failed (--fault-fail-loads 1) and which the engine never
acknowledged: the daemon finishes it, takes those pages out of the tree, and pushes an
unasked answer on the session's ack stream (expired, NOT_FOUND, load_failed, the pages
in failed_pages); the late ack gets the same answer. One whose copy succeeded: the
answer says its pages stay with the cache, and Evict hands them back later.
"""

import grpc

from radixkv.types import pack, unpack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import DaemonProcess, stop_all, wait_for
from tests.support.engine import EngineDouble, prompt

from faultkit import RawSession, stub_for, tokens, violations

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
TIMEOUT = "0.4"


def stuck_load(stub, namespace: str) -> tuple[RawSession, pb.LoadBackResponse]:
    """A raw session with 4 pages on host (evicted from the device), loading them back
    into pages 8-11 and never acking."""
    s = RawSession(stub, namespace)
    p = tokens(0, 4)
    s.insert(p, [0, 1, 2, 3])
    assert len(stub.Evict(pb.EvictRequest(session=s.id, num_pages=4)).freed_pages) == 16
    m = s.match(p)
    lb = s.load_back(m.host_node, [8, 9, 10, 11])
    assert lb.transfer and lb.loaded_tokens == 16
    return s, lb


def held(stub, namespace: str) -> int:
    [ns] = stub.Stats(pb.StatsRequest(namespace=namespace)).namespaces
    return ns.device_pages_held


def test_failed_copy_expired_pages_reach_the_engine(daemon_factory):
    d = daemon_factory("--ack-timeout", TIMEOUT, "--fault-fail-loads", "1")
    channel, stub = stub_for(d.target)
    s, lb = stuck_load(stub, "exp/fail")
    try:
        pushed = s.acks.reply(timeout=10)  # told unasked, once the daemon finished it
        assert (pushed.transfer, pushed.code, pushed.expired, pushed.unsolicited, pushed.load_failed) == \
            (lb.transfer, NOT_FOUND, True, True, True), pushed
        assert pushed.failed_pages == pack([8, 9, 10, 11])
        assert "not acknowledged within --ack-timeout=0.4s" in pushed.message
        assert "its 4 device pages are the engine's again" in pushed.message
        late = s.ack(lb.transfer)  # the engine wakes up and acks: the same answer
        assert (late.code, late.expired, late.unsolicited, late.failed_pages) == \
            (NOT_FOUND, True, False, pack([8, 9, 10, 11])), late
        # The pages are truly the engine's: the cache holds none of them, and the engine
        # can hand them to the cache again.
        assert held(stub, "exp/fail") == 0
        assert s.insert(tokens(500, 4), [8, 9, 10, 11]).cached_tokens == 0
        assert held(stub, "exp/fail") == 4
        assert violations(stub) == []
        log = d.log()
        assert "event=load_back.expired " in log and "event=load_back.expired_failed" in log
    finally:
        s.close()
        channel.close()


def test_successful_copy_expired_pages_stay_cached(daemon_factory):
    d = daemon_factory("--ack-timeout", TIMEOUT)
    channel, stub = stub_for(d.target)
    s, lb = stuck_load(stub, "exp/ok")
    try:
        pushed = s.acks.reply(timeout=10)
        assert (pushed.transfer, pushed.expired, pushed.unsolicited, pushed.failed_pages) == \
            (lb.transfer, True, True, b""), pushed
        assert "its device pages stay with the cache" in pushed.message
        assert held(stub, "exp/ok") == 4
        freed = stub.Evict(pb.EvictRequest(session=s.id, num_pages=100)).freed_pages
        assert sorted(unpack(freed)) == [8, 9, 10, 11]
        assert violations(stub) == []
    finally:
        s.close()
        channel.close()


def test_client_engine_loses_no_page(daemon_factory):
    """The Python client records the pushed answer: `wait` returns it without an ack,
    and an engine that gives `failed_pages` back to its pool and evicts everything has
    every page again."""
    d = daemon_factory("--ack-timeout", TIMEOUT, "--fault-fail-loads", "1")
    engine = EngineDouble.connect(d.target, "exp/client", num_pages=32, write_policy="write_back")
    try:
        tokens_ = prompt(1, pages=4)
        engine.prefill(tokens_)
        engine.evict(4)
        [m] = engine.client.match([pack(tokens_)])
        given = engine.allocate(m.host_tokens // engine.page_size)
        lb = engine.client.load_back(m.host_node, given)
        engine.pool.to_cache(given, "LoadBack")
        wait_for(lambda: engine.client.stats("exp/client").namespaces[0].counters["load_backs_expired"] == 1,
                 10, "the load-back to expire")
        outcome = wait_for(lambda: engine.client.wait([lb.transfer], timeout=10)[lb.transfer], 10, "its outcome")
        assert not outcome.ok and outcome.expired and list(outcome.failed_pages) == given, outcome
        engine.pool.from_cache(outcome.failed_pages, "expired load")
        engine.evict(engine.pool.num_pages)
        assert engine.pool.num_free == engine.pool.num_pages and engine.pool.errors == 0, engine.pool.messages
        assert engine.client.check_invariants() == []
    finally:
        engine.close()


def test_leases_and_unacked_loads_show_in_stats_and_metrics():
    """What a stuck engine holds is visible before it expires: Stats (leases, the oldest
    one's age, load-backs not acknowledged) and the radixkv_leases /
    radixkv_load_backs_unacked gauges."""
    d = DaemonProcess(metrics=True).start()
    channel, stub = stub_for(d.target)
    try:
        s, lb = stuck_load(stub, "exp/held")
        m = s.match(tokens(0, 4), lease=True)
        assert m.lease
        [ns] = stub.Stats(pb.StatsRequest(namespace="exp/held")).namespaces
        assert (ns.leases, ns.load_backs_unacked) == (1, 1) and ns.oldest_lease_seconds > 0
        text = d.scrape()
        assert 'radixkv_leases{namespace="exp/held"} 1.0' in text
        assert 'radixkv_load_backs_unacked{namespace="exp/held"} 1.0' in text
        assert s.ack(lb.transfer).code == 0
        stub.Release(pb.ReleaseRequest(session=s.id, leases=[m.lease]))
        [ns] = stub.Stats(pb.StatsRequest(namespace="exp/held")).namespaces
        assert (ns.leases, ns.load_backs_unacked, ns.oldest_lease_seconds) == (0, 0, 0)
        assert 'radixkv_leases{namespace="exp/held"} 0.0' in d.scrape()
        s.close()
    finally:
        channel.close()
        stop_all([d])


def test_an_engine_managed_save_never_acknowledged_is_finished_as_a_save():
    """An engine-managed rank that never acknowledges its asynchronous save: the daemon
    finishes it at ack_timeout and says so as a save (logged, counted and labelled
    `save`, never a "load-back"; nothing to recompute); its pages are stored."""
    from test_engine_managed_e2e import Rank, scheduler
    from test_engine_managed_e2e import tokens as shard_tokens

    d = DaemonProcess("--ack-timeout", TIMEOUT, metrics=True).start()
    rank = Rank(d.target, "exp/save")
    sched = scheduler(d.target, "exp/save")
    try:
        rank.fill([1, 2, 3], seed=5)
        saved = rank.client.insert(shard_tokens(0, 3), [1, 2, 3], async_=True)
        assert saved.transfer
        wait_for(lambda: sched.stats("exp/save").namespaces[0].counters["saves_expired"] == 1,
                 10, "the save to expire")
        assert sched.stats("exp/save").namespaces[0].counters["load_backs_expired"] == 0
        outcome = rank.client.wait([saved.transfer], timeout=10)[saved.transfer]  # the pushed answer
        assert outcome.expired and not outcome.ok and len(outcome.failed_pages) == 0, outcome
        assert "the daemon finished the save itself; its pages were stored" in outcome.reason, outcome
        assert "load" not in outcome.reason, outcome
        assert 'radixkv_expirations_total{kind="save",namespace="exp/save"} 1.0' in d.scrape()
        log = d.log()
        assert "event=save.expired " in log and "event=load_back.expired" not in log
        (hit,) = sched.match([shard_tokens(0, 3)])
        assert hit.complete_tokens == 12, "the save the daemon finished is served"
    finally:
        rank.close()
        sched.close()
        stop_all([d])
