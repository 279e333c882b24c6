"""radixkv as vLLM's KV connector, with real vLLM (CPU build) and a real daemon.

What a user notices: the output does not change with radixkv (cold or warm); a restarted
vLLM serves a known prefix from radixkv's host tier (vLLM reports the cached tokens, the
daemon counts the host hit and the load); a wrong daemon address or a namespace holding
another model's layout stops vLLM at startup with a message naming the problem.
"""

import pytest

from radixkv import Client, KvLayout
from radixkv.vllm.testing import reset_prefix_cache
from tests.support.daemon import wait_for

from tests.vllm.engines import connector_config, generate, prompt, vllm_metric

PROMPT_TOKENS = 2048
BLOCK = 128
# vLLM computes at least the last prompt token, so a 2048-token prompt can take 15 of
# its 16 blocks from a cache.
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


def counters(target: str, namespace: str = "tiny") -> dict:
    with Client(target, reconnect=None) as c:
        [ns] = c.stats(namespace).namespaces
        return dict(ns.counters)


def test_output_is_the_same_without_radixkv_cold_and_warm(engines, daemon):
    p = prompt(PROMPT_TOKENS, seed=1)
    plain = engines.start()
    [base] = generate(plain, [p])
    [local] = generate(plain, [p])  # served from vLLM's own prefix cache
    engines.stop(plain)
    assert local.cached_tokens == CACHEABLE

    llm = engines.start(daemon.target)
    [cold] = generate(llm, [p])
    engines.stop(llm)
    assert (cold.tokens, cold.logprobs) == (base.tokens, base.logprobs)
    assert cold.cached_tokens == 0
    saved = counters(daemon.target)
    assert saved["inserted_tokens"] >= PROMPT_TOKENS  # every full block, once

    restarted = engines.start(daemon.target)  # vLLM's own prefix cache is empty now
    [warm] = generate(restarted, [p])
    assert warm.cached_tokens == CACHEABLE
    # Bit for bit what vLLM's own prefix cache gives (both differ from a cold prefill in
    # the last float digits: the last block is computed apart from the rest).
    assert (warm.tokens, warm.logprobs) == (local.tokens, local.logprobs)
    assert warm.tokens == base.tokens
    after = counters(daemon.target)
    assert after["loaded_tokens"] - saved["loaded_tokens"] == CACHEABLE
    assert after["host_hit_tokens"] > saved["host_hit_tokens"]


def test_a_second_prompt_sharing_a_prefix_loads_only_what_vllm_lacks(engines, daemon):
    """vLLM's own cache holds the first blocks; radixkv supplies the rest, and the blocks
    vLLM shares are never written (the output equals a run without radixkv)."""
    shared = prompt(1024, seed=2)
    long = shared + prompt(1024, seed=3)
    plain = engines.start()
    [base] = generate(plain, [long])
    engines.stop(plain)

    first = engines.start(daemon.target)
    generate(first, [long])  # radixkv now holds all of it
    engines.stop(first)
    llm = engines.start(daemon.target)
    generate(llm, [shared + prompt(64, seed=4)])  # vLLM's cache: the shared blocks
    before = counters(daemon.target)
    [again] = generate(llm, [long])
    assert again.cached_tokens == CACHEABLE
    assert again.tokens == base.tokens
    loaded = counters(daemon.target)["loaded_tokens"] - before["loaded_tokens"]
    assert loaded == CACHEABLE - 1024


def test_a_wrong_daemon_address_stops_vllm_at_startup(engines, tmp_path):
    target = f"unix://{tmp_path}/nobody.sock"
    with pytest.raises(Exception, match="radixkv: cannot register") as info:
        engines.start(kv_transfer_config=connector_config(target, connect_timeout_s=1))
    assert target in str(info.value)


def test_a_namespace_with_another_layout_stops_vllm_at_startup(engines, daemon):
    other = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
    with Client(daemon.target) as c:  # another model's engine used "tiny" before
        from radixkv.kvbuffers import ShmKvBuffers
        bufs = ShmKvBuffers.create(other, 8)
        try:
            c.register("tiny", other, [(b.handle, b.offset, b.size) for b in bufs.specs()], 8,
                       device_tier="engine_managed")
            c.close()
        finally:
            bufs.close()
    with pytest.raises(Exception, match="radixkv: cannot register.*layout"):
        engines.start(daemon.target)


def test_another_model_on_the_namespace_stops_vllm_at_startup(engines, daemon, tmp_path):
    """Weights of the same shape (a fine-tune, another checkpoint) compute other KV: an
    engine of another model must not be served what the namespace holds."""
    from radixkv.vllm.testing import write_tiny_llama
    llm = engines.start(daemon.target)
    generate(llm, [prompt(PROMPT_TOKENS, seed=12)])
    engines.stop(llm)
    other = write_tiny_llama(str(tmp_path / "other"), seed=1)  # same layout, other weights
    with pytest.raises(Exception, match=f"radixkv: cannot register.*holds KV of model .*not '{other} weights=[0-9a-f]{{16}} device=cpu"):
        engines.start(daemon.target, model=other)
    # the same weights elsewhere share the namespace when the connector is told they are the
    # same: `model` set to the identity the first engine registered by default
    from radixkv.vllm.fingerprints import model_fingerprint
    registered = f"{engines.model} weights={model_fingerprint(engines.model)}"
    same = engines.start(model=other, kv_transfer_config=connector_config(daemon.target, model=registered))
    engines.stop(same)


def test_unknown_connector_settings_are_refused(engines, daemon):
    with pytest.raises(Exception, match="unknown kv_connector_extra_config keys.*'tagret'"):
        engines.start(kv_transfer_config=connector_config(daemon.target, tagret="x"))


def test_a_restarted_daemon_with_file_storage_serves_the_prefix_from_storage(engines, daemon_factory, tmp_path):
    flags = ("--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    p = prompt(PROMPT_TOKENS, seed=5)
    first = daemon_factory(*flags)
    llm = engines.start(first.target)
    [cold] = generate(llm, [p])
    engines.stop(llm)
    wait_for(lambda: counters(first.target)["stored_tokens"] >= PROMPT_TOKENS, 30, "pages stored")
    assert first.stop() == 0

    second = daemon_factory(*flags)  # empty host tier, same storage
    llm = engines.start(second.target, disable_log_stats=False)
    [warm] = generate(llm, [p])
    assert warm.cached_tokens == CACHEABLE
    assert warm.tokens == cold.tokens
    after = counters(second.target)
    assert after["prefetched_tokens"] >= CACHEABLE and after["loaded_tokens"] == CACHEABLE
    # vLLM's /metrics files the hit under disk (file storage), the connector counts the staging
    assert vllm_metric(llm, "vllm:prompt_tokens_cached_by_source", source="disk") == CACHEABLE
    assert vllm_metric(llm, "vllm:prompt_tokens_cached_by_source", source="host") == 0
    assert vllm_metric(llm, "vllm:radixkv_staged_prompts_total") == 1


def test_a_second_instance_on_the_namespace_hits_what_the_first_computed(engines, daemon, monkeypatch):
    """Two vLLM instances of one model, both running in vLLM's multiprocessing layout (as
    `vllm serve` runs: the scheduler and the worker in processes of their own, the
    worker's session answering the scheduler's lookups), share one engine-managed
    namespace: the second serves the first's prompt from radixkv."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    p = prompt(1024, seed=8)
    first = engines.start(daemon.target)
    [cold] = generate(first, [p])
    second = engines.start(daemon.target)
    [warm] = generate(second, [p])
    assert warm.cached_tokens == 1023 // BLOCK * BLOCK
    assert warm.tokens == cold.tokens
    assert counters(daemon.target)["loaded_tokens"] == 1023 // BLOCK * BLOCK
    [again] = generate(first, [p + prompt(8, seed=9)])  # the first instance keeps working
    assert again.cached_tokens == 1024


def test_the_default_namespace_follows_the_model_not_the_name_it_is_served_under(engines, daemon, tmp_path):
    """`served_model_name` names an endpoint, not the KV: engines of one model served
    under other names share it by default, and an engine of other weights served under
    a name already in use starts (no hit) instead of being refused the name's namespace."""
    from radixkv.vllm.testing import write_tiny_llama
    p = prompt(1024, seed=13)
    default = dict(kv_transfer_config=connector_config(daemon.target, namespace=""))  # the default namespace
    llm = engines.start(served_model_name="alpha", **default)
    [cold] = generate(llm, [p])
    engines.stop(llm)
    llm = engines.start(served_model_name="beta", **default)
    [warm] = generate(llm, [p])
    engines.stop(llm)
    assert (warm.cached_tokens, warm.tokens) == (1023 // BLOCK * BLOCK, cold.tokens)
    other = engines.start(model=write_tiny_llama(str(tmp_path / "other"), seed=1), served_model_name="alpha", **default)
    [fresh] = generate(other, [p])
    assert fresh.cached_tokens == 0


def test_a_load_that_fails_is_recomputed_with_the_same_output(engines, daemon_factory):
    daemon = daemon_factory("--fault-fail-loads", "1")  # every host->device copy fails
    p = prompt(PROMPT_TOKENS, seed=7)
    llm = engines.start(daemon.target)
    [cold] = generate(llm, [p])
    engines.stop(llm)
    restarted = engines.start(daemon.target, disable_log_stats=False)
    [again] = generate(restarted, [p])
    assert again.tokens == cold.tokens
    assert counters(daemon.target)["failed_load_tokens"] >= CACHEABLE
    assert vllm_metric(restarted, "vllm:radixkv_load_failed_blocks_total") == CACHEABLE // BLOCK
    assert vllm_metric(restarted, "vllm:radixkv_loaded_blocks_total") == 0
    [after] = generate(restarted, [p])  # the connector still works after the failure
    assert after.tokens == cold.tokens


def test_a_step_whose_load_failed_saves_nothing_it_computed(engines, daemon_factory):
    """The forward after a failed load read blocks the load left unfilled, so the blocks it
    computed are wrong (vLLM recomputes them): none of them may reach radixkv."""
    daemon = daemon_factory("--fault-fail-loads", "1")
    head = prompt(1024, seed=10)
    llm = engines.start(daemon.target)
    generate(llm, [head])
    engines.stop(llm)
    assert counters(daemon.target)["inserted_tokens"] == 1024
    restarted = engines.start(daemon.target)
    generate(restarted, [head + prompt(1024, seed=11)])  # hits `head`; its load fails
    after = counters(daemon.target)
    assert after["failed_load_tokens"] >= 1024
    assert after["inserted_tokens"] == 1024, "blocks computed over a failed load were saved"


def test_a_second_engine_in_the_process_is_refused_and_the_first_keeps_its_hits(engines, daemon):
    """vLLM keeps one worker-side connector per process: a second engine here would get
    the first one's and register its KV memory over the first's (both then read wrong
    KV). It fails to start saying so; the first engine goes on, hits included."""
    p = prompt(PROMPT_TOKENS, seed=21)
    plain = engines.start()
    [base] = generate(plain, [p])
    engines.stop(plain)

    first = engines.start(daemon.target)
    generate(first, [p])  # radixkv now holds it
    with pytest.raises(Exception, match="another vLLM engine in this process already uses this KV connector"):
        engines.start(daemon.target)
    reset_prefix_cache(first)  # the next hit can only come from radixkv
    before = counters(daemon.target)
    [again] = generate(first, [p])
    assert again.cached_tokens == CACHEABLE
    assert again.tokens == base.tokens
    assert counters(daemon.target)["loaded_tokens"] - before["loaded_tokens"] == CACHEABLE
