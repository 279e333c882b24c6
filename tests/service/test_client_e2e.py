"""The client and the simulator against a real daemon (see conftest.py)."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from radixkv import errors
from radixkv.aio import AsyncClient
from radixkv.client import Client
from radixkv.layout import KvLayout
from radixkv.sim.cli import SimConfig, run
from radixkv.sim.kv import page_keys
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc
from tests.support.engine import EngineDouble

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
NUM_PAGES = 32
POLICIES = ["write_through", "write_through_selective", "write_back"]


class Engine(EngineDouble):
    """The engine double (tests/support/engine.py) with this file's layout, registered."""

    def __init__(self, target: str, namespace: str, write_policy: str = "write_through", **kw):
        super().__init__(LAYOUT, NUM_PAGES)
        try:
            self.reg = self.register(Client(target, timeout=10), namespace, write_policy=write_policy,
                                     host_pool_pages=64, **kw)
        except BaseException:
            self.close()
            raise


@pytest.fixture
def engine(daemon):
    e = Engine(daemon, "e2e/tp0")
    yield e
    e.close()


def evict_all(client: Client, n: int, timeout: float = 10.0) -> list[int]:
    """Evict until `n` pages came back (a write-through backup may still be running)."""
    freed, deadline = [], time.monotonic() + timeout
    while len(freed) < n and time.monotonic() < deadline:
        freed += client.evict(n - len(freed)).freed_pages
        if len(freed) < n:
            time.sleep(0.02)
    return freed


def test_register_match_insert_load_back_ack_round_trip(engine):
    c, kv = engine.client, engine.kv
    tokens = pack(range(100, 114))  # 3 whole pages + 2 tokens
    keys = page_keys(tokens, LAYOUT.page_size)
    assert engine.reg.session and engine.reg.daemon_instance and engine.reg.write_policy == "write_through"
    assert engine.reg.storage == ""  # no storage tier

    [m] = c.match([tokens])
    assert (m.device_tokens, m.host_tokens, len(m.device_pages), m.lease) == (0, 0, 0, 0)
    kv.write([5, 6, 7], keys[:3])
    ins = c.insert(tokens[:12 * 4], [5, 6, 7])
    assert ins.cached_tokens == 0 and len(ins.redundant_pages) == 0

    [m] = c.match([tokens], lease=True)
    assert list(m.device_pages) == [5, 6, 7] and m.device_tokens == 12 and m.lease
    assert kv.mismatches(m.device_pages, keys[:3]) == (0, 0)
    c.release([m.lease])

    assert sorted(evict_all(c, 3)) == [5, 6, 7]
    kv.write([5, 6, 7], page_keys(pack(range(900, 912)), LAYOUT.page_size))  # the engine reuses them

    [m] = c.match([tokens], lease=True)
    assert m.device_tokens == 0 and m.host_tokens == 12 and m.lease
    lb = c.load_back(m.host_node, [20, 21, 22, 23])
    assert lb.transfer and lb.loaded_tokens == 12 and lb.device_tokens == 12
    assert list(lb.unused_pages) == [23] and sorted(lb.device_pages) == [20, 21, 22]
    out = c.wait([lb.transfer, *lb.depends_on], timeout=10)
    assert out[lb.transfer].ok, out[lb.transfer].reason
    assert kv.mismatches(lb.device_pages, keys[:3]) == (0, 0)
    assert c.wait([lb.transfer])[lb.transfer] == out[lb.transfer]

    ins = c.insert(tokens[:12 * 4], lb.device_pages, release_lease=m.lease)
    assert ins.cached_tokens == 12 and len(ins.redundant_pages) == 0
    assert c.check_invariants() == []
    [ns] = c.stats("e2e/tp0").namespaces
    assert ns.device_pages_held == 3 and ns.attached


def test_insert_returns_redundant_pages_and_shares_prefixes(engine):
    c, kv = engine.client, engine.kv
    a, b = pack(range(1, 9)), pack([1, 2, 3, 4, 50, 51, 52, 53])
    kv.write([0, 1], page_keys(a, 4))
    assert c.insert(a, [0, 1]).cached_tokens == 0
    kv.write([2, 3], page_keys(b, 4))
    ins = c.insert(b, [2, 3])  # page 0 of b is a's page 0
    assert ins.cached_tokens == 4 and list(ins.redundant_pages) == [2]
    results = c.match([a, b, pack([7, 7, 7, 7])])
    assert [r.device_tokens for r in results] == [8, 8, 0]
    assert list(results[1].device_pages) == [0, 3]
    assert kv.mismatches(results[1].device_pages, page_keys(b, 4)) == (0, 0)


def test_a_release_refused_for_one_lease_still_releases_the_others(engine):
    """The daemon refuses a Release whole when one lease is no longer held (a decode
    step's Insert released it already): the client sends the others again, so a stale
    lease in a batch does not leave the rest pinning their pages."""
    c, kv = engine.client, engine.kv
    prompts = [pack(range(100 * i, 100 * i + 4)) for i in (1, 2, 3)]
    for page, tokens in enumerate(prompts):
        kv.write([page], page_keys(tokens, 4))
        c.insert(tokens, [page])
    leases = [m.lease for m in c.match(prompts, lease=True)]
    c.release(leases[:1])
    with pytest.raises(errors.NotFound, match="is not held") as refused:
        c.release(leases)
    assert refused.value.leases == (leases[0],)
    assert [ns.leases for ns in c.stats().namespaces] == [0]
    assert sorted(evict_all(c, 3)) == [0, 1, 2]  # nothing pins them any more


def test_a_match_can_have_a_deadline_of_its_own(daemon_factory):
    """A scheduler step that cannot wait the client's timeout bounds its lookup (here
    against a daemon frozen meanwhile). Without a lease the session goes on; with one the
    leases' fate is unknown, so the session ends and is registered again, as for any
    leasing call left unanswered."""
    d = daemon_factory()
    engine = Engine(d.target, "deadline/ns")
    c, kv = engine.client, engine.kv
    tokens = pack(range(200, 204))
    kv.write([0], page_keys(tokens, 4))
    c.insert(tokens, [0])
    try:
        for lease in (False, True):
            d.signal(signal.SIGSTOP)
            try:
                with pytest.raises(errors.DeadlineExceeded, match="Match: no answer within 0.3s"):
                    c.match([tokens], lease=lease, timeout=0.3)
            finally:
                d.signal(signal.SIGCONT)
            if not lease:
                assert c.match([tokens])[0].device_tokens == 4 and not c.session_lost
                with pytest.raises(errors.InvalidArgument, match="timeout must be a positive number"):
                    c.match([tokens], timeout=0)
        with pytest.raises(errors.SessionLost):
            c.match([tokens])
    finally:
        engine.close()


def test_a_raw_release_naming_lease_0_releases_the_others(engine):
    """A miss's Match answer names lease 0 even with `lease`: an engine releasing every
    answer's lease in one batch sent it, the daemon refused the batch whole (NOT_FOUND),
    and the real leases went on pinning their pages. 0 is no lease: ignored (found by a
    review from the seat of an engine written against the proto alone)."""
    c, kv = engine.client, engine.kv
    tokens = pack(range(100, 104))
    kv.write([0], page_keys(tokens, 4))
    c.insert(tokens, [0])
    hit, miss = c.match([tokens, pack([9, 9, 9, 9])], lease=True)
    assert hit.lease and miss.lease == 0
    with grpc.insecure_channel(c.target) as channel:
        radixkv_pb2_grpc.RadixKVStub(channel).Release(
            pb.ReleaseRequest(session=c.session, leases=[miss.lease, hit.lease]), timeout=10)
    assert [ns.leases for ns in c.stats().namespaces] == [0]


@pytest.mark.parametrize("policy", POLICIES)
def test_sim_runs_clean_under_each_write_policy(daemon, policy):
    common = dict(target=daemon, write_policy=policy, device_pages=96, host_pages=240, page_size=4,
                  layers=2, heads=2, head_dim=16, seed=7, progress_every=10**6)
    out = open(os.devnull, "w")
    chat = run(SimConfig(namespace=f"chat-{policy}", workload="multiturn", requests=300, clients=6,
                         max_context=160, **common), out=out)
    shared = run(SimConfig(namespace=f"shared-{policy}", workload="shared_prefix", requests=200, **common), out=out)
    for report in (chat, shared):
        assert report.ok, report.summary()
        assert report.byte_mismatches == 0 and report.violations == []
        assert report.device_tokens > 0 and report.evicted_pages > 0
    assert chat.requests == 300 and shared.requests == 200
    assert chat.load_backs > 0 and chat.host_tokens > 0  # the host tier was exercised
    with Client(daemon) as c:
        assert c.check_invariants() == []


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_sim_as_a_tensor_parallel_engine_reads_each_ranks_own_kv(daemon, policy):
    out = open(os.devnull, "w")
    report = run(SimConfig(target=daemon, namespace=f"tp-{policy}", write_policy=policy, tp=3, device_pages=96,
                           host_pages=240, page_size=4, layers=2, heads=2, head_dim=16, seed=11, requests=200,
                           clients=6, max_context=160, progress_every=10**6), out=out)
    assert report.ok, report.summary()
    assert report.byte_mismatches == 0 and report.violations == [] and report.accounting_errors == 0
    assert report.load_backs > 0 and report.host_tokens > 0  # every rank's pages went to host and back
    with Client(daemon) as c:
        assert c.check_invariants() == []


def test_two_sim_processes_on_different_namespaces(daemon):
    def sim(ns: str, seed: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "radixkv.sim.cli", "--target", daemon, "--namespace", ns,
             "--requests", "200", "--device-pages", "96", "--host-pages", "240", "--page-size", "4",
             "--head-dim", "16", "--max-context", "160", "--seed", str(seed)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [sim("two/a", 1), sim("two/b", 2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text
        assert text.rstrip().splitlines()[-1] == "0 byte mismatches"
    with Client(daemon) as c:
        assert c.check_invariants() == []
        assert {n.namespace for n in c.stats().namespaces} >= {"two/a", "two/b"}


def test_async_client_basics(daemon):
    async def main():
        device = EngineDouble(LAYOUT, NUM_PAGES)  # its buffers and pattern; the session is AsyncClient's
        kv = device.kv
        tokens = pack(range(40, 48))
        keys = page_keys(tokens, 4)
        try:
            async with AsyncClient(daemon, timeout=10) as c:
                await c.wait_ready(5)
                reg = await c.register("aio/tp0", LAYOUT, device.buffers.specs, NUM_PAGES,
                                       write_policy="write_back", host_pool_pages=64)
                assert reg.write_policy == "write_back"
                assert await c.echo(b"ping") == b"ping"
                kv.write([3, 4], keys)
                assert (await c.insert(tokens, [3, 4])).cached_tokens == 0
                ev = await c.evict(2)
                assert sorted(ev.freed_pages) == [3, 4] and ev.written_back_pages == 2
                [m] = await c.match([tokens], lease=True)
                assert m.host_tokens == 8
                lb = await c.load_back(m.host_node, [9, 10])
                out = await c.wait([lb.transfer], timeout=10)
                assert out[lb.transfer].ok
                assert kv.mismatches(lb.device_pages, keys) == (0, 0)
                await c.release([m.lease])
                assert await c.check_invariants("aio/tp0") == []
                assert (await c.inspect("aio/tp0")).total_nodes >= 1
                with pytest.raises(errors.NotFound):
                    await c.release([12345])
        finally:
            device.close()

    asyncio.run(main())


def test_errors_map_to_exception_classes(daemon, engine):
    c = engine.client
    with pytest.raises(errors.InvalidArgument):
        c.insert(pack([1, 2, 3]), [0])  # not whole pages
    with pytest.raises(errors.NotFound):
        c.load_back(10**9, [1])
    with pytest.raises(errors.NotFound):
        c.release([10**9])
    with pytest.raises(errors.FailedPrecondition):  # the namespace has a live session
        Engine(daemon, "e2e/tp0")
    with Client(daemon) as other:
        with pytest.raises(errors.InvalidArgument):
            other.register("bad name!", LAYOUT, [("x", 0, 1)] * LAYOUT.num_buffers, 4)
        with pytest.raises(errors.ResourceExhausted):
            other.register("huge", LAYOUT, engine.buffers.specs, NUM_PAGES, host_pool_pages=10**9)
        with pytest.raises(errors.FailedPrecondition):  # client-side: not registered
            other.match([[1, 2, 3, 4]])
    with grpc.insecure_channel(daemon) as ch:
        stub = radixkv_pb2_grpc.RadixKVStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Match(pb.MatchRequest(session="no-such-session"))
        assert isinstance(errors.from_rpc_error(info.value), errors.Unauthenticated)
    # a bogus ack is refused for that ack alone: a failed outcome, the stream lives on
    assert not c.wait([987654], timeout=10)[987654].ok
    [m] = c.match([pack(range(8))])
    assert m.device_tokens == 0


def test_a_lost_daemon_never_reads_as_success(daemon_factory):
    d = daemon_factory()
    e = Engine(d.target, "lost/tp0", write_policy="write_back")
    try:
        c = e.client
        tokens = pack(range(16))
        e.kv.write([0, 1, 2, 3], page_keys(tokens, 4))
        c.insert(tokens, [0, 1, 2, 3])
        c.evict(4)
        [m] = c.match([tokens])
        lb = c.load_back(m.host_node, [8, 9, 10, 11])
        assert lb.transfer
        d.kill()
        out = c.wait([lb.transfer], timeout=10)
        assert not out[lb.transfer].ok and out[lb.transfer].reason
        with pytest.raises(errors.Unavailable):
            c.evict(1)
    finally:
        e.close()  # idempotent teardown with the daemon gone must not raise


def test_the_sim_detects_corrupted_cache_pages(engine):
    """The verification is live: KV changed behind the daemon's back is reported."""
    from radixkv.sim import Engine as SimEngine
    from radixkv.sim import Report, SharedPrefix

    def workload():
        return SharedPrefix(12, seed=5, groups=1, system_tokens=32, suffix_tokens=(4, 8), answer_tokens=(4, 4))

    sim = SimEngine(engine.client, LAYOUT, engine.buffers.tensors, NUM_PAGES, max_batch=4)
    clean = sim.run(workload())
    assert clean.ok and clean.device_tokens > 0 and clean.byte_mismatches == 0
    cached = sim.pool.cached()
    assert cached
    for i in range(LAYOUT.num_buffers):
        engine.page_view(i)[cached] ^= 0x5A
    sim.report = Report()
    dirty = sim.run(workload())
    assert dirty.byte_mismatches > 0 and dirty.chunk_mismatches > 0 and not dirty.ok


@pytest.mark.parametrize("replace", [False, True], ids=["after-close", "replacing"])
def test_a_restarted_engine_is_told_what_left_with_the_old_ones_device_pages(daemon, replace):
    """Write-back: 8 tokens on the device only, 8 more with a host copy. The next
    engine's Register is warm and reports the 8 that left (after the old session closed,
    or when it replaced it); it reported 0 once the old session's close had dropped them."""
    old = Engine(daemon, "e2e/restart", write_policy="write_back")
    new = None
    try:
        old.prefill(list(range(8)))
        assert len(evict_all(old.client, 2)) == 2  # written back: host copy, off the device
        old.prefill(list(range(100, 108)))          # device only
        if not replace:
            old.client.close()
        new = Engine(daemon, "e2e/restart", write_policy="write_back", replace_existing=replace)
        assert new.reg.warm and new.reg.dropped_device_tokens == 8
        [m] = new.client.match([pack(range(100, 108))])
        assert m.device_tokens + m.host_tokens == 0
        if replace:  # the replaced engine learns why, not only that the namespace is taken
            with pytest.raises(errors.FailedPrecondition, match=r"replaced by a new registration.*attached to a live"):
                old.client.match([pack(range(8))])
    finally:
        for e in (old, new):
            if e is not None:
                e.close()


def test_a_session_that_never_releases_its_leases_is_told_at_its_limit(daemon_factory):
    """Each lease pins its pages and costs the daemon memory: an engine that forgets to
    release them once shrank the device pool, and a hostile one grew the daemon until it
    was OOM-killed. Past --max-leases-per-session a leasing call is refused whole, and
    releasing makes room again."""
    d = daemon_factory("--max-leases-per-session", "3", "--max-message-size", "8MiB")
    engine = Engine(d.target, "leases/ns")
    try:
        c = engine.client
        # Register says both limits (an engine without this client sizes its channel by one)
        assert (c.registration.max_leases_per_session, c.registration.max_message_bytes) == (3, 8 * 1024**2)
        prompts = [pack(range(100 * i, 100 * i + 4)) for i in range(4)]
        for page, tokens in enumerate(prompts):
            engine.kv.write([page], page_keys(tokens, 4))
            c.insert(tokens, [page])
        leases = [m.lease for m in c.match(prompts[:2], lease=True)]
        with pytest.raises(errors.ResourceExhausted, match="holds 2 leases and this call would take 2 more"):
            c.match(prompts[2:], lease=True)
        [ns] = c.stats().namespaces
        assert ns.leases == 2  # refused whole: none taken
        assert all(m.lease for m in c.match(prompts[2:3], lease=True))
        c.release(leases)
        assert all(m.lease for m in c.match(prompts[:2], lease=True))
    finally:
        engine.close()
