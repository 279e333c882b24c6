"""The connector under vLLM's asynchronous scheduling (on by default on GPUs; turned on
for vLLM's CPU build by `tests/vllm/async_scheduling.py`). vLLM then schedules a step
before the previous step's sampled tokens reach the scheduler, so the scheduler learns a
request's last tokens only after the step that computed their KV was planned. (The
randomized workload runs under it too: `test_vllm_randomized.py`.)"""

import pytest

from radixkv.vllm.testing import reset_prefix_cache
from tests.vllm.async_scheduling import asynchronous_scheduling
from tests.vllm.engines import generate, prompt

BLOCK = 32


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-scheduling", "async-scheduling"])
def test_the_block_the_last_forward_fills_is_saved_for_the_next_turn(engines, daemon, monkeypatch, async_scheduling):
    """A chat's next turn starts with the last turn's prompt and answer. vLLM computed KV
    for every position but the answer's last token; each full block of it is radixkv's,
    including the block that the request's last forward completed. Under asynchronous
    scheduling that block's last token reached the scheduler only after its last step was
    planned: it was never saved, so the next turn recomputed it (seen: 96 of 128 tokens
    cached instead of 128 for this chat; with synchronous scheduling 128)."""
    if async_scheduling:
        asynchronous_scheduling(monkeypatch)
    llm = engines.start(daemon.target, block_size=BLOCK)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == async_scheduling
    first = prompt(100, seed=1)
    answers = []
    for seed, n in ((2, 29), (3, 61)):  # 100 + 29 - 1 = 128 and 100 + 61 - 1 = 160 computed: whole blocks
        [answer] = generate(llm, [first], max_tokens=n)
        computed = len(first) + n - 1
        assert computed % BLOCK == 0
        reset_prefix_cache(llm)  # the next turn's hit must come from radixkv
        [turn] = generate(llm, [first + list(answer.tokens) + prompt(10, seed=seed)])
        answers.append((turn.cached_tokens, computed))
        first = prompt(100, seed=10 + seed)
    assert all(cached == computed for cached, computed in answers), answers


def test_vllm_in_its_own_processes_with_two_ranks_under_asynchronous_scheduling(engines, daemon, monkeypatch):
    """As vLLM runs on a GPU node: the engine core in a process of its own, one worker
    process per tensor-parallel rank, asynchronous scheduling (set in the configuration
    made here; vLLM's CPU tensor-parallel workers stand in for CUDA events themselves).
    Rounds of requests sharing prefixes, vLLM's prefix cache emptied after each, so later
    rounds load from radixkv: every request gets the tokens it gets alone without radixkv."""
    prefixes = [prompt(n, seed=60 + i) for i, n in enumerate((256, 512))]
    rounds = [[prefixes[(r + j) % 2] + prompt(40 + 30 * j, seed=70 + 3 * r + j) for j in range(3)] for r in range(3)]
    plain = engines.start()
    want = [[r.tokens for r in generate(plain, batch)] for batch in rounds]
    engines.stop(plain)

    asynchronous_scheduling(monkeypatch)  # the engine's config is made in this process
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function, below
    llm = engines.start(daemon.target, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert llm.collective_rpc(_schedules_asynchronously) == [True, True]  # each rank's model runner
    cached = []
    for batch, tokens in zip(rounds, want):
        got = generate(llm, batch)
        assert [r.tokens for r in got] == tokens
        cached.append(sum(r.cached_tokens for r in got))
        reset_prefix_cache(llm)
    assert all(cached[1:]), cached  # hits, from radixkv's host tier


def _schedules_asynchronously(worker) -> bool:
    return worker.model_runner.use_async_scheduling

