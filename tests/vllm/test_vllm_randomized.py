"""Real vLLM with radixkv under a randomized workload: what no scenario test lines up.

Prompts share a few prefixes; each round sends a random handful of them at once to an
engine whose KV cache holds about two (so vLLM preempts), aborts a random request now
and then, empties vLLM's own prefix cache at random (so hits come from radixkv), with a
daemon whose host pool holds a few prompts (so pages go to file storage and come back
by prefetch), killed and restarted once midway; and with vLLM's asynchronous scheduling
(on by default on GPUs, turned on here: `tests/vllm/async_scheduling.py`), where the
scheduler plans a step before the workers reported the one before. The invariant a user relies on: every
request that finishes gets exactly the tokens the same prompt gets alone without radixkv,
and vLLM never stops. Afterwards the daemon holds no lease and no unacknowledged load.

Each seed's workload is fixed. Found this way (docs/testing.md): a request aborted while
its asynchronous load ran stopped vLLM's scheduler on an assertion (freed twice).
"""

import random

import pytest

from radixkv import Client
from tests.support.daemon import wait_for
from tests.vllm.async_scheduling import asynchronous_scheduling
from tests.vllm.engines import connector_config, prompt

BLOCK = 128
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 4  # 2 layers x 2 KV heads x 128 tokens x (K+V of 64 float32)
ENGINE = dict(kv_cache_memory_bytes=24 * BLOCK_BYTES, max_model_len=2048, max_num_batched_tokens=512)
PROMPTS, ROUNDS, DECODE = 24, 40, 16


def run(llm, requests: dict, rng: random.Random, abort_p: float) -> dict:
    """Step until every request finished or was aborted: the finished ones' tokens. `rng`
    draws per step, and the number of steps depends on timing: give it one of its own."""
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True)
    for req_id, tokens in requests.items():
        llm.llm_engine.add_request(req_id, {"prompt_token_ids": tokens}, params)
    out, aborted = {}, set()
    while llm.llm_engine.has_unfinished_requests():
        for o in llm.llm_engine.step():
            if o.finished and o.request_id not in aborted:
                out[o.request_id] = tuple(o.outputs[0].token_ids)
        live = [r for r in requests if r not in out and r not in aborted]
        if live and rng.random() < abort_p:
            victim = rng.choice(live)
            aborted.add(victim)
            llm.llm_engine.abort_request([victim])
    return out


def namespace_stats(target: str):
    with Client(target, reconnect=None) as c:
        [ns] = c.stats("tiny").namespaces
        return ns


@pytest.mark.parametrize("async_loads", [False, True], ids=["loads", "async-loads"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-scheduling", "async-scheduling"])
def test_random_rounds_give_every_finished_request_its_own_tokens(engines, daemon_factory, tmp_path, monkeypatch,
                                                                  async_loads, async_scheduling):
    rng = random.Random(7 + async_loads + 2 * async_scheduling)  # the workload: prompts, picks, resets
    aborts = random.Random(17 + async_loads + 2 * async_scheduling)  # drawn per step, apart from the workload's
    prefixes = [prompt(n, seed=100 + i) for i, n in enumerate((256, 512, 768))]
    pool = [rng.choice(prefixes) + prompt(rng.randrange(1, 300), seed=200 + i) for i in range(PROMPTS)]

    alone = engines.start(**ENGINE)
    want = [run(alone, {"p": p}, aborts, 0.0)["p"] for p in pool]
    engines.stop(alone)

    daemon = daemon_factory("--host-pool-size", "3MiB", "--storage", f"file://{tmp_path}/pages")
    if async_scheduling:  # the references above were scheduled synchronously
        asynchronous_scheduling(monkeypatch)
    llm = engines.start(kv_transfer_config=connector_config(daemon.target, async_loads=async_loads), **ENGINE)
    core = llm.llm_engine.engine_core.engine_core  # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    assert (core.batch_queue is not None) == async_scheduling  # a step scheduled while one runs
    finished, before_kill = 0, {}
    for r in range(ROUNDS):
        picks = rng.sample(range(PROMPTS), rng.randrange(1, 5))
        out = run(llm, {f"r{r}-{j}-{i}": pool[i] for j, i in enumerate(picks)}, aborts, abort_p=0.03)
        for req_id, tokens in out.items():
            i = int(req_id.rsplit("-", 1)[1])
            assert tokens == want[i], f"round {r}: request {req_id} got other tokens than prompt {i} alone"
        finished += len(out)
        if rng.random() < 0.4:
            llm.reset_prefix_cache()  # refused while blocks wait for saves: then vLLM keeps them
        if r == ROUNDS // 2:
            before_kill = dict(namespace_stats(daemon.target).counters)
            daemon.kill()
            daemon.start()
    assert finished >= ROUNDS  # most requests ran to the end

    after = namespace_stats(daemon.target).counters
    for counter in ("loaded_tokens", "prefetched_tokens"):  # hits from both tiers happened
        assert before_kill[counter] + after[counter] > 0, counter
    engines.stop(llm)
    wait_for(lambda: (lambda s: (s.leases, s.load_backs_unacked) == (0, 0))(namespace_stats(daemon.target)),
             30, "no lease and no unacknowledged load left")
