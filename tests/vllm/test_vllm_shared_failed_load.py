"""A load that fails under another request of the same step (real vLLM CPU, tiny Llama).

Two requests sharing a prefix radixkv holds are admitted in one step: R1 loads the prefix
into fresh blocks, which vLLM caches at allocation, so R2 takes them as its own prefix hit
and computes its continuation over them in the same forward. R1's load fails. R1 saved
nothing after it, but R2 (no load of its own) saved the blocks it computed over the
unfilled prefix, and a healthy daemon on the same storage later served them: another
engine's output for R2's prompt differed from vLLM alone. Now saves over a load's blocks
wait until every rank reported the load, and none follows a failure
(`SchedulerSide.build`; unit tests: test_vllm_load_reports.py). Found by a review.
"""
from radixkv import Client
from tests.vllm.engines import connector_config, generate, prompt


def counters(target, namespace="tiny"):
    with Client(target, reconnect=None) as c:
        [ns] = c.stats(namespace).namespaces
        return dict(ns.counters)


def test_blocks_computed_over_another_requests_failed_load_are_not_saved(engines, daemon_factory, tmp_path):
    store = f"file://{tmp_path}/pages"
    faulty = daemon_factory("--fault-fail-loads", "1", "--storage", store, "--storage-policy", "write_through")
    head = prompt(1024, seed=10)
    r1 = head + prompt(1025, seed=11)
    r2 = head + prompt(1025, seed=12)

    llm = engines.start(faulty.target, max_num_batched_tokens=8192)
    generate(llm, [head + [5]])          # radixkv now holds `head` (8 blocks)
    engines.stop(llm)
    before = counters(faulty.target)
    assert before["inserted_tokens"] == 1024

    llm = engines.start(faulty.target, max_num_batched_tokens=8192)
    generate(llm, [r1, r2])              # one step: R1 loads `head` (fails), R2 shares R1's blocks
    engines.stop(llm)
    after = counters(faulty.target)
    assert after["failed_load_tokens"] >= 1024, "R1's load failed"
    saved_over_failure = after["inserted_tokens"] - before["inserted_tokens"]

    # Phase 2: what a user gets. A healthy daemon on the same storage, a fresh engine.
    faulty.stop()
    healthy = daemon_factory("--storage", store)
    plain = engines.start()
    [base] = generate(plain, [r2])
    engines.stop(plain)
    llm = engines.start(healthy.target)
    [served] = generate(llm, [r2])
    engines.stop(llm)
    assert saved_over_failure == 0, "blocks computed over another request's failed load were saved"
    assert served.tokens == base.tokens
