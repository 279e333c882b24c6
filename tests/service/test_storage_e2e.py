"""The storage tier end to end on one node's stores: real daemons, a real page directory
or redis-server, byte-exact round trips through prefetch and load-back (the fleet stores,
Mooncake Store and Redis Cluster: test_storage_fleet_e2e.py)."""

import os

from radixkv_server.core.page_keys import namespace_salt, page_keys
from radixkv_server.core.page_keys import layout_fingerprint
from radixkv_server.storage import FileStorage
from tests.support.daemon import wait_for

from tests.support.engine import LAYOUT, PS, EngineDouble, prompt

DEADLINE_S = 20.0


def wait_stored(engine: EngineDouble, tokens: int) -> None:
    wait_for(lambda: engine.counters()["stored_tokens"] >= tokens, DEADLINE_S, f"{tokens} tokens stored")


def fetch_and_load(engine: EngineDouble, tokens: list[int]):
    [m] = engine.client.match([tokens], include_storage=True)
    progress = engine.client.prefetch(tokens, policy="wait_complete")
    loaded, mismatches = engine.load(tokens)
    return m, progress, loaded, mismatches


def test_warm_restart_serves_prefixes_inserted_before(daemon_factory, tmp_path):
    flags = ("--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    first = daemon_factory(*flags)
    engine = EngineDouble.connect(first.target)
    for i in range(4):
        engine.prefill(prompt(i))
    wait_stored(engine, 4 * 8 * PS)
    engine.close()
    assert first.stop() == 0

    second = daemon_factory(*flags)
    engine = EngineDouble.connect(second.target)
    assert engine.registration.storage == "file"  # the daemon names its storage tier to engines
    try:
        for i in range(4):
            m, progress, loaded, mismatches = fetch_and_load(engine, prompt(i))
            assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 8 * PS)
            assert [p.state for p in progress] == ["started", "done"]
            assert progress[-1].host_tokens_added == 8 * PS
            assert loaded == 8 * PS and mismatches == (0, 0)
        assert engine.client.check_invariants() == []
    finally:
        engine.close()


def test_two_daemons_sharing_redis_serve_each_others_prefixes(daemon_factory, redis_url):
    flags = ("--storage", redis_url, "--storage-policy", "write_through")
    a, b = daemon_factory(*flags), daemon_factory(*flags)
    writer, reader = EngineDouble.connect(a.target), EngineDouble.connect(b.target)
    assert writer.registration.storage == reader.registration.storage == "redis"
    try:
        writer.prefill(prompt(7))
        wait_stored(writer, 8 * PS)
        m, progress, loaded, mismatches = fetch_and_load(reader, prompt(7))
        assert m.storage_tokens == 8 * PS and progress[-1].state == "done"
        assert loaded == 8 * PS and mismatches == (0, 0)
        # Another model under the same namespace name shares nothing.
        other = EngineDouble.connect(b.target, namespace="other/tp0", model="another-model")
        try:
            [m] = other.client.match([prompt(7)], include_storage=True)
            assert m.storage_tokens == 0
        finally:
            other.close()
    finally:
        writer.close()
        reader.close()


def test_a_prefetch_from_redis_reads_its_pages_in_the_round_trip_that_finds_them(daemon_factory, redis_server,
                                                                               redis_url):
    """No EXISTS probe before the GETs: the read that finds the run is the fetch."""
    flags = ("--storage", redis_url, "--storage-policy", "write_through")
    writer = EngineDouble.connect(daemon_factory(*flags).target)
    reader = EngineDouble.connect(daemon_factory(*flags).target)
    admin = redis_server.client()
    try:
        writer.prefill(prompt(8))
        wait_stored(writer, 8 * PS)
        admin.config_resetstat()
        progress = reader.client.prefetch(prompt(8), policy="wait_complete")
        assert progress[-1].state == "done" and progress[-1].host_tokens_added == 8 * PS
        commands = {name: stats["calls"] for name, stats in admin.info("commandstats").items()}
        assert commands.get("cmdstat_mget") == 1 and "cmdstat_exists" not in commands, commands
        loaded, mismatches = reader.load(prompt(8))
        assert loaded == 8 * PS and mismatches == (0, 0)
    finally:
        admin.close()
        writer.close()
        reader.close()


def test_storage_outage_keeps_the_daemon_serving_and_it_recovers(daemon_factory, private_redis):
    d = daemon_factory("--storage", private_redis.url, "--storage-policy", "write_through")
    engine = EngineDouble.connect(d.target)
    try:
        engine.prefill(prompt(1))
        wait_stored(engine, 8 * PS)
        private_redis.stop()
        engine.prefill(prompt(2))  # device and host keep working
        wait_for(lambda: engine.counters()["store_failed_tokens"] >= 8 * PS, DEADLINE_S, "the failed store")
        [m] = engine.client.match([prompt(2)], include_storage=True)
        assert m.device_tokens == 8 * PS and m.storage_tokens == 0
        assert engine.evict(16)  # host copies exist: evicting is free
        loaded, mismatches = engine.load(prompt(2))
        assert loaded == 8 * PS and mismatches == (0, 0)
        private_redis.start()
        engine.prefill(prompt(3))
        wait_stored(engine, 2 * 8 * PS)
        assert engine.client.check_invariants() == []
    finally:
        engine.close()
    log = d.log()
    assert "storage.unavailable" in log and "storage.recovered" in log
    assert "Traceback" not in log


def test_pages_a_restarted_redis_lost_are_stored_again_before_they_leave_the_host(daemon_factory, private_redis):
    """Redis restarted without persistence holds nothing, yet the cache still counted A
    as stored: evicted from the host, A left at once and was lost. The daemon sees the
    new server (its run_id) and stores A again before it leaves the host."""
    d = daemon_factory("--storage", private_redis.url, "--storage-policy", "write_through", metrics=True)
    engine = EngineDouble.connect(d.target, host_pool_pages=16)
    other = EngineDouble.connect(d.target, "other/tp0")  # makes no storage call after the restart
    try:
        engine.prefill(prompt(1))
        other.prefill(prompt(5))
        wait_stored(engine, 8 * PS)
        wait_stored(other, 8 * PS)
        assert "radixkv_storage_contents_lost_total 0.0" in d.scrape()
        private_redis.stop()
        private_redis.start()  # empty
        engine.prefill(prompt(2))  # its store reconnects, and meets the new server
        wait_stored(engine, 2 * 8 * PS)
        forgotten = lambda: {line.split("namespace=")[1].split()[0]  # noqa: E731
                             for line in d.log().splitlines() if "event=storage.forgotten" in line}
        wait_for(lambda: forgotten() == {"model/tp0", "other/tp0"}, DEADLINE_S, "both namespaces told")
        assert "storage.contents_lost" in d.log()
        assert "radixkv_storage_contents_lost_total 1.0" in d.scrape()  # one restart, however many namespaces
        engine.evict(engine.pool.num_pages)  # both on host only now
        for i in (3, 4):  # 16 more host pages: prompt 1, the oldest, leaves the host
            engine.prefill(prompt(i))
        engine.evict(engine.pool.num_pages)
        wait_for(lambda: engine.client.match([prompt(1)], include_storage=True)[0].storage_tokens == 8 * PS,
                 DEADLINE_S, "prompt 1 in storage again")
        assert engine.client.match([prompt(1)])[0].host_tokens == 0  # it did leave the host
        assert engine.client.check_invariants() == []
    finally:
        engine.close()
        other.close()


def test_a_corrupted_page_file_reads_as_a_miss(daemon_factory, tmp_path):
    flags = ("--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    first = daemon_factory(*flags)
    engine = EngineDouble.connect(first.target)
    engine.prefill(prompt(5))
    wait_stored(engine, 8 * PS)
    engine.close()
    assert first.stop() == 0

    salt = namespace_salt("model/tp0", layout_fingerprint(LAYOUT))
    keys = page_keys(salt, bytes(b"".join(t.to_bytes(4, "little") for t in prompt(5))), PS)
    path = FileStorage(str(tmp_path / "pages")).path_for(keys[3])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        f.write(b"\xff\xfe\xfd\xfc\xfb")

    second = daemon_factory(*flags)
    engine = EngineDouble.connect(second.target)
    try:
        m, progress, loaded, mismatches = fetch_and_load(engine, prompt(5))
        assert progress[-1].fetched_tokens == 3 * PS  # stopped at the damaged page
        assert loaded == 3 * PS and mismatches == (0, 0)
        assert engine.client.check_invariants() == []
    finally:
        engine.close()


# -- fleets: Mooncake Store and Redis Cluster, shared by daemons on "two nodes" ------------
