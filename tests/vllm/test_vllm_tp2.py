"""radixkv with real vLLM at tensor_parallel_size=2 (CPU build, mp executor: one worker
process per rank), a real daemon.

Each rank holds one of the tiny model's two KV heads and registers its shard of vLLM's
blocks on the one namespace; a prefix is a hit only when both ranks' shards are on host,
and a load is over when both ranks copied theirs. What a user notices: greedy output is the
same with radixkv cold and warm, and once vLLM's own prefix cache is emptied the known
prefix comes from radixkv's host tier, bit for bit what vLLM's own cache gave.

One TP=2 engine start only (about 26 s on an idle machine, over 90 s under load), so the
test empties vLLM's prefix cache instead of restarting vLLM.
"""

from radixkv import Client

from radixkv.vllm.testing import reset_prefix_cache
from tests.vllm.engines import generate, prompt, vllm_histogram, vllm_metric

PROMPT_TOKENS = 2048
BLOCK = 128
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # vLLM computes at least the last token
TP = 2
# One rank's shard of a block: 2 layers x 1 KV head x 128 tokens x (K+V of 64 float32).
# A KV cache of 24 blocks per rank: another 2k-token prompt must take most of the blocks
# that held the first one, so a hit on the first is only right if radixkv filled them.
SMALL_CACHE = dict(kv_cache_memory_bytes=24 * 2 * BLOCK * 2 * 64 * 4, max_model_len=PROMPT_TOKENS + 256)


def stats(target: str, namespace: str = "tiny"):
    """(the daemon's session count, the namespace's NamespaceStats)."""
    with Client(target, reconnect=None) as c:
        s = c.stats(namespace)
        [ns] = s.namespaces
        return s.sessions, ns


def test_tensor_parallel_2_hits_radixkv_with_both_ranks_shards(engines, daemon):
    p = prompt(PROMPT_TOKENS, seed=40)
    plain = engines.start()  # TP=1, no connector: the reference tokens
    [base] = generate(plain, [p])
    engines.stop(plain)

    llm = engines.start(daemon.target, tensor_parallel_size=TP, distributed_executor_backend="mp",
                        disable_log_stats=False, **SMALL_CACHE)
    sessions, ns = stats(daemon.target)
    assert sessions == 1 + TP  # the scheduler's session and one per rank
    assert ns.layout.num_kv_heads == 1  # a rank's shard: one of the model's two KV heads

    [cold] = generate(llm, [p])
    # TP=2 sums the heads' attention outputs in another order than TP=1: the logprobs
    # differ in the last digits, the greedy tokens do not.
    assert cold.tokens == base.tokens
    assert cold.cached_tokens == 0
    [local] = generate(llm, [p])  # vLLM's own prefix cache
    assert local.cached_tokens == CACHEABLE
    assert local.tokens == base.tokens

    reset_prefix_cache(llm)
    generate(llm, [prompt(PROMPT_TOKENS, seed=41)])  # overwrites the blocks that held `p`
    reset_prefix_cache(llm)
    before = dict(stats(daemon.target)[1].counters)
    # Each rank saved its shard of every full block of both prompts, once.
    assert before["inserted_tokens"] == TP * 2 * PROMPT_TOKENS
    [warm] = generate(llm, [p])
    assert warm.cached_tokens == CACHEABLE
    assert (warm.tokens, warm.logprobs) == (local.tokens, local.logprobs)
    after = dict(stats(daemon.target)[1].counters)
    # A hit needs both shards on host; each rank then loads its own.
    assert after["host_hit_tokens"] - before["host_hit_tokens"] == CACHEABLE
    assert after["loaded_tokens"] - before["loaded_tokens"] == TP * CACHEABLE
    assert after["failed_load_tokens"] == 0
    # vLLM's /metrics counts the load once, when both ranks reported theirs
    assert vllm_metric(llm, "vllm:radixkv_loads_total") == 1
    assert vllm_metric(llm, "vllm:radixkv_loaded_blocks_total") == CACHEABLE // BLOCK
    # ... and each rank's wait for its shard's load is an observation of its own
    waits, waited = vllm_histogram(llm, "vllm:radixkv_load_wait_seconds")
    assert waits == TP and waited > 0
