"""How a request's end frees vLLM's blocks, with a real daemon and no vLLM engine: the
scheduler side's answer to `request_finished` (blocks kept while a save is in flight, the
last blocks saved after the request ended), the worker's `Saves` listing delayed requests
and waiting for a preempted request's saves, and what the worker logs while its daemon is
away or slow.
"""

import logging
import time
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from radixkv.vllm.lookups import Lookups
from radixkv.vllm.metadata import SaveSpec
from radixkv.vllm.saves import FINISHED_KEPT, Saves
from radixkv.vllm.scheduler import SchedulerSide
from tests.support.daemon import wait_for
from tests.vllm.log_lines import LogLines
from tests.vllm.test_vllm_adapter import SAVED, TOKENS, _step, open_sessions, sessions, shm_kv  # noqa: F401 (fixtures)


def packed(start: int, n: int) -> bytes:
    return torch.arange(start, start + n, dtype=torch.int32).numpy().tobytes()


def test_a_delayed_request_is_listed_only_once_its_saves_of_this_step_started_and_ended(sessions):
    """vLLM names a finished request in `delayed` in the same step whose metadata carries
    its last save; with speculative decoding it asks `get_finished` before it calls
    `wait_for_save`. The request is not listed while that save is not started, nor while
    it is in flight; then once."""
    views, adapter, scheduler = sessions
    saves = Saves(adapter)
    try:
        assert saves.finished({"r"}, ["r"], unstarted={"r"}) == set()  # its save not started yet
        saves.start(SaveSpec("r", packed(4000, 2 * TOKENS), (3, 4)))
        saves.step_began()
        wait_for(lambda: saves.finished(set(), []) == {"r"}, 10, "the request listed once its save is over")
        assert saves.finished(set(), []) == set()  # once
    finally:
        saves.close()


def test_a_delayed_request_waits_however_many_others_finish_meanwhile(sessions):
    """A request whose blocks wait for a load the daemon has not answered stays known
    while more than FINISHED_KEPT other requests finish, and is listed once answered
    (the finished ids kept are bounded, but not by dropping one that still waits)."""
    views, adapter, scheduler = sessions
    saves = Saves(adapter)
    try:
        answer = Future()
        saves.hold("r", answer)
        assert saves.finished({"r"}, ["r"]) == set()
        assert saves.finished({f"other-{i}" for i in range(FINISHED_KEPT + 10)}, []) == set()
        answer.set_result(SimpleNamespace(layer_events=()))
        assert saves.finished(set(), []) == {"r"}
    finally:
        saves.close()


def test_a_finished_request_saves_the_blocks_no_step_saved(sessions):
    """Under vLLM's asynchronous scheduling a request's last forward completes a block
    whose last token the scheduler learns only when the request finishes: that block is
    saved in the next step, with the request delayed in the same step."""
    _, _, scheduler = sessions
    manager = SimpleNamespace(get_block_ids=lambda req_id: [[5, 6, 7]])
    side = SchedulerSide(TOKENS, 1, None, lambda: manager)
    tokens = list(range(3, 3 + 3 * TOKENS + 1))
    request = SimpleNamespace(request_id="r", num_tokens=2 * TOKENS, all_token_ids=tokens[:2 * TOKENS],
                              num_prompt_tokens=2 * TOKENS, num_computed_tokens=0, cache_salt=None,
                              lora_request=None, mm_features=[], prompt_embeds=None, sampling_params=None,
                              pooling_params=None)
    assert side.matched(request, 0) == (0, False)  # no session: no lookup
    meta = side.build(_step(scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=0)],
                            num_scheduled_tokens={"r": 2 * TOKENS}))
    assert [(s.req_id, s.block_ids) for s in meta.saves] == [("r", (5, 6))]
    # The next step computed the block's last token's KV; the token reached the scheduler later.
    request.all_token_ids, request.num_tokens, request.num_computed_tokens = tokens, len(tokens), 3 * TOKENS
    assert side.finished(request) is True
    meta = side.build(_step())
    assert [(s.req_id, s.block_ids) for s in meta.saves] == [("r", (5, 6, 7))] and meta.delayed == ["r"]
    assert side.build(_step()).saves == []  # once


def test_saves_that_fail_while_the_daemon_is_away_log_one_warning_then_one_line_when_back(shm_kv, daemon):
    """A worker saves every step; while the daemon is away each save is skipped. The log
    says so once (a warning), not once per save, and says when saves go through again."""
    with LogLines() as lines, open_sessions(shm_kv, daemon, timeout_s=2.0) as (views, adapter, scheduler):
        daemon.kill()
        prompts = [packed(k, 2 * TOKENS) for k in range(5000, 5600, 100)]
        assert [adapter.save(p, [3, 4]) for p in prompts] == [0] * len(prompts)
        daemon.start()
        starts = iter(range(7000, 100_000, 100))

        def saved() -> bool:
            transfer = adapter.save(packed(next(starts), 2 * TOKENS), [3, 4])
            return bool(transfer) and adapter.done([transfer], timeout=None) == {transfer}

        wait_for(saved, 20, "saves going through once the daemon is back")
    warnings = [m for m in lines.messages() if "saves are skipped" in m]
    again = [m for m in lines.messages(logging.INFO) if "saves go through again" in m]
    skipped = sum("saves are skipped" in m for _, m in lines.records)
    assert len(warnings) == 1, lines.records
    assert skipped >= len(prompts) and again == [f"radixkv: saves go through again ({skipped} failed before)"], \
        lines.records


def test_a_preemption_waits_for_its_saves_and_says_so_while_the_daemon_is_slow(shm_kv, daemon_factory):
    """vLLM reuses a preempted request's blocks right after `flush`, so the flush waits for
    every save of the request, however long the daemon takes (it may still read the
    blocks): no giving up at timeout_s, but a warning each timeout_s, so an operator
    whose vLLM stalls on a stuck daemon sees why."""
    daemon = daemon_factory("--fault-copy-delay", "1.0")  # every copy starts 1 s late
    prompt = packed(9000, 2 * TOKENS)
    with open_sessions(shm_kv, daemon, timeout_s=0.3) as (views, adapter, scheduler):
        saves = Saves(adapter)
        try:
            with LogLines() as lines:
                saves.start(SaveSpec("r", prompt, (3, 4)))
                saves.flush(["r"])
            [hit] = scheduler.lookup([prompt])  # the copy the flush waited for is in
            scheduler.release([hit.lease])
            assert hit.tokens == 2 * TOKENS
            assert saves.finished({"r"}, ["r"]) == {"r"}
        finally:
            saves.close()
    waits = [m for m in lines.messages() if "waits to reuse the blocks of preempted requests" in m]
    assert waits and "1 of their saves are unacknowledged after 0.3s" in waits[0], lines.records


def ask(side: SchedulerSide, request) -> tuple[int, bool]:
    """get_num_new_matched_tokens until the lookup landed (a scheduler step in between)."""
    deadline = time.monotonic() + 10
    while (got := side.matched(request, request.num_computed_tokens))[0] is None:
        assert time.monotonic() < deadline, "the lookup never landed"
        side.build(_step())
    return got


def test_a_request_aborted_during_its_asynchronous_load_after_a_preemption_is_left_to_vllm(sessions):
    """Preempted while a save of it was not reported over (the next step flushes it), then
    resumed with an asynchronous load and aborted before the workers' reports came: vLLM
    keeps the blocks itself until the receive is over, and the save was flushed before the
    load began. Answering `request_finished` True as well makes vLLM free the blocks twice
    (its scheduler asserts)."""
    _, _, scheduler = sessions
    lookups = Lookups.open(scheduler.config, scheduler.layout, engine="test lookups", tp_size=1, instance="")
    side = SchedulerSide(TOKENS, 1, lookups, lambda: SimpleNamespace(get_block_ids=lambda req_id: [[5, 6, 7]]),
                         async_loads=True)
    try:
        tokens = list(range(3, 3 + 2 * TOKENS + 1))  # SAVED and one token more
        request = SimpleNamespace(request_id="r", num_tokens=len(tokens), all_token_ids=tokens,
                                  num_prompt_tokens=len(tokens), num_computed_tokens=0)
        assert ask(side, request) == (2 * TOKENS, True)
        side.allocated(request, SimpleNamespace(get_block_ids=lambda: [[5, 6, 7]]), 0)  # vLLM computes it all
        meta = side.build(_step(scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=0)],
                                num_scheduled_tokens={"r": len(tokens)}))
        assert [s.req_id for s in meta.saves] == ["r"]
        assert side.build(_step(preempted_req_ids=["r"])).flush == ["r"]
        assert ask(side, request) == (2 * TOKENS, True)
        side.allocated(request, SimpleNamespace(get_block_ids=lambda: [[8, 9, 10]]), 2 * TOKENS)
        assert side.finished(request) is False  # aborted while it waits for the load
        assert side.build(_step()).delayed == [] and side.build(_step()).saves == []
    finally:
        side.close()
