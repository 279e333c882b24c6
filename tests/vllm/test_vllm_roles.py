"""vLLM's kv_role and per-request cache opt-outs, honoured by the connector (real vLLM,
real daemon).

What a user notices: an engine with `kv_role="kv_consumer"` is served from radixkv but
adds nothing to it (an evaluation engine that must not fill the shared cache);
`kv_role="kv_producer"` fills it but never looks anything up (a warmer); a request that
skips reading prefix caches (vLLM sets it for `prompt_logprobs`) is not looked up.
"""

from vllm import SamplingParams

from tests.vllm.engines import connector_config, generate, prompt
from tests.vllm.test_vllm_connector import counters

PROMPT_TOKENS = 1024
BLOCK = 128
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


def with_role(target: str, role: str) -> dict:
    return {**connector_config(target), "kv_role": role}


def test_a_producer_only_saves_and_a_consumer_only_loads(engines, daemon):
    p, q = prompt(PROMPT_TOKENS, seed=51), prompt(PROMPT_TOKENS, seed=52)
    producer = engines.start(kv_transfer_config=with_role(daemon.target, "kv_producer"))
    [cold] = generate(producer, [p])
    engines.stop(producer)
    saved = counters(daemon.target)
    assert saved["inserted_tokens"] == PROMPT_TOKENS and saved["match_requests"] == 0

    producer = engines.start(kv_transfer_config=with_role(daemon.target, "kv_producer"))
    [again] = generate(producer, [p])
    engines.stop(producer)
    assert again.cached_tokens == 0 and counters(daemon.target)["match_requests"] == 0  # never looked up

    consumer = engines.start(kv_transfer_config=with_role(daemon.target, "kv_consumer"))
    [warm] = generate(consumer, [p])
    assert warm.cached_tokens == CACHEABLE and warm.tokens == cold.tokens
    generate(consumer, [q])  # computed in full: nothing of it goes to radixkv
    assert counters(daemon.target)["inserted_tokens"] == PROMPT_TOKENS


def test_a_request_that_skips_reading_prefix_caches_is_not_looked_up(engines, daemon):
    p = prompt(PROMPT_TOKENS, seed=53)
    llm = engines.start(daemon.target)
    generate(llm, [p])
    engines.stop(llm)
    before = counters(daemon.target)["match_requests"]

    llm = engines.start(daemon.target)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    [out] = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    assert len(out.prompt_logprobs) == PROMPT_TOKENS  # every prompt token computed, none loaded
    assert counters(daemon.target)["match_requests"] == before
