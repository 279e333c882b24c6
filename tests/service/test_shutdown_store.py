"""A graceful shutdown stores what only the host tier holds (storage write-back, the
default, stores a host copy only when the host evicts it), within
--shutdown-store-timeout, and a storage tier that hangs does not hold the shutdown."""

import json
import signal
import time

import pytest

from tests.support.engine import PS, EngineDouble, prompt

PROMPTS = 4
PAGES = 8  # per prompt


def events(log: str, name: str) -> list[dict]:
    lines = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return [e for e in lines if e.get("event") == name]


def fill_host(engine: EngineDouble) -> None:
    """The prompts on host; storage (write-back) holds none of them yet."""
    engine.prefill_to_host([prompt(i) for i in range(PROMPTS)])
    assert engine.counters()["stored_tokens"] == 0


@pytest.mark.parametrize("timeout", ["20", "0"])
def test_a_graceful_restart_keeps_what_only_the_host_tier_held(daemon_factory, tmp_path, timeout):
    flags = ("--storage", f"file://{tmp_path}/pages", "--log-format", "json")
    first = daemon_factory(*flags, "--shutdown-store-timeout", timeout)
    engine = EngineDouble.connect(first.target)
    fill_host(engine)
    engine.close()
    assert first.stop() == 0
    stored = events(first.log(), "shutdown.stored")
    if timeout == "0":
        assert stored == []
    else:
        assert [(e["stored_pages"], e["of"], e["outcome"]) for e in stored] == \
            [(PROMPTS * PAGES, PROMPTS * PAGES, "all stored")]

    second = daemon_factory(*flags)
    engine = EngineDouble.connect(second.target)
    try:
        for i in range(PROMPTS):
            [m] = engine.client.match([prompt(i)], include_storage=True)
            assert (m.device_tokens, m.host_tokens) == (0, 0)
            if timeout == "0":
                assert m.storage_tokens == 0
                continue
            assert m.storage_tokens == PAGES * PS
            engine.client.prefetch(prompt(i), policy="wait_complete")
            loaded, mismatches = engine.load(prompt(i))
            assert loaded == PAGES * PS and mismatches == (0, 0)
        assert engine.client.check_invariants() == []
    finally:
        engine.close()


def test_a_hung_storage_tier_holds_the_shutdown_only_as_long_as_its_calls_last(daemon_factory, private_redis):
    url = private_redis.url + "?socket_timeout=0.5"  # redis-py's own timeouts bound each call
    d = daemon_factory("--storage", url, "--shutdown-store-timeout", "1", "--log-format", "json")
    engine = EngineDouble.connect(d.target)
    fill_host(engine)
    engine.close()
    private_redis.proc.send_signal(signal.SIGSTOP)  # every store call now waits out its timeouts
    try:
        code = d.stop()  # -9 had it not exited within tests.support.daemon.STOP_TIMEOUT_S
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
    log = d.log()
    assert code == 0, log[-3000:]
    [stored] = events(log, "shutdown.stored")
    assert stored["outcome"] == "time is up" and stored["stored_pages"] == 0, stored
    assert 1.0 <= stored["seconds"] < 5, stored
    # The store in flight when the time was up failed within redis-py's timeouts, and the
    # daemon stopped then: it waited for that call, and for nothing else.
    [failed] = events(log, "storage.unavailable")
    [stopped] = events(log, "daemon.stopped")
    assert stored["ts"] <= failed["ts"] <= stopped["ts"]
    # That call began with the step and lasted its (retries + 1) rounds of socket_timeout
    # plus backoff (redis-py's defaults here: 3 x 0.5 s + at most 2 x 0.5 s), not rounds
    # nested in a connection health check's own retries (9 x 0.5 s).
    began = stored["ts"] - stored["seconds"]
    assert failed["ts"] - began < 3.0, (stored, failed)


def test_a_storage_tier_that_is_down_ends_the_storing_at_its_first_failure(daemon_factory, private_redis):
    d = daemon_factory("--storage", private_redis.url, "--log-format", "json")
    engine = EngineDouble.connect(d.target)
    fill_host(engine)
    engine.close()
    private_redis.stop()
    assert d.stop() == 0
    [stored] = events(d.log(), "shutdown.stored")
    assert stored["outcome"] == "a store failed" and stored["stored_pages"] == 0, stored
