"""A burst of waiting requests is looked up in Matches the daemon takes. vLLM asks the
connector for every waiting request in one step (a request answered None does not use
the step's token budget), so after a burst the step's Match carried them all, past the
daemon's --max-prompts-per-match: refused RESOURCE_EXHAUSTED whole, and every lookup of
the step was a miss (found by a review of the limits the client copies from the daemon).
The daemon now says its limit at Register and the scheduler splits its batch by it."""

import time

from radixkv import Client
from radixkv.types import Prompt
from radixkv.vllm import lookups as lookups_module
from radixkv.vllm.lookups import Lookups, batches
from tests.vllm.test_vllm_adapter import SAVED, open_sessions, shm_kv  # noqa: F401 (a fixture)

LIMIT = 8
BURST = 3 * LIMIT + 2


def test_a_burst_past_the_daemons_prompts_per_match_is_looked_up_whole(shm_kv, daemon_factory):  # noqa: F811
    daemon = daemon_factory("--max-prompts-per-match", str(LIMIT))
    with open_sessions(shm_kv, daemon) as (_, _, scheduler):
        lookups = Lookups.open(scheduler.config, scheduler.layout, engine="test lookups", tp_size=1, instance="")
        try:
            ids = [f"r{i}" for i in range(BURST)]
            hits = {}
            deadline = time.monotonic() + 20
            while len(hits) < BURST:  # one scheduler step per pass, every waiting request asked
                assert time.monotonic() < deadline, f"{BURST - len(hits)} lookups never landed"
                hits.update((r, h) for r in ids if r not in hits and (h := lookups.poll(r, lambda: SAVED)) is not None)
                lookups.send()
            counts = lookups.take_counts()
            assert (counts["lookups"], counts["lookup_failures"]) == (BURST, 0)
            assert all(h.tokens == len(SAVED) // 4 and h.lease for h in hits.values())
            with Client(daemon.target) as c:
                [ns] = c.stats("unit").namespaces
                assert ns.counters["match_requests"] >= BURST // LIMIT + 1
            for r in ids:
                lookups.drop(r)
        finally:
            lookups.close()


def test_batches_keep_order_and_bound_prompts_and_bytes(monkeypatch):
    monkeypatch.setattr(lookups_module, "MATCH_BYTES", 100)
    asked = {f"r{i}": Prompt(b"\0" * 40) for i in range(5)} | {"long": Prompt(b"\0" * 400), "last": Prompt(b"\1" * 8)}
    got = batches(asked, most=4)
    assert [list(b) for b in got] == [["r0", "r1"], ["r2", "r3"], ["r4"], ["long"], ["last"]]
    assert [list(b) for b in batches({f"r{i}": Prompt(b"") for i in range(5)}, most=2)] == \
        [["r0", "r1"], ["r2", "r3"], ["r4"]]
