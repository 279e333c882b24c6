"""A store that stops answering (a frozen node, a network partition that drops packets)
never holds an engine call past --storage-lookup-timeout, whatever the store client's own
timeouts add up to: the lookup answers "nothing stored", later lookups skip storage at
once until the late one ends, and storage is used again when the store answers."""

import contextlib
import json
import os
import signal
import time

import grpc
import pytest
import redis

from radixkv.client import Client
from radixkv.v1 import radixkv_pb2 as pb
from tests.storage.fleet import RedisCluster
from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble, prompt

from faultkit import LAYOUT, RawSession, status, stub_for, tokens

LOOKUP_TIMEOUT_S = 2.0
CALL_BOUND_S = LOOKUP_TIMEOUT_S + 1.5  # the lookup's wait and the call's own work, on a busy machine
SKIPPED_BOUND_S = LOOKUP_TIMEOUT_S / 2  # a call that skips storage: milliseconds, on a busy machine less than this
DEADLINE_S = 30.0
PAGES = 8  # per prompt


@contextlib.contextmanager
def frozen_store(request, kind: str):
    """(storage URL, pids that freeze it) of a private store. The single Redis is told
    to wait a minute per read, and so are the cluster's nodes, so only the daemon's own
    limit can end a lookup early (with redis-py's defaults a frozen 3-master cluster costs
    a GET about 8 s: a socket timeout per shard, then a topology refresh)."""
    if kind == "redis":
        server = request.getfixturevalue("private_redis")
        yield server.url + "?socket_timeout=60", [server.proc.pid]
        return
    cluster = RedisCluster(masters=3, replicas=0).start()
    try:
        yield cluster.url + "?socket_timeout=60", [p.pid for p in cluster.procs.values()]
    finally:
        cluster.cleanup()


def timed(call):
    start = time.monotonic()
    return call(), time.monotonic() - start


@pytest.mark.parametrize("kind", ["redis", "redis_cluster"])
def test_a_frozen_store_holds_engine_calls_no_longer_than_the_lookup_timeout(request, daemon_factory, kind):
    with frozen_store(request, kind) as (url, pids):
        d = daemon_factory("--storage", url, "--storage-policy", "write_through",
                           "--storage-lookup-timeout", str(LOOKUP_TIMEOUT_S), "--log-format", "json")
        engine = EngineDouble.connect(d.target, host_pool_pages=PAGES)
        match = lambda: engine.client.match([prompt(1)], include_storage=True)[0]  # noqa: E731
        try:
            # prompt(1) ends up in storage only: the second prompt takes its host pages.
            for i in (1, 2):
                engine.prefill(prompt(i))
                wait_for(lambda: engine.counters()["stored_tokens"] == i * PAGES * PS, DEADLINE_S, "the store")
                engine.evict(PAGES)
            assert match().storage_tokens == PAGES * PS
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                m, seconds = timed(match)
                assert seconds < CALL_BOUND_S and m.storage_tokens == 0
                for _ in range(4):  # storage is skipped now: no call waits for it again
                    m, seconds = timed(match)
                    assert seconds < SKIPPED_BOUND_S and m.storage_tokens == 0
                progress, seconds = timed(lambda: engine.client.prefetch(prompt(1), policy="wait_complete"))
                assert seconds < SKIPPED_BOUND_S and [p.state for p in progress] == ["nothing"]
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            # The late lookup ends once the store runs again, and lookups ask storage again.
            wait_for(lambda: match().storage_tokens == PAGES * PS, DEADLINE_S, "lookups to use storage again")
            assert engine.client.check_invariants() == []
        finally:
            engine.close()
    events = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    [unavailable] = [e for e in events if e["event"] == "storage.unavailable"]
    assert "--storage-lookup-timeout" in unavailable["error"]
    assert [e["event"] for e in events if e["event"] == "storage.recovered"] == ["storage.recovered"]


def test_a_namespace_is_dropped_at_once_while_its_late_lookup_waits_on_a_frozen_store(private_redis,
                                                                                      daemon_factory):
    """A lookup that outlived --storage-lookup-timeout on a frozen store is left to end on
    its thread when its namespace is dropped: DropNamespace answers within the call bound
    (it joined that thread on the daemon's loop, holding it and every call of the daemon
    until the store answered: 60 s here), and the daemon serves other calls meanwhile."""
    d = daemon_factory("--storage", private_redis.url + "?socket_timeout=60", "--storage-policy", "write_through",
                       "--storage-lookup-timeout", str(LOOKUP_TIMEOUT_S))
    engine = EngineDouble.connect(d.target, "frozen/drop", host_pool_pages=PAGES)
    admin = Client(d.target, timeout=CALL_BOUND_S)
    try:
        engine.prefill(prompt(1))
        wait_for(lambda: engine.counters()["stored_tokens"] == PAGES * PS, DEADLINE_S, "the store")
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            [late] = engine.client.match([prompt(2)], include_storage=True)  # answered at the lookup timeout
            assert late.storage_tokens == 0
            engine.close()
            assert admin.drop_namespace("frozen/drop").freed_host_bytes > 0  # DeadlineExceeded before
            assert admin.stats().namespaces == []
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
    finally:
        admin.close()
        engine.close()


def test_lookups_whose_callers_gave_up_still_make_the_next_ones_skip_storage(private_redis, daemon_factory):
    """Engines whose deadline is shorter than --storage-lookup-timeout give up on every
    lookup of a frozen store before its timeout. A lookup still running at its timeout
    counts as late all the same: the next lookups skip storage and answer at once (they
    used to queue behind it, every call past its deadline for as long as the store stayed
    frozen, with nothing in the log), and the log says storage is unavailable."""
    d = daemon_factory("--storage", private_redis.url + "?socket_timeout=60", "--storage-lookup-timeout", "1",
                       "--log-format", "json")
    channel, stub = stub_for(d.target)
    s = RawSession(stub, "gave/up")

    def ask() -> tuple:
        code, _ = status(lambda: answers.append(stub.Match(pb.MatchRequest(
            session=s.id, prompts=[pb.Prompt(tokens=tokens(0, 4))], include_storage=True), timeout=0.3)))
        return code

    answers = []
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    try:
        assert ask() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: ask() == grpc.StatusCode.OK, DEADLINE_S, "a lookup answered within its deadline")
        assert answers[-1].results[0].storage_tokens == 0
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
    wait_for(lambda: "storage.recovered" in d.log(), DEADLINE_S, "the late lookup's end")
    [unavailable] = [json.loads(line) for line in d.log().splitlines() if '"storage.unavailable"' in line]
    assert "its caller gave up before" in unavailable["error"]
    s.close()
    channel.close()


def test_lookups_do_not_wait_behind_stores_that_a_store_is_slow_to_take(private_redis, daemon_factory):
    """Redis pausing writes (CLIENT PAUSE WRITE: a fork, a failover) while reads work:
    stores wait on the storage write threads, lookups on threads of their own still read
    what storage holds (they queued behind the stores, then answered "nothing")."""
    flags = ("--storage", private_redis.url, "--storage-policy", "write_through", "--storage-lookup-timeout", "60")
    writer, reader = daemon_factory(*flags), daemon_factory(*flags)
    prefix = tokens(0, 4)
    channel_w, stub_w = stub_for(writer.target)
    w = RawSession(stub_w, "shared/m", write_policy="write_through")
    w.insert(prefix, [0, 1, 2, 3])
    stored = lambda stub, n: stub.Stats(pb.StatsRequest(namespace="shared/m")).namespaces[0].counters[  # noqa: E731
        "stored_tokens"] >= n
    wait_for(lambda: stored(stub_w, 4 * PS), DEADLINE_S, "the writer's store")
    channel_r, stub_r = stub_for(reader.target)
    r = RawSession(stub_r, "shared/m", write_policy="write_through")
    admin = redis.Redis(unix_socket_path=private_redis.socket)
    admin.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
    try:
        backed = lambda: stub_r.Stats(pb.StatsRequest(namespace="shared/m")).namespaces[0].counters[  # noqa: E731
            "backed_up_bytes"]
        for i in range(1, 5):  # the reader's own write-through stores, each waiting on the paused server
            r.insert(tokens(1000 * i, 4), [4 * i + j for j in range(4)])
        wait_for(lambda: backed() >= 16 * LAYOUT.page_bytes, DEADLINE_S, "host copies made, stores begun")
        m = stub_r.Match(pb.MatchRequest(session=r.id, prompts=[pb.Prompt(tokens=prefix)], include_storage=True),
                         timeout=10)
        assert m.results[0].storage_tokens == 4 * PS
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
    for s in (w, r):
        s.close()
    channel_w.close()
    channel_r.close()


def test_while_storage_writes_fail_an_evict_waits_only_briefly_on_stores_for_room(private_redis, daemon_factory):
    """An Evict short of host room waits for the stores that would free it, up to
    --storage-lookup-timeout. While the storage tier fails writes those stores most likely
    fail too, after the store client's retries: every Evict paid them (8 ms -> 195 ms with
    Redis down, the engine's steps 6x slower). Now it waits 50 ms for them; the pages
    that needed room are dropped, as when no room is coming. (Here the stores hang, so
    the wait the Evict made shows in its time.)"""
    flags = ("--storage", private_redis.url + "?socket_timeout=60", "--storage-policy", "write_through",
             "--storage-lookup-timeout", "60")
    d = daemon_factory(*flags)
    channel, stub = stub_for(d.target)
    s = RawSession(stub, "room/m", write_policy="write_back", host_pool_pages=8)
    admin = redis.Redis(unix_socket_path=private_redis.socket)
    counters = lambda: stub.Stats(pb.StatsRequest(namespace="room/m")).namespaces[0].counters  # noqa: E731
    try:
        admin.config_set("maxmemory", "1mb")  # below what it uses: writes refused
        s.insert(tokens(0, 4), [0, 1, 2, 3])
        stub.Evict(pb.EvictRequest(session=s.id, num_pages=4), timeout=10)  # to host; its store fails
        wait_for(lambda: counters()["store_failed_tokens"] >= 4 * PS, DEADLINE_S, "a failed store")
        admin.config_set("maxmemory", "0")
        admin.execute_command("CLIENT", "PAUSE", "30000", "WRITE")  # the next stores hang
        for i in (1, 2):  # the host fills with pages whose stores hang
            s.insert(tokens(1000 * i, 4), [0, 1, 2, 3])
            stub.Evict(pb.EvictRequest(session=s.id, num_pages=4), timeout=10)
        s.insert(tokens(3000, 4), [0, 1, 2, 3])
        start = time.monotonic()
        freed = stub.Evict(pb.EvictRequest(session=s.id, num_pages=4), timeout=20).freed_pages
        assert time.monotonic() - start < CALL_BOUND_S  # it waited up to 60 s for room before
        assert len(freed) == 4 * 4  # 4 device pages (int32 each) back to the engine, their KV dropped
        assert counters()["dropped_write_back_tokens"] >= 4 * PS
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        s.close()
        channel.close()
