"""radixkv in vLLM's own metrics (real vLLM, real daemon): what an operator reads on
vLLM's /metrics (here `LLM.get_metrics()`, the same Prometheus registry).

A host hit is filed under `vllm:prompt_tokens_cached_by_source{source="host"}` and counted
in the connector's series (`vllm:radixkv_*`): one lookup per request, one load of the hit's
blocks, the blocks computed handed over to save. How long radixkv made the request wait
shows in the connector's histograms (the lookup, the load's wait, the scheduler's time in
the connector per step) and as milliseconds in vLLM's "KV Transfer metrics" log line.
Storage hits and failed loads are shown in test_vllm_connector.py's storage and fault tests.
"""

import logging
import re
import time

import pytest

from radixkv.vllm import RadixKVConnector
from tests.vllm.engines import generate, prompt, vllm_histogram, vllm_metric
from tests.vllm.log_lines import LogLines

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


def test_a_host_hits_lookup_and_load_wait_show_in_vllms_latency_histograms_and_log_line(engines, daemon):
    p = prompt(PROMPT_TOKENS, seed=23)
    cold_engine = engines.start(daemon.target, disable_log_stats=False)
    generate(cold_engine, [p], max_tokens=1)
    engines.stop(cold_engine)

    warm_engine = engines.start(daemon.target, disable_log_stats=False)
    start = time.perf_counter()
    [warm] = generate(warm_engine, [p])
    elapsed = time.perf_counter() - start
    assert warm.cached_tokens == CACHEABLE
    lookups, looked_up = vllm_histogram(warm_engine, "vllm:radixkv_lookup_seconds")
    assert lookups == vllm_metric(warm_engine, "vllm:radixkv_lookups_total") == 1
    assert 0 < looked_up < elapsed
    loads, waited = vllm_histogram(warm_engine, "vllm:radixkv_load_wait_seconds")
    assert loads == vllm_metric(warm_engine, "vllm:radixkv_loads_total") == 1  # one rank
    assert 0 < waited < elapsed
    steps, in_connector = vllm_histogram(warm_engine, "vllm:radixkv_scheduler_step_seconds")
    assert steps >= 8  # a step per generated token at least, and the steps the lookup waited
    assert 0 < in_connector < elapsed

    line = _kv_transfer_log_line(warm_engine)
    assert float(re.search(r"load_wait_ms_avg=([\d.]+)", line)[1]) == pytest.approx(waited * 1e3, abs=1e-3)
    assert float(re.search(r"lookup_ms_max=([\d.]+)", line)[1]) == pytest.approx(looked_up * 1e3, abs=1e-3)


def test_every_ranks_load_waits_are_kept_when_vllm_merges_the_stats():
    """vLLM merges each tensor-parallel rank's stats, then the scheduler's: loads count
    once (the scheduler's count), each rank's wait is an observation of its own."""
    build = RadixKVConnector.build_kv_connector_stats
    merged = build({"load_wait_seconds": [0.002]}).aggregate(build({"load_wait_seconds": [0.004]}))
    merged = merged.aggregate(build({"loads": 1, "lookup_seconds": [0.01], "scheduler_step_seconds": [1e-4]}))
    assert merged.reduce() == {"loads": 1, "lookup_ms_avg": 10.0, "lookup_ms_max": 10.0, "load_wait_ms_avg": 3.0,
                               "load_wait_ms_max": 4.0, "scheduler_step_ms_avg": 0.1, "scheduler_step_ms_max": 0.1}


def _kv_transfer_log_line(llm) -> str:
    """The "KV Transfer metrics" line vLLM logs for the stats since the engine started
    (an idle engine logs it at debug)."""
    with LogLines(logging.DEBUG, "vllm.v1.metrics.loggers") as lines:
        llm.llm_engine.do_log_stats()
    [line] = [m for m in lines.messages(logging.DEBUG) if m.startswith("KV Transfer metrics")]
    return line
