"""Saves over a load wait for every rank's report of it (the scheduler side, a real daemon,
no vLLM engine). With tensor parallelism a rank whose load failed spoils the KV every rank
computes over the unfilled block (the layers mix the ranks' heads), and a rank learns only
of its own loads: rank 0 saved its shard of what the step computed, the daemon then served
it (and skipped rank 0's right shard as already there). vLLM also caches a loading
request's blocks at once, so another request of the step computes over them as its own
prefix hit. Found by a review (2026-12-05)."""

from types import SimpleNamespace

from radixkv.vllm.lookups import Lookups
from radixkv.vllm.metadata import RadixKVWorkerMetadata
from radixkv.vllm.scheduler import SchedulerSide
from tests.vllm.test_vllm_adapter import TOKENS, _step, sessions, shm_kv  # noqa: F401 (fixtures)
from tests.vllm.test_vllm_request_ends import ask

BLOCKS = {"r": [5, 6, 7, 8], "s": [5, 6, 9, 10]}  # s holds r's loaded blocks 5, 6 as its prefix hit


def request(req_id: str, first: int, computed: int) -> SimpleNamespace:
    """SAVED's two pages (what radixkv holds), two more of its own, one token more."""
    tokens = list(range(3, 3 + 2 * TOKENS)) + list(range(first, first + 2 * TOKENS + 1))
    return SimpleNamespace(request_id=req_id, num_tokens=len(tokens), all_token_ids=tokens,
                           num_prompt_tokens=len(tokens), num_computed_tokens=computed, cache_salt=None,
                           lora_request=None, mm_features=[], prompt_embeds=None, sampling_params=None,
                           pooling_params=None)


def loading_step(scheduler) -> tuple[SchedulerSide, dict]:
    """A tp_size 2 scheduler side: r loads SAVED's two pages into blocks 5, 6 and s, in the
    same step, holds them as its prefix hit; the step's metadata is built."""
    lookups = Lookups.open(scheduler.config, scheduler.layout, engine="test lookups", tp_size=1, instance="")
    side = SchedulerSide(TOKENS, 2, lookups, lambda: SimpleNamespace(get_block_ids=lambda req_id: [BLOCKS[req_id]]))
    r, s = request("r", 100_000, 0), request("s", 200_000, 2 * TOKENS)
    assert ask(side, r) == (2 * TOKENS, False) and ask(side, s) == (0, False)
    side.allocated(r, SimpleNamespace(get_block_ids=lambda: [BLOCKS["r"]]), 2 * TOKENS)
    side.allocated(s, SimpleNamespace(get_block_ids=lambda: [BLOCKS["s"]]), 0)
    step = side.build(_step(scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=2 * TOKENS),
                                                SimpleNamespace(req_id="s", num_computed_tokens=2 * TOKENS)],
                            num_scheduled_tokens={"r": 2 * TOKENS + 1, "s": 2 * TOKENS + 1}))
    assert [spec.block_ids for spec in step.loads] == [(5, 6)]
    return side, {"r": r, "s": s, "step": step}


def next_step(side: SchedulerSide):
    cached = SimpleNamespace(req_ids=["r", "s"], num_computed_tokens=[4 * TOKENS + 1] * 2)
    return side.build(_step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 1, "s": 1}))


def test_a_load_one_rank_failed_saves_nothing_computed_over_it_on_any_rank(sessions):
    _, _, scheduler = sessions
    side, got = loading_step(scheduler)
    try:
        assert got["step"].saves == [], "no save before every rank reported the load"
        side.answered(RadixKVWorkerMetadata(loaded={"r": {0: 2, 1: 0}}))  # rank 1's load failed
        assert next_step(side).saves == []
    finally:
        side.close()


def test_a_load_every_rank_reported_saves_what_was_computed_over_it(sessions):
    _, _, scheduler = sessions
    side, got = loading_step(scheduler)
    try:
        assert got["step"].saves == []
        side.answered(RadixKVWorkerMetadata(loaded={"r": {0: 2, 1: 2}}))
        assert sorted(spec.block_ids for spec in next_step(side).saves) == [(5, 6, 7, 8), (5, 6, 9, 10)]
    finally:
        side.close()


def test_a_request_ending_in_its_load_step_saves_its_blocks_once_every_rank_reported(sessions):
    """vLLM ends a request (max_tokens 1) before it hands over that step's reports: its
    last save and its being delayed wait for them, and go out together."""
    _, _, scheduler = sessions
    for loaded, saves in (({0: 2, 1: 2}, [(5, 6, 7, 8)]), ({0: 2, 1: 0}, [])):
        side, got = loading_step(scheduler)
        try:
            r = got["r"]
            r.num_computed_tokens = 4 * TOKENS + 1
            assert side.finished(r) is True
            assert side.build(_step()).delayed == [], "not before its save can go with it"
            side.answered(RadixKVWorkerMetadata(loaded={"r": loaded}))
            meta = side.build(_step())
            assert [spec.block_ids for spec in meta.saves] == saves and meta.delayed == ["r"]
        finally:
            side.close()
