"""A storage tier in trouble is said once in the log, not once per store: an outage as
`storage.unavailable` then `storage.recovered`, a full write queue as `storage.queue_full`
then `storage.queue_drained` (docs/operations.md). Engines insert at scheduler speed, so
a line per failed store would bury every other line while storage is down."""

import json
import signal

from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble, prompt

DEADLINE_S = 20.0
PAGES = 8  # per prompt: one store each (write-through)


def events(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def warnings(log: str) -> list[str]:
    return [e["event"] for e in events(log) if e["level"] in ("warning", "error")]


def count(log: str, name: str) -> int:
    return sum(1 for e in events(log) if e["event"] == name)


def test_an_outage_is_one_warning_and_one_recovery_however_many_stores_fail(daemon_factory, private_redis):
    d = daemon_factory("--storage", private_redis.url, "--storage-policy", "write_through", "--log-format", "json")
    engine = EngineDouble.connect(d.target, model="m")
    try:
        # The start's check (on a thread of its own) first: it records the server's run_id.
        wait_for(lambda: count(d.log(), "storage.checked"), DEADLINE_S, "the start's storage check")
        private_redis.stop()
        for i in range(30):
            engine.prefill(prompt(i))
        wait_for(lambda: engine.counters()["store_failed_tokens"] == 30 * PAGES * PS, DEADLINE_S,
                 "every store to fail")
        assert warnings(d.log()) == ["storage.unavailable"]
        private_redis.start()
        engine.prefill(prompt(99))
        wait_for(lambda: engine.counters()["stored_tokens"] == PAGES * PS, DEADLINE_S, "the store after it")
    finally:
        engine.close()
    log = d.log()
    # The server came back empty (a new run_id): said once too, as what it may have lost.
    assert warnings(log) == ["storage.unavailable", "storage.contents_lost"]
    assert count(log, "storage.recovered") == 1


def test_a_full_write_queue_is_one_warning_until_it_drains(daemon_factory, private_redis):
    # Redis frozen with a long socket timeout: the first two stores wait in flight and
    # fill the queue of 2 x PAGES pages, the next four are refused.
    d = daemon_factory("--storage", private_redis.url + "?socket_timeout=60", "--storage-policy", "write_through",
                       "--storage-queue-pages", str(2 * PAGES), "--log-format", "json")
    engine = EngineDouble.connect(d.target, model="m")
    try:
        private_redis.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(6):
                engine.prefill(prompt(i))
            wait_for(lambda: engine.counters()["store_failed_tokens"] == 4 * PAGES * PS, DEADLINE_S,
                     "four stores refused")
            [full] = [e for e in events(d.log()) if e["event"] == "storage.queue_full"]
            assert (full["pending_pages"], full["max_pending_pages"]) == (2 * PAGES, 2 * PAGES)
        finally:
            private_redis.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: engine.counters()["stored_tokens"] == 2 * PAGES * PS, DEADLINE_S, "the queued stores")
        engine.prefill(prompt(7))
        wait_for(lambda: engine.counters()["stored_tokens"] == 3 * PAGES * PS, DEADLINE_S, "a store after it")
    finally:
        engine.close()
    log = d.log()
    assert warnings(log) == ["storage.queue_full"]
    [drained] = [e for e in events(log) if e["event"] == "storage.queue_drained"]
    assert drained["refused_stores"] == 4


def test_a_store_that_serves_reads_but_refuses_writes_is_one_warning_not_a_flapping_pair(daemon_factory,
                                                                                         private_redis):
    # Redis at maxmemory with noeviction (its default policy) refuses every SET and serves
    # every GET, as a full disk does: prefetches work between the failing stores.
    # A long lookup timeout: a lookup slow on a loaded machine is not what this test is about.
    d = daemon_factory("--storage", private_redis.url, "--storage-policy", "write_through", "--log-format", "json",
                       "--storage-lookup-timeout", "30")
    engine = EngineDouble.connect(d.target, host_pool_pages=2 * PAGES, model="m")
    redis = private_redis.client()
    stored = 20  # more than the host holds: the first ones are in storage only
    try:
        for i in range(stored):  # one at a time: a host full of unstored copies would drop backups
            engine.prefill(prompt(i))
            wait_for(lambda: engine.counters()["stored_tokens"] == (i + 1) * PAGES * PS, DEADLINE_S, "the store")
        redis.config_set("maxmemory-policy", "noeviction")
        redis.config_set("maxmemory", "1")  # below what it uses: every write refused, reads served
        for i in range(10):
            engine.prefill(prompt(100 + i))  # its store is refused
            # Until its refusal lands, the store holds its host pages: with a host of two
            # prompts, the prefetch would find no room (a miss on a slow machine).
            wait_for(lambda: engine.client.stats().namespaces[0].transfers_in_flight == 0, DEADLINE_S,
                     "the copies and the store to settle")
            engine.evict(engine.pool.num_pages)
            [done] = engine.client.prefetch(prompt(i), policy="wait_complete")[-1:]
            assert done.state == "done"  # the read works
        assert engine.counters()["store_failed_tokens"] > 0
        assert engine.counters()["stored_tokens"] == stored * PAGES * PS
    finally:
        redis.close()
        engine.close()
    log = d.log()
    assert warnings(log) == ["storage.unavailable"] and count(log, "storage.recovered") == 0
    [unavailable] = [e for e in events(log) if e["event"] == "storage.unavailable"]
    assert unavailable["direction"] == "write" and "maxmemory" in unavailable["error"]
