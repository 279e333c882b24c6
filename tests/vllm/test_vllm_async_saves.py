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


def test_a_request_aborted_while_its_asynchronous_load_runs_is_freed_once(engines, daemon_factory):
    """A request vLLM parked for its asynchronous load and then aborted: vLLM keeps its
    blocks until the worker reports the receive over and frees them then. Were the
    connector to also keep them for itself (`request_finished` True, listed again among
    the finished sends), vLLM would free the request twice, and its scheduler stops on an
    assertion. (Checked: that is what the connector did, found by a randomized run.)"""
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    from tests.support.daemon import wait_for

    from tests.vllm.test_vllm_leases import namespace_stats

    p = prompt(PROMPT_TOKENS, seed=33)
    plain = engines.start()
    [base] = generate(plain, [p])
    engines.stop(plain)

    daemon = daemon_factory("--fault-copy-delay", "0.5")  # each copy starts 0.5 s late
    config = connector_config(daemon.target, async_loads=True)
    first = engines.start(kv_transfer_config=config)
    generate(first, [p])  # radixkv now holds p
    engines.stop(first)
    llm = engines.start(kv_transfer_config=config)  # its own prefix cache is empty
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # vLLM's engine core runs in this process here
    rid = engine.add_request("aborted", {"prompt_token_ids": p}, SamplingParams(max_tokens=4))  # vLLM's own id
    parked = RequestStatus.WAITING_FOR_REMOTE_KVS
    wait_for(lambda: engine.step() is not None and getattr(scheduler.requests.get(rid), "status", None) == parked,
             30, "the request parked for its load")
    engine.abort_request(["aborted"])
    assert rid in scheduler.requests  # its blocks wait for the load
    wait_for(lambda: engine.step() is not None and rid not in scheduler.requests,
             30, "vLLM freeing the aborted request once its load is over")

    [again] = generate(llm, [p])
    assert again.tokens == base.tokens
    wait_for(lambda: namespace_stats(daemon.target).leases == 0, 30, "every lease released")
