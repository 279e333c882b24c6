"""radixkv as one child of vLLM's MultiConnector (real vLLM, real daemon), beside vLLM's
ExampleConnector (safetensors on disk): the way deployments chain a node cache with another
connector (a disk tier, a P/D transfer).

What a user notices: both children save; a known prompt is served by the first child that
has it (radixkv, then the disk connector once the daemon lost its host tier), with the
same output; radixkv's series and hit sources reach vLLM's metrics through MultiConnector
(which looks a child's stats class up by name: the connector registers its name).
"""

from tests.vllm.engines import connector_config, generate, prompt, vllm_metric
from tests.vllm.test_vllm_connector import counters

PROMPT_TOKENS = 1024
BLOCK = 128
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


def multi(target: str, disk: str) -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [
                connector_config(target),
                {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": disk}}]}}


def test_radixkv_first_then_a_disk_connector_under_multiconnector(engines, daemon_factory, tmp_path):
    disk = str(tmp_path / "example-connector")
    p = prompt(PROMPT_TOKENS, seed=61)
    first = daemon_factory()
    llm = engines.start(kv_transfer_config=multi(first.target, disk), disable_log_stats=False)
    [cold] = generate(llm, [p])
    engines.stop(llm)
    assert counters(first.target)["inserted_tokens"] == PROMPT_TOKENS  # radixkv saved its part

    llm = engines.start(kv_transfer_config=multi(first.target, disk), disable_log_stats=False)
    [warm] = generate(llm, [p])
    assert warm.cached_tokens == CACHEABLE and warm.tokens == cold.tokens
    assert counters(first.target)["loaded_tokens"] == CACHEABLE  # radixkv, first in the list, served it
    assert vllm_metric(llm, "vllm:radixkv_loaded_blocks_total") == CACHEABLE // BLOCK
    assert vllm_metric(llm, "vllm:prompt_tokens_cached_by_source", source="host") == CACHEABLE
    engines.stop(llm)
    assert first.stop() == 0

    second = daemon_factory()  # an empty daemon: the disk connector has the prompt
    llm = engines.start(kv_transfer_config=multi(second.target, disk), disable_log_stats=False)
    [from_disk] = generate(llm, [p])
    assert from_disk.cached_tokens == CACHEABLE and from_disk.tokens == cold.tokens
    assert counters(second.target)["loaded_tokens"] == 0
    assert vllm_metric(llm, "vllm:radixkv_lookups_total") == 1
