"""Saves are asynchronous: a worker starts the daemon's Insert after the step that filled
the blocks and goes on; vLLM must not reuse those blocks until the daemon's copy out of
them is acknowledged (`request_finished` returns True, the worker reports the request in
`get_finished` once its copies are done).

What a user notices if that went wrong: radixkv would hold another request's bytes under
a prompt, and a later hit on that prompt would give other logprobs than vLLM's own cache.
The daemon's copies are slowed down (`--fault-copy-delay`) and vLLM's KV cache holds
only a little more than one request, so the next request needs the blocks of the one that
just finished while the daemon still copies them. (Checked: with `request_finished`
answering False, this test gets other tokens from the radixkv hit.)
"""

from tests.vllm.engines import connector_config, generate, prompt

PROMPT_TOKENS = 2048
BLOCK = 128
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 4  # 2 layers x 2 KV heads x 128 tokens x (K+V of 64 float32)
SMALL_CACHE = dict(kv_cache_memory_bytes=24 * BLOCK_BYTES, max_model_len=PROMPT_TOKENS + 256)
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


def test_a_request_reusing_just_freed_blocks_leaves_the_saved_bytes_intact(engines, daemon_factory):
    a, b = prompt(PROMPT_TOKENS, seed=30), prompt(PROMPT_TOKENS, seed=31)
    plain = engines.start(**SMALL_CACHE)
    [base_b] = generate(plain, [b])
    [base_a] = generate(plain, [a])
    [local_a] = generate(plain, [a])  # vLLM's own prefix cache: the bytes radixkv must return
    engines.stop(plain)
    assert local_a.cached_tokens == CACHEABLE

    daemon = daemon_factory("--fault-copy-delay", "1.0")  # each copy starts 1 s late
    llm = engines.start(daemon.target, **SMALL_CACHE)
    # One token: `a` finishes in the step that saves its blocks, and `b`, which needs 16
    # of the 24 blocks, is scheduled right after, onto `a`'s blocks.
    [cold_a] = generate(llm, [a], max_tokens=1)
    [cold_b] = generate(llm, [b])
    assert cold_a.tokens == base_a.tokens[:1]
    assert (cold_b.tokens, cold_b.logprobs) == (base_b.tokens, base_b.logprobs)
    engines.stop(llm)  # its sessions close once the daemon's copies are done

    fresh = engines.start(daemon.target, **SMALL_CACHE)
    [warm_a] = generate(fresh, [a])
    assert warm_a.cached_tokens == CACHEABLE
    assert (warm_a.tokens, warm_a.logprobs) == (local_a.tokens, local_a.logprobs)


def test_asynchronous_loads_give_vllms_own_bytes_and_a_failed_one_is_recomputed(engines, daemon_factory):
    """`async_loads`: vLLM parks the request while the daemon copies its hit and schedules
    it when the worker reports the load in `get_finished`; a load that fails is reported
    there too, and vLLM recomputes its blocks."""
    p = prompt(PROMPT_TOKENS, seed=32)
    plain = engines.start()
    [base] = generate(plain, [p])
    [local] = generate(plain, [p])
    engines.stop(plain)

    daemon = daemon_factory()
    config = connector_config(daemon.target, async_loads=True)
    llm = engines.start(kv_transfer_config=config)
    [cold] = generate(llm, [p])
    engines.stop(llm)
    restarted = engines.start(kv_transfer_config=config)
    [warm] = generate(restarted, [p])
    assert cold.tokens == base.tokens
    assert warm.cached_tokens == CACHEABLE
    assert (warm.tokens, warm.logprobs) == (local.tokens, local.logprobs)
    engines.stop(restarted)

    failing = daemon_factory("--fault-fail-loads", "1")
    config = connector_config(failing.target, async_loads=True)
    llm = engines.start(kv_transfer_config=config)
    generate(llm, [p])
    engines.stop(llm)
    restarted = engines.start(kv_transfer_config=config)
    [again] = generate(restarted, [p])
    assert again.tokens == base.tokens
