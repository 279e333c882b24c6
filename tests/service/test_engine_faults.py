"""A dead, slow or stuck engine: the daemon cleans up after it and nothing else stalls.

- An engine SIGKILLed with load-backs and a write-back still copying: the daemon finishes
  the copies, releases every lease and pin of the session, keeps the host tier, and a
  re-registered engine gets host hits (with the right bytes) for the old prefixes.
- Leases and load-backs a stuck engine never releases or acknowledges expire after
  lease_timeout / ack_timeout: released exactly as a close would, logged and counted
  (Stats counters and the radixkv_expirations metric), later calls get a clear NOT_FOUND.
- Another engine is served normally while a stuck one holds its leases and load-back.
"""

import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.sim.kv import KvPattern, page_keys
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from tests.soak import victim
from tests.support.daemon import free_port, wait_for

from faultkit import LAYOUT, NUM_PAGES, RawSession, stub_for, tokens, violations

ROOT = Path(__file__).resolve().parents[2]


def ns_stats(client: Client, namespace: str):
    [ns] = client.stats(namespace).namespaces
    return ns


def test_engine_killed_with_copies_in_flight(daemon_factory):
    # The victim's last calls and a Stats must fit inside one copy's delay (its acked load
    # ends with it): 2 s leaves a loaded machine room.
    d = daemon_factory("--fault-copy-delay", "2.0")
    child = subprocess.Popen([sys.executable, "-m", "tests.soak.victim", d.target, "kill/tp0"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("READY"), line + child.stdout.read()
        child.kill()  # SIGKILL: no Close, no half-close, copies still running
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()
    with Client(d.target, timeout=10) as ops:
        ns = wait_for(lambda: (s := ns_stats(ops, "kill/tp0")) and not s.attached and not s.transfers_in_flight and s,
                      30, "the dead engine's session closed and its copies finished")
        assert ns.device_pages_protected == 0 and ns.pinned_nodes == 0  # no lease, no lock, no pin left
        assert ns.host_pages_used >= 16  # the three prefixes and the written-back LATE
        assert ops.check_invariants() == []
        assert ops.stats().sessions == 0
    assert "session.closed" in d.log() and "Traceback" not in d.log()

    # The engine comes back (new buffers, garbage in them): host hits, right bytes.
    buffers = ShmKvBuffers.create(victim.LAYOUT, victim.NUM_PAGES)
    try:
        kv = KvPattern(victim.LAYOUT, [buffers.buffer(i) for i in range(victim.LAYOUT.num_buffers)], victim.NUM_PAGES)
        for page in range(victim.NUM_PAGES):
            buffers.page_view(0)[page] = 0xEE
        with Client(d.target, timeout=10) as c:
            reg = c.register("kill/tp0", victim.LAYOUT, buffers.specs(), victim.NUM_PAGES,
                             write_policy="write_back", host_pool_pages=256)
            assert reg.warm
            prompts = [*victim.PREFIXES, victim.LATE]
            matches = c.match(prompts, lease=True)
            assert [(m.device_tokens, m.host_tokens) for m in matches] == [(0, 16)] * 4
            for i, (m, tokens_) in enumerate(zip(matches, prompts)):
                pages = list(range(4 * i, 4 * i + 4))
                lb = c.load_back(m.host_node, pages)
                assert c.wait([lb.transfer], timeout=10)[lb.transfer].ok
                assert kv.mismatches(lb.device_pages, page_keys(tokens_, 4)) == (0, 0)
            c.release([m.lease for m in matches])
            assert c.check_invariants() == []
    finally:
        buffers.close()


STUCK_TIMEOUT_S = 5.0  # lease and ack timeouts (the stuck engine takes a lease, then loads with it)


def hold_leases_and_a_load_back(stub, stuck: RawSession):
    """What a stuck engine leaves behind: a Match lease, an unacknowledged load-back
    and an Insert lease. Returns (match, load_back, insert) replies."""
    p = tokens(0, 4)
    stuck.insert(p, [0, 1, 2, 3])
    assert len(stub.Evict(pb.EvictRequest(session=stuck.id, num_pages=4)).freed_pages) == 16
    m = stuck.match(p, lease=True)
    lb = stuck.load_back(m.host_node, [4, 5, 6, 7])
    assert lb.transfer and m.lease
    q = tokens(100, 2)
    stuck.kv.write([10, 11], page_keys(q, 4))
    ins = stub.Insert(pb.InsertRequest(session=stuck.id, tokens=q, device_pages=pack([10, 11]), lease=True))
    return m, lb, ins


def test_a_stuck_engine_does_not_hold_up_another(daemon_factory):
    """Another engine is served while the stuck one holds its leases and load-back: no
    timeouts here, so nothing it holds is ever released while the other is served."""
    d = daemon_factory()
    channel, stub = stub_for(d.target)
    stuck = RawSession(stub, "stuck/tp0")
    try:
        hold_leases_and_a_load_back(stub, stuck)
        bufs = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
        try:
            with Client(d.target, timeout=5) as other:
                other.register("other/tp0", LAYOUT, bufs.specs(), NUM_PAGES, host_pool_pages=64)
                assert other.insert(tokens(0, 2), [0, 1]).cached_tokens == 0
                assert other.match([tokens(0, 2)])[0].device_tokens == 8
        finally:
            bufs.close()
        [held] = stub.Stats(pb.StatsRequest(namespace="stuck/tp0")).namespaces
        assert (held.leases, held.load_backs_unacked) == (2, 1)
        assert violations(stub) == []
    finally:
        stuck.close()
        channel.close()


def test_stuck_engine_leases_and_acks_expire(daemon_factory):
    port = free_port()
    d = daemon_factory("--lease-timeout", str(STUCK_TIMEOUT_S), "--ack-timeout", str(STUCK_TIMEOUT_S),
                       "--metrics-port", str(port))
    channel, stub = stub_for(d.target)
    stuck = RawSession(stub, "stuck/tp0")
    try:
        # Register says both, so an engine with longer requests knows to renew its leases.
        assert (stuck.reply.lease_timeout_ms, stuck.reply.ack_timeout_ms) == (5000, 5000)
        m, lb, ins = hold_leases_and_a_load_back(stub, stuck)

        def expired():
            [ns] = stub.Stats(pb.StatsRequest(namespace="stuck/tp0")).namespaces
            c = ns.counters
            return c["leases_expired"] == 2 and c["load_backs_expired"] == 1 and ns.transfers_in_flight == 0 and ns
        ns = wait_for(expired, 10 + STUCK_TIMEOUT_S, "both leases and the load-back expired")
        assert ns.device_pages_protected == 0 and ns.pinned_nodes == 0
        assert violations(stub) == []

        with pytest.raises(grpc.RpcError) as err:
            stub.Release(pb.ReleaseRequest(session=stuck.id, leases=[m.lease]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert f"lease {m.lease} expired: held longer than --lease-timeout={STUCK_TIMEOUT_S:g}s" in err.value.details()
        reply = stuck.ack(lb.transfer)
        assert reply.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert f"expired: not acknowledged within --ack-timeout={STUCK_TIMEOUT_S:g}s" in reply.message
        with pytest.raises(grpc.RpcError) as err:
            stub.Insert(pb.InsertRequest(session=stuck.id, tokens=tokens(200, 1), device_pages=pack([12]),
                                         release_lease=ins.lease))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in err.value.details()
        # Nothing is held any more: everything on the device can be evicted.
        freed = stub.Evict(pb.EvictRequest(session=stuck.id, num_pages=100)).freed_pages
        assert sorted(pack([4, 5, 6, 7, 10, 11])[i:i + 4] for i in range(0, 24, 4)) == \
            sorted(freed[i:i + 4] for i in range(0, len(freed), 4))
        assert violations(stub) == []
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'radixkv_expirations_total{kind="lease",namespace="stuck/tp0"} 2.0' in text
        assert 'radixkv_expirations_total{kind="load_back",namespace="stuck/tp0"} 1.0' in text
        log = d.log()
        assert "event=lease.expired" in log and "event=load_back.expired" in log and "Traceback" not in log
    finally:
        stuck.close()
        channel.close()
