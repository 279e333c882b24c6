"""The fleet stores end to end: real daemons sharing Mooncake Store or Redis Cluster (and
Valkey Cluster, through the same client), byte-exact round trips, and what a lost,
frozen or restarted node costs the engines."""

import os
import signal
import time

import pytest

from tests.storage.fleet import MooncakeMaster, RedisCluster
from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble, prompt

from test_storage_e2e import DEADLINE_S, fetch_and_load, wait_stored

STORE_TIMEOUT_S = 1.0
ENGINE_BOUND_S = STORE_TIMEOUT_S + 2.0  # what a Match or a Prefetch may take while the store fails


@pytest.fixture
def mooncake_master():
    master = MooncakeMaster(client_ttl_s=2).start()
    yield master
    master.cleanup()


@pytest.fixture(scope="module")
def redis_cluster():
    cluster = RedisCluster().start()
    yield cluster
    cluster.cleanup()


@pytest.fixture(scope="module")
def valkey_cluster():
    cluster = RedisCluster(flavor="valkey").start()
    yield cluster
    cluster.cleanup()


def mooncake_flags(master) -> tuple[str, ...]:
    return ("--storage", f"mooncake://{master.address}?segment=32MiB&buffer=16MiB&timeout={STORE_TIMEOUT_S}",
            "--storage-policy", "write_through")


def timed(call):
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


@pytest.mark.parametrize("fleet", ["mooncake", "redis_cluster", "valkey_cluster"])
def test_two_daemons_sharing_a_fleet_store_serve_each_others_prefixes(request, fleet):
    # The store first: fixtures end in reverse, so the daemons stop while it still runs.
    if fleet == "mooncake":
        flags = mooncake_flags(request.getfixturevalue("mooncake_master"))
    else:
        flags = ("--storage", request.getfixturevalue(fleet).url, "--storage-policy", "write_through")
    daemon_factory = request.getfixturevalue("daemon_factory")
    a, b = daemon_factory(*flags), daemon_factory(*flags)
    writer, reader = EngineDouble.connect(a.target), EngineDouble.connect(b.target)
    try:
        for i in (7, 8):
            writer.prefill(prompt(i))
        wait_stored(writer, 2 * 8 * PS)
        for i in (7, 8):
            m, progress, loaded, mismatches = fetch_and_load(reader, prompt(i))
            assert m.storage_tokens == 8 * PS and progress[-1].state == "done"
            assert loaded == 8 * PS and mismatches == (0, 0)
        assert reader.client.check_invariants() == []
    finally:
        writer.close()
        reader.close()


def test_mooncake_segment_owner_killed_reader_misses_and_keeps_serving(mooncake_master, daemon_factory):
    a = daemon_factory(*mooncake_flags(mooncake_master))
    writer = EngineDouble.connect(a.target)
    reader = None
    try:
        writer.prefill(prompt(3))
        wait_stored(writer, 8 * PS)
        # The reader's daemon joins the store after (its start's storage check joins it):
        # every page lives in the writer's segment.
        b = daemon_factory(*mooncake_flags(mooncake_master))
        reader = EngineDouble.connect(b.target)
        assert writer.registration.storage == reader.registration.storage == "mooncake"
        # Its join is lazy, and a lookup waits for it at most a second: on a loaded machine
        # the first lookups may find nothing yet.
        wait_for(lambda: reader.client.match([prompt(3)], include_storage=True)[0].storage_tokens == 8 * PS,
                 DEADLINE_S, "the reader's daemon to join the store and find the writer's pages")
        a.kill()  # the node whose segment holds the pages (b stored nothing)
        ([m], seconds) = timed(lambda: reader.client.match([prompt(3)], include_storage=True))
        assert seconds < ENGINE_BOUND_S
        progress, seconds = timed(lambda: reader.client.prefetch(prompt(3), policy="wait_complete"))
        assert seconds < ENGINE_BOUND_S
        assert progress[-1].state in ("nothing", "done")
        loaded, mismatches = reader.load(prompt(3))
        assert mismatches == (0, 0) and loaded == 0
        # Once the master drops the dead node (client_ttl), storing goes to the reader's segment.
        wait_for(lambda: reader.client.match([prompt(3)], include_storage=True)[0].storage_tokens == 0,
                 DEADLINE_S, "the master to drop the dead node's pages")
        reader.prefill(prompt(4))
        wait_stored(reader, 8 * PS)
        assert reader.client.check_invariants() == []
    finally:
        if reader is not None:
            reader.close()
        writer.client.close()
    assert "Traceback" not in b.log()


def test_mooncake_master_killed_and_restarted(mooncake_master, daemon_factory):
    d = daemon_factory(*mooncake_flags(mooncake_master))
    engine = EngineDouble.connect(d.target)
    try:
        engine.prefill(prompt(1))
        wait_stored(engine, 8 * PS)
        mooncake_master.kill()
        engine.prefill(prompt(2))  # device and host keep working
        wait_for(lambda: engine.counters()["store_failed_tokens"] >= 8 * PS, DEADLINE_S, "the failed store")
        ([m], seconds) = timed(lambda: engine.client.match([prompt(2)], include_storage=True))
        assert seconds < ENGINE_BOUND_S and m.device_tokens == 8 * PS
        mooncake_master.start()  # empty: the keys stored before are gone
        deadline, fresh = time.monotonic() + DEADLINE_S, iter(range(20, 10_000))
        while engine.counters()["stored_tokens"] < 2 * 8 * PS:  # polled: stores succeed again
            assert time.monotonic() < deadline, "stores did not succeed after the master restart"
            engine.prefill(prompt(next(fresh)))  # a new prompt each time: each one is stored
            time.sleep(0.2)
        assert engine.client.check_invariants() == []
    finally:
        engine.close()
    log = d.log()
    assert "storage.unavailable" in log and "storage.recovered" in log and "Traceback" not in log


def wait_until(predicate, seconds: float) -> bool:
    """True once `predicate` holds, False when `seconds` passed first (polls, no fixed sleep)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("flavor", ["redis", "valkey"])
def test_redis_cluster_master_killed_while_daemons_run(daemon_factory, flavor):
    cluster = RedisCluster(flavor=flavor).start()
    try:
        flags = ("--storage", f"{cluster.url}?socket_timeout={STORE_TIMEOUT_S}&retries=1",
                 "--storage-policy", "write_through")
        a, b = daemon_factory(*flags), daemon_factory(*flags)
        writer, reader = EngineDouble.connect(a.target), EngineDouble.connect(b.target)
        assert reader.registration.storage == "redis+cluster"
        try:
            writer.prefill(prompt(11))
            wait_stored(writer, 8 * PS)
            victim = cluster.primaries()[0]
            cluster.kill(victim)
            ([m], seconds) = timed(lambda: reader.client.match([prompt(11)], include_storage=True))
            assert seconds < 2 * ENGINE_BOUND_S  # a dead shard: connect timeouts, then retries
            wait_for(lambda: len(cluster.primaries()) == 3 and victim not in cluster.primaries(), 30,
                     "a replica promoted")
            cluster.wait_ok()
            # Storage recovers with each new operation (a store that meets the client's stale
            # slot map fails and is counted, not retried): new prompts until one is stored.
            fresh = iter(range(12, 40))
            stored = [12]

            def store_one_more():
                stored[0] = next(fresh)
                before = writer.counters()["stored_tokens"]
                writer.prefill(prompt(stored[0]))
                return wait_until(lambda: writer.counters()["stored_tokens"] >= before + 8 * PS, 5)

            wait_for(store_one_more, 60, "a store after the failover")
            for i in (11, stored[0]):  # what the promoted replica holds is exact; anything lost is a miss
                m, progress, loaded, mismatches = fetch_and_load(reader, prompt(i))
                assert mismatches == (0, 0)
            assert loaded == 8 * PS  # the last prompt was stored after the promotion
        finally:
            writer.close()
            reader.close()
    finally:
        cluster.cleanup()


def test_mooncake_frozen_segment_owner_never_blocks_the_reader(mooncake_master, daemon_factory):
    a = daemon_factory(*mooncake_flags(mooncake_master))
    writer = EngineDouble.connect(a.target)
    reader = None
    try:
        for i in (6, 7, 8):
            writer.prefill(prompt(i))
        wait_stored(writer, 3 * 8 * PS)
        # The reader's daemon joins the store after (its start's storage check joins it):
        # every page then lives in the writer's segment only.
        b = daemon_factory(*mooncake_flags(mooncake_master))
        reader = EngineDouble.connect(b.target)
        os.kill(a.pid, signal.SIGSTOP)  # alive but silent: the store's own call would hang ~60 s
        try:
            ([m], seconds) = timed(lambda: reader.client.match([prompt(6)], include_storage=True))
            assert seconds < ENGINE_BOUND_S
            progress, seconds = timed(lambda: reader.client.prefetch(prompt(6), policy="best_effort"))
            assert seconds < ENGINE_BOUND_S
            wait_for(lambda: "storage.fetch_timeout" in b.log(), DEADLINE_S, "the fetch to time out")
            assert _fetch_pending(reader)  # its host pages stay reserved while the store holds them
            for i in (7, 8):  # their fetches time out too, and say so at debug level only
                timed(lambda: reader.client.prefetch(prompt(i), policy="best_effort"))
            loaded, mismatches = reader.load(prompt(6))  # nothing fetched yet: nothing to load
            assert mismatches == (0, 0) and loaded == 0
            # Waiting for the whole fetch, the read that finds the run is the one that hangs:
            # it gives up after the store's timeout with nothing fetched.
            progress, seconds = timed(lambda: reader.client.prefetch(prompt(6), policy="wait_complete"))
            assert seconds < ENGINE_BOUND_S and [p.state for p in progress] == ["nothing"]
        finally:
            os.kill(a.pid, signal.SIGCONT)
        a.kill()  # the stuck call fails once its peer is gone; the reserved pages come back
        wait_for(lambda: not _fetch_pending(reader), 40, "the timed-out fetch to be reported")
        assert reader.client.check_invariants() == []
        reader.prefill(prompt(9))  # and the reader keeps serving
        assert reader.client.check_invariants() == []
    finally:
        if reader is not None:
            reader.close()
        writer.client.close()
    assert "Traceback" not in b.log()
    assert b.log().count("storage.fetch_timeout") == 1  # one line while the node is frozen


def test_a_prefetch_waiting_for_a_fetch_the_store_gave_up_on_is_answered_at_its_timeout(mooncake_master,
                                                                                        daemon_factory):
    """Reading straight into the pool (fetch=direct), the lookup answers (the master does)
    and the fetch hangs on the frozen segment owner: a wait_complete Prefetch is answered
    once the store's call times out, nothing added (it waited for the store to let go,
    30-60 s), while the reserved pages wait for the store."""
    a = daemon_factory(*mooncake_flags(mooncake_master))
    writer = EngineDouble.connect(a.target)
    writer.prefill(prompt(6))
    wait_stored(writer, 8 * PS)
    flags = mooncake_flags(mooncake_master)
    b = daemon_factory(flags[0], flags[1] + "&fetch=direct", *flags[2:])
    reader = EngineDouble.connect(b.target)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        progress, seconds = timed(lambda: reader.client.prefetch(prompt(6), policy="wait_complete"))
        assert seconds < ENGINE_BOUND_S
        assert [(p.state, p.host_tokens_added) for p in progress] == [("started", 0), ("done", 0)]
        assert _fetch_pending(reader)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    a.kill()
    wait_for(lambda: not _fetch_pending(reader), 40, "the timed-out fetch to be reported")
    assert reader.client.check_invariants() == []
    reader.close()


def _fetch_pending(engine: EngineDouble) -> bool:
    return engine.client.stats().namespaces[0].transfers_in_flight > 0
