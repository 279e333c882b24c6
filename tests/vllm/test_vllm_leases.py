"""Leases with real vLLM: whatever way a request leaves the scheduler (loaded from
radixkv, not loaded because vLLM holds the prefix itself, finished, aborted while its
lookup was in flight, preempted and resumed), the daemon holds no lease of it afterwards,
and a request preempted and rescheduled gets the same greedy tokens it gets alone.

A lease pins the matched path in the daemon: a leaked one keeps pages from eviction for
as long as the scheduler lives, which a user sees as a host pool that never frees.
"""

from radixkv import Client

from tests.support.daemon import wait_for
from radixkv.vllm.testing import reset_prefix_cache
from tests.vllm.engines import generate, prompt

BLOCK = 128
# 2 layers x 2 KV heads x 128 tokens x (K+V of 64 float32) = 256 KiB per block. 16 blocks:
# three requests of 4 prompt blocks decoding 5 blocks more each cannot all stay resident.
SMALL_CACHE = dict(kv_cache_memory_bytes=16 * 2 * 2 * BLOCK * 2 * 64 * 4, max_model_len=1536,
                   disable_log_stats=False)


def namespace_stats(target: str, namespace: str = "tiny"):
    with Client(target, reconnect=None) as c:
        [ns] = c.stats(namespace).namespaces
        return ns


def preemptions(llm) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def run(llm, requests: dict, max_tokens: int):
    """Step the engine until every request finished; their generated token ids."""
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for req_id, tokens in requests.items():
        llm.llm_engine.add_request(req_id, {"prompt_token_ids": tokens}, params)
    out = {}
    while llm.llm_engine.has_unfinished_requests():
        for o in llm.llm_engine.step():
            if o.finished:
                out[o.request_id] = tuple(o.outputs[0].token_ids)
    return out


def test_no_lease_outlives_its_request_on_any_exit_path(engines, daemon):
    seen, fresh = prompt(4 * BLOCK + 1, seed=60), prompt(4 * BLOCK + 1, seed=61)
    decode = 5 * BLOCK
    alone = engines.start(**SMALL_CACHE)  # no connector: each request alone, never preempted
    want = {name: run(alone, {name: p}, decode)[name] for name, p in (("seen", seen), ("fresh", fresh))}
    engines.stop(alone)

    llm = engines.start(daemon.target, **SMALL_CACHE)
    generate(llm, [seen])        # radixkv now holds seen's 4 blocks
    generate(llm, [seen])        # vLLM's own prefix cache holds them: nothing to load
    reset_prefix_cache(llm)
    # An abort while the lookup is on its way: the first step asks, the Match is in flight.
    from vllm import SamplingParams
    llm.llm_engine.add_request("aborted", {"prompt_token_ids": seen}, SamplingParams(max_tokens=4))
    llm.llm_engine.step()
    llm.llm_engine.abort_request(["aborted"])

    before = preemptions(llm)
    out = run(llm, {"seen": seen, "fresh": fresh, "again": seen}, decode)
    assert preemptions(llm) > before  # the small cache forced vLLM to preempt
    assert out == {"seen": want["seen"], "fresh": want["fresh"], "again": want["seen"]}

    # Releases travel on the scheduler's lookup thread, after the step that ended the use;
    # the last step's saves are acknowledged by the saves thread, just after they copied.
    wait_for(lambda: namespace_stats(daemon.target).leases == 0, 30, "every lease released")
    wait_for(lambda: namespace_stats(daemon.target).load_backs_unacked == 0, 30, "every transfer acknowledged")
    ns = namespace_stats(daemon.target)
    assert ns.counters["host_hit_tokens"] > 0  # some request did load from radixkv
