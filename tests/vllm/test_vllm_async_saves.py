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

from tests.vllm.engines import generate, prompt

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
