"""A store that stops answering (a frozen node, a network partition that drops packets)
never holds an engine call past --storage-lookup-timeout, whatever the store client's own
timeouts add up to: the lookup answers "nothing stored", later lookups skip storage at
once until the late one ends, and storage is used again when the store answers."""

import contextlib
import json
import os
import signal
import time

import pytest

from tests.storage.fleet import RedisCluster
from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble, prompt

LOOKUP_TIMEOUT_S = 0.5
CALL_BOUND_S = LOOKUP_TIMEOUT_S + 1.5  # the lookup's wait and the call's own work, on a busy machine
DEADLINE_S = 30.0
PAGES = 8  # per prompt


@contextlib.contextmanager
def frozen_store(request, kind: str):
    """(storage URL, pids that freeze it) of a private store. The single Redis is told
    to wait a minute per read, so only the daemon's own limit can end a lookup early; the
    cluster keeps redis-py's defaults (a frozen 3-master cluster costs a GET about 8 s:
    a socket timeout per shard, then a topology refresh)."""
    if kind == "redis":
        server = request.getfixturevalue("private_redis")
        yield server.url + "?socket_timeout=60", [server.proc.pid]
        return
    cluster = RedisCluster(masters=3, replicas=0).start()
    try:
        yield cluster.url, [p.pid for p in cluster.procs.values()]
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
                    assert seconds < LOOKUP_TIMEOUT_S and m.storage_tokens == 0
                progress, seconds = timed(lambda: engine.client.prefetch(prompt(1), policy="wait_complete"))
                assert seconds < LOOKUP_TIMEOUT_S and [p.state for p in progress] == ["nothing"]
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
