"""The connector's parts that need no vLLM engine: vLLM's KV allocation placed in shared
memory, its description for Register, the settings, and the daemon adapter moving real
pages between blocks through a real daemon (save, lookup, load, a local prefix left alone).
"""

import contextlib
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from radixkv import Client
from radixkv.vllm.config import ConnectorConfig
from radixkv.vllm.daemon import DaemonAdapter
from radixkv.vllm.kvmemory import PREFIX, ShmAllocation, ShmSegment, describe, layout_from_spec, remove_orphans
from radixkv.vllm.lookups import Lookups
from radixkv.vllm.metadata import RadixKVWorkerMetadata
from radixkv.vllm.saves import Saves
from radixkv.vllm.scheduler import SchedulerSide
from tests.support.daemon import wait_for
from tests.vllm.scheduler_session import SchedulerSession

BLOCKS, LAYERS, HEADS, TOKENS, CONTENT = 16, 2, 2, 32, 16  # CONTENT: float32 per token and head
SAVED = torch.arange(3, 3 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()  # a 2-page prompt


def vllm_like_views(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] float32 views of a flat int8 buffer, layer-outermost (LBHNC),
    as vLLM's allocate_kv_cache makes them on CPU."""
    per_layer = BLOCKS * HEADS * TOKENS * CONTENT * 4
    return {f"model.layers.{i}.self_attn.attn":
            raw[i * per_layer:(i + 1) * per_layer].view(torch.float32).view(BLOCKS, HEADS, TOKENS, CONTENT)
            for i in range(LAYERS)}


@pytest.fixture
def shm_kv():
    """(views, allocation): vLLM-like KV views inside a shared-memory allocation."""
    alloc = ShmAllocation()
    with alloc:
        raw = torch.zeros(LAYERS * BLOCKS * HEADS * TOKENS * CONTENT * 4, dtype=torch.int8)
        other = torch.zeros(8, dtype=torch.int8)  # only the first int8 allocation moves
    assert other.data_ptr() != raw.data_ptr()
    yield vllm_like_views(raw), alloc
    alloc.segment.unlink()


def test_the_kv_allocation_lands_in_a_segment_another_process_can_map(shm_kv):
    views, alloc = shm_kv
    seg = alloc.segment
    views["model.layers.1.self_attn.attn"][3].fill_(1.5)
    mapped = torch.from_file(seg.path, shared=True, size=seg.size, dtype=torch.int8)
    layer1 = vllm_like_views(mapped)["model.layers.1.self_attn.attn"]
    assert torch.equal(layer1[3], torch.full_like(layer1[3], 1.5))
    seg.unlink()
    assert not os.path.exists(seg.path)


def test_describe_gives_one_buffer_per_layer_and_a_block_as_a_page(shm_kv):
    views, alloc = shm_kv
    memory = describe(views, alloc.segment.tensor, b"seg", TOKENS)
    page = HEADS * TOKENS * CONTENT * 4
    assert memory.num_blocks == BLOCKS and memory.page_bytes == page == memory.block_stride
    assert [offset for _, offset, _ in memory.buffers] == [0, BLOCKS * page]
    assert memory.layout.chunk_bytes == page and memory.layout.num_buffers == LAYERS


def test_describe_refuses_what_it_cannot_copy(shm_kv):
    views, alloc = shm_kv
    elsewhere = {"x": torch.zeros(BLOCKS, HEADS, TOKENS, CONTENT)}
    with pytest.raises(ValueError, match="not in the shared-memory allocation"):
        describe(elsewhere, alloc.segment.tensor, b"seg", TOKENS)
    with pytest.raises(ValueError, match="tokens per block"):
        describe(views, alloc.segment.tensor, b"seg", 2 * TOKENS)


def test_settings_refuse_unknown_keys_and_wrong_types():
    assert ConnectorConfig.from_extra({}, "m").namespace == "vllm/m"
    with pytest.raises(ValueError, match="unknown.*'tagret'"):
        ConnectorConfig.from_extra({"tagret": "x"}, "m")
    with pytest.raises(ValueError, match="timeout_s.*float"):
        ConnectorConfig.from_extra({"timeout_s": "5"}, "m")



def test_the_scheduler_derives_the_layout_the_workers_register(shm_kv):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    views, alloc = shm_kv
    spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=CONTENT // 2, dtype=torch.float32)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=list(views), kv_cache_spec=spec)])
    assert layout_from_spec(config) == describe(views, alloc.segment.tensor, b"seg", TOKENS).layout


@pytest.fixture
def sessions(shm_kv, daemon):
    with open_sessions(shm_kv, daemon) as opened:
        yield opened


@contextlib.contextmanager
def open_sessions(shm_kv, daemon, timeout_s: float = 5.0):
    """(views, worker adapter, scheduler adapter) on namespace "unit" of a real daemon, with
    blocks 1 and 2 holding 10 + layer and 20 + layer, saved as the prompt `SAVED`."""
    views, alloc = shm_kv
    memory = describe(views, alloc.segment.tensor, alloc.segment.name.encode(), TOKENS)
    config = ConnectorConfig(target=daemon.target, namespace="unit", timeout_s=timeout_s)
    adapter = DaemonAdapter(config, engine="test")
    adapter.attach(memory.layout, memory.buffers, memory.num_blocks)
    scheduler = SchedulerSession(config, memory.layout)
    try:
        for layer, v in enumerate(views.values()):
            v[1].fill_(10 + layer)
            v[2].fill_(20 + layer)
        transfer = adapter.save(SAVED, [1, 2])
        assert transfer and adapter.done([transfer], timeout=None) == {transfer}
        yield views, adapter, scheduler
    finally:
        scheduler.close()
        adapter.close()


def test_pages_saved_from_blocks_load_into_other_blocks_and_spare_the_local_prefix(sessions, daemon):
    """A worker session saves (asynchronously) and loads; the scheduler's session, with
    no buffers, looks up and holds the lease the load names."""
    views, adapter, scheduler = sessions
    assert adapter.save(SAVED, [1, 2]) == 0  # the daemon holds them: nothing to copy
    [hit] = scheduler.lookup([SAVED])
    assert hit.tokens == 2 * TOKENS and hit.lease
    for v in views.values():
        v[3].fill_(-1)  # vLLM's own copy of page 0 (a local prefix-cache hit)
    assert adapter.load(hit.node, [3, 7], 1, hit.lease) == 1
    scheduler.release([hit.lease])
    for layer, v in enumerate(views.values()):
        assert torch.equal(v[7], torch.full_like(v[7], 20 + layer))
        assert torch.equal(v[3], torch.full_like(v[3], -1))  # never written
    with Client(daemon.target) as c:
        [ns] = c.stats("unit").namespaces
        assert ns.device_pages_held == 0  # the daemon kept none of vLLM's blocks
        assert c.check_invariants("unit") == []


def test_a_load_begun_before_the_forward_is_in_the_blocks_once_finished(sessions, daemon):
    """The connector begins a step's loads as the step starts (on the session stream, not
    waiting) and finishes them before the forward: the blocks then hold the saved bytes.
    A load begun on a daemon that dies before the answer fills nothing (vLLM recomputes)."""
    views, adapter, scheduler = sessions
    [hit] = scheduler.lookup([SAVED])
    pending = adapter.begin_load(hit.node, [8, 9], 0, hit.lease)
    assert pending.answer is not None, "the load did not go out on the session stream"
    assert adapter.finish_load(pending) == 2
    for layer, v in enumerate(views.values()):
        assert torch.equal(v[8], torch.full_like(v[8], 10 + layer))
        assert torch.equal(v[9], torch.full_like(v[9], 20 + layer))
    assert adapter.finish_load(adapter.begin_load(hit.node, [3], 1, hit.lease)) == 0  # nothing past the local prefix
    scheduler.release([hit.lease])
    [hit] = scheduler.lookup([SAVED])
    daemon.kill()
    assert adapter.finish_load(adapter.begin_load(hit.node, [10, 11], 0, hit.lease)) == 0


def test_a_load_answered_too_late_holds_its_blocks_until_the_daemon_answers(shm_kv, daemon_factory):
    """A load whose answer misses timeout_s fills no block (vLLM recomputes them), but the
    daemon may still write them: the request's blocks stay held (`get_finished` does not
    list it, a preemption's flush waits for the answer) until the daemon answered."""
    daemon = daemon_factory("--fault-copy-delay", "3.0")  # every copy starts 3 s late
    with open_sessions(shm_kv, daemon, timeout_s=0.2) as (views, adapter, scheduler):
        [hit] = scheduler.lookup([SAVED])
        for v in views.values():
            v[8].fill_(-1)
        pending = adapter.begin_load(hit.node, [8, 9], 0, hit.lease)
        assert adapter.finish_load(pending) == 0 and pending.late
        assert_held_until_answered(adapter, views, lambda saves: saves.hold("r", pending.answer),
                                   answered=pending.answer.done)
        scheduler.release([hit.lease])


def assert_held_until_answered(adapter, views, hold, answered=None) -> None:
    """`hold(saves)` holds request "r"'s blocks (8 and 9) for a load the daemon still
    writes (block 8 filled with -1 before): vLLM keeps them, a preemption's flush waits
    for the daemon's answer, and block 8 then holds the saved bytes."""
    saves = Saves(adapter)
    try:
        hold(saves)
        assert saves.finished({"r"}, ["r"]) == set()  # vLLM keeps the blocks
        assert saves.report() == ({}, {"r": 1})
        assert answered is None or not answered()
        saves.flush(["r"])  # the request preempted: its blocks are reused after this
        assert answered is None or answered()
        for layer, v in enumerate(views.values()):  # the write the hold kept vLLM from
            assert torch.equal(v[8], torch.full_like(v[8], 10 + layer))
        assert saves.finished(set(), []) == {"r"}
        assert saves.report() == ({"r": 1}, {})
    finally:
        saves.close()


def test_a_load_the_stream_cannot_carry_is_not_sent_and_the_session_comes_back(shm_kv, daemon):
    """A worker whose session is lost (here its daemon restarted, then frozen) sends no
    load: there would be no answer to hold its blocks by. The load fills none (vLLM
    recomputes them) at once, however long the daemon takes to answer, and finishing it
    starts registering the session again, so a later load goes on the new session's
    stream and fills its blocks."""
    with open_sessions(shm_kv, daemon, timeout_s=30.0) as (views, adapter, scheduler):
        [hit] = scheduler.lookup([SAVED])
        daemon.kill()
        daemon.start()  # empty, on the same socket
        os.kill(daemon.pid, signal.SIGSTOP)  # and not answering: a registration waits timeout_s
        try:
            def unsent_load() -> bool:  # once the worker's client saw its stream end
                pending = adapter.begin_load(hit.node, [8, 9], 0, hit.lease)
                started = time.monotonic()
                assert adapter.finish_load(pending) == 0
                if pending.answer is None:
                    assert time.monotonic() - started < 10, "the step waited for the registration"
                return pending.answer is None

            wait_for(unsent_load, 20, "a load the lost session did not send")
            assert adapter.save(SAVED, [1, 2]) == 0  # skipped, not queued behind the registration
        finally:
            os.kill(daemon.pid, signal.SIGCONT)

        def sent_load():
            pending = adapter.begin_load(hit.node, [8, 9], 0, hit.lease)
            if pending.answer is None:
                adapter.finish_load(pending)  # fills none; registers again unless under way
                return None
            return pending

        pending = wait_for(sent_load, 40, "the session back")
        assert adapter.finish_load(pending) == 0  # a node of the old daemon: refused
        # A load goes on the new stream as soon as it is up; saves are skipped until the
        # registering thread has returned, a moment later.
        transfer = wait_for(lambda: adapter.save(SAVED, [1, 2]), 10, "saves going through again")
        assert adapter.done([transfer], timeout=None) == {transfer}
        hits = []
        wait_for(lambda: hits.extend(h for h in scheduler.lookup([SAVED]) if h.tokens) or hits, 10,
                 "the scheduler's session back too")
        assert adapter.load(hits[0].node, [8, 9], 0, hits[0].lease) == 2
        for layer, v in enumerate(views.values()):
            assert torch.equal(v[9], torch.full_like(v[9], 20 + layer))
        scheduler.release([hits[0].lease])


def test_lookups_answer_over_steps_and_release_without_another_step(sessions, daemon):
    """The scheduler's lookups: the first ask answers None, the step's end sends the
    Match, a later step's ask gets the leased hit. A dropped hit's lease, and the lease of
    a hit dropped while its Match was in flight, reach the daemon though no step follows
    (an engine whose last request just finished)."""
    _, _, scheduler = sessions
    lookups = Lookups.open(scheduler.config, scheduler.layout, engine="test lookups", tp_size=1, instance="")
    try:
        assert lookups.poll("r", lambda: SAVED) is None
        deadline = time.monotonic() + 10
        while (hit := lookups.poll("r", lambda: SAVED)) is None:  # one scheduler step each
            assert time.monotonic() < deadline, "the lookup never landed"
            lookups.send()
        assert hit.tokens == 2 * TOKENS and hit.lease
        assert leases(daemon) == 1
        lookups.drop("r")
        wait_for(lambda: leases(daemon) == 0, 10, "the dropped hit's lease released")
        assert lookups.poll("gone", lambda: SAVED) is None
        lookups.send()
        lookups.drop("gone")  # its Match is on its way
        with Client(daemon.target) as c:
            wait_for(lambda: c.stats("unit").namespaces[0].counters["match_requests"] >= 2, 10, "the second Match served")
        wait_for(lambda: leases(daemon) == 0, 10, "the in-flight hit's lease released when it landed")
    finally:
        lookups.close()


def leases(daemon) -> int:
    with Client(daemon.target) as c:
        [ns] = c.stats("unit").namespaces
        return ns.leases


def _step(**changes) -> SimpleNamespace:
    """A scheduler output that schedules nothing, with `changes`."""
    step = dict(total_num_scheduled_tokens=0, preempted_req_ids=(), scheduled_new_reqs=[],
                scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                num_scheduled_tokens={}, new_block_ids_to_zero=None, kv_cache_block_copies=None)
    return SimpleNamespace(**{**step, **changes})


def test_the_scheduler_keeps_a_held_loads_blocks_until_its_rank_says_it_is_over():
    """With 2 ranks: a request whose load rank 1 holds answers `request_finished` True and
    is delayed; preempted, it is flushed; once rank 1 reports the hold over, neither."""
    side = SchedulerSide(TOKENS, 2, None, lambda: None)
    for req_id in ("held", "over", "preempted"):
        side.matched(SimpleNamespace(request_id=req_id, num_tokens=4 * TOKENS), 0)
        side.answered(RadixKVWorkerMetadata(held={req_id: {1: 1}}))
    side.answered(RadixKVWorkerMetadata(saved={"over": {1: 1}}))
    assert side.finished(SimpleNamespace(request_id="held", num_computed_tokens=0)) is True
    assert side.finished(SimpleNamespace(request_id="over", num_computed_tokens=0)) is False
    meta = side.build(_step(preempted_req_ids=["preempted"]))
    assert (meta.delayed, meta.flush) == (["held"], ["preempted"])


def test_a_request_finished_before_its_load_is_reported_keeps_its_blocks(sessions):
    """vLLM frees a request that finishes in a step before it passes on that step's worker
    reports: a load not yet reported by every rank (one of them may hold it) keeps the
    blocks until the workers list the request. The lookup is real (the scheduler's session)."""
    _, _, scheduler = sessions
    side = SchedulerSide(TOKENS, 2, Lookups.open(scheduler.config, scheduler.layout, engine="test lookups",
                                                 tp_size=1, instance=""), lambda: None)
    try:
        tokens = list(range(3, 3 + 2 * TOKENS + 1))  # SAVED and one token more
        request = SimpleNamespace(request_id="r", num_tokens=len(tokens), all_token_ids=tokens,
                                  num_prompt_tokens=len(tokens), num_computed_tokens=0)
        deadline = time.monotonic() + 10
        while (got := side.matched(request, 0))[0] is None:  # asks until the Match landed
            assert time.monotonic() < deadline, "the lookup never landed"
            side.build(_step())
        assert got == (2 * TOKENS, False)
        side.allocated(request, SimpleNamespace(get_block_ids=lambda: [[5, 6]]), 2 * TOKENS)
        side.answered(RadixKVWorkerMetadata(loaded={"r": {0: 2}}))  # rank 1 has not reported
        assert side.finished(request) is True
        assert side.build(_step()).delayed == ["r"]
    finally:
        side.close()


def test_loads_start_early_only_in_steps_that_neither_zero_nor_copy_blocks():
    """vLLM zeroes new blocks (and copies blocks) early in a worker's step for hybrid
    models: a load begun before that would be overwritten, so such a step's loads wait
    for `start_load_kv`."""
    side = SchedulerSide(TOKENS, 1, None, lambda: None)
    assert side.build(_step()).early_loads
    assert not side.build(_step(new_block_ids_to_zero=[4, 5])).early_loads
    assert not side.build(_step(kv_cache_block_copies=[object()])).early_loads


def test_segments_of_dead_engines_are_removed_and_live_ones_kept():
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    orphan = ShmSegment(4096, name=f"{PREFIX}{dead}_test")
    mine = ShmSegment(4096)
    try:
        assert orphan.name in remove_orphans()
        assert not os.path.exists(orphan.path) and os.path.exists(mine.path)
    finally:
        orphan.unlink()
        mine.unlink()


def test_a_segment_comes_with_its_page_tables_made():
    """vLLM's KV memory is populated when it is made, as vLLM's own `torch.zeros` would
    make it: reading and writing blocks the daemon filled later takes no page fault in
    the forward (a 2k-token load of fresh blocks took ~180 of them)."""
    import resource
    segment = ShmSegment(8 << 20)
    try:
        pages = segment.tensor[::4096]
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        assert int(pages.sum()) == 0  # zero-filled
        pages.fill_(1)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert faults < 32, f"{faults} page faults touching {pages.numel()} pages of a new segment"
    finally:
        segment.unlink()


def test_a_save_goes_out_when_the_next_step_begins_or_soon_after_without_one(sessions):
    """The step that queued a save is about to sample and hand its tokens over: the
    Insert waits for the next step to begin (`step_began`), and goes out by itself a
    moment later when no step comes (vLLM stopped stepping)."""
    from radixkv.vllm.metadata import SaveSpec
    views, adapter, scheduler = sessions
    first = torch.arange(1000, 1000 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()
    second = torch.arange(2000, 2000 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()

    def saved(prompt: bytes) -> bool:
        [hit] = scheduler.lookup([prompt])
        scheduler.release([hit.lease])
        return hit.tokens == 2 * TOKENS

    saves = Saves(adapter)
    try:
        saves.defer_s = 60.0
        saves.start(SaveSpec("a", first, (3, 4)))
        window = time.monotonic() + 0.3
        while time.monotonic() < window:  # held while the step hands its output over
            assert not saved(first), "the save went out before the next step began"
        saves.step_began()
        wait_for(lambda: saved(first), 10, "the save sent once the next step began")
        saves.defer_s = 0.05
        saves.start(SaveSpec("b", second, (5, 6)))
        wait_for(lambda: saved(second), 10, "the save sent with no step to come")
    finally:
        saves.close()
