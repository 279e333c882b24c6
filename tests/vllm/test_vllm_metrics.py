"""radixkv in vLLM's own metrics (real vLLM, real daemon): what an operator reads on
vLLM's /metrics (here `LLM.get_metrics()`, the same Prometheus registry).

A host hit is filed under `vllm:prompt_tokens_cached_by_source{source="host"}` and counted
in the connector's series (`vllm:radixkv_*`): one lookup per request, one load of the hit's
blocks, the blocks computed handed over to save. Storage hits and failed loads are shown
in test_vllm_connector.py's storage and fault tests.
"""

from tests.vllm.engines import generate, prompt, vllm_metric

PROMPT_TOKENS = 2048
BLOCK = 128
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


def test_a_host_hit_shows_in_vllms_metrics_by_source_and_in_the_connectors_counts(engines, daemon):
    p = prompt(PROMPT_TOKENS, seed=21)
    cold_engine = engines.start(daemon.target, disable_log_stats=False)
    [cold] = generate(cold_engine, [p])
    assert vllm_metric(cold_engine, "vllm:radixkv_lookups_total") == 1
    assert vllm_metric(cold_engine, "vllm:radixkv_loads_total") == 0
    assert vllm_metric(cold_engine, "vllm:radixkv_save_blocks_total") == PROMPT_TOKENS // BLOCK
    engines.stop(cold_engine)

    warm_engine = engines.start(daemon.target, disable_log_stats=False)  # a fresh registry: counts start at 0
    [warm] = generate(warm_engine, [p])
    assert warm.cached_tokens == CACHEABLE and warm.tokens == cold.tokens
    assert vllm_metric(warm_engine, "vllm:prompt_tokens_cached_by_source", source="host") == CACHEABLE
    assert vllm_metric(warm_engine, "vllm:prompt_tokens_cached_by_source", source="disk") == 0
    assert vllm_metric(warm_engine, "vllm:radixkv_lookups_total") == 1
    assert vllm_metric(warm_engine, "vllm:radixkv_loads_total") == 1
    assert vllm_metric(warm_engine, "vllm:radixkv_loaded_blocks_total") == CACHEABLE // BLOCK
    assert vllm_metric(warm_engine, "vllm:radixkv_load_failed_blocks_total") == 0
    assert vllm_metric(warm_engine, "vllm:radixkv_staged_prompts_total") == 0
    # only the block the hit did not cover was computed, and only it goes to radixkv
    assert vllm_metric(warm_engine, "vllm:radixkv_save_blocks_total") == 1


def test_lookups_the_daemon_cannot_answer_are_counted_as_failures(engines, daemon_factory):
    daemon = daemon_factory()
    llm = engines.start(daemon.target, disable_log_stats=False)
    daemon.kill()  # SIGKILL: lookups find no daemon
    p = prompt(PROMPT_TOKENS, seed=22)
    [result] = generate(llm, [p])
    assert result.cached_tokens == 0
    assert vllm_metric(llm, "vllm:radixkv_lookup_failures_total") == vllm_metric(llm, "vllm:radixkv_lookups_total") >= 1
