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
