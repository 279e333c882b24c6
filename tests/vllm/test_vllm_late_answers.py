"""Answers that come too late, at the daemon adapter and the worker's saves: a daemon
frozen (SIGSTOP) past `timeout_s` may still take a save or carry out a load when it runs
again, so the blocks it names stay held until it answered, whatever else gives up."""

import contextlib
import os
import signal

import pytest
import torch

from radixkv.vllm.saves import Saves
from tests.support.daemon import wait_for
from tests.vllm.test_vllm_adapter import SAVED, TOKENS, open_sessions, shm_kv  # noqa: F401 (a fixture)


@contextlib.contextmanager
def a_late_save(daemon, views, adapter, prompt: bytes, caplog):
    """Blocks 3 and 4 filled with 30 + layer and 40 + layer and saved as `prompt` (request
    "r") against a frozen daemon, until the worker stopped waiting for the answer: yields
    the worker's Saves; the daemon runs again on leaving."""
    from radixkv.vllm.metadata import SaveSpec
    for layer, v in enumerate(views.values()):
        v[3].fill_(30 + layer)
        v[4].fill_(40 + layer)
    saves = Saves(adapter)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        saves.start(SaveSpec("r", prompt, (3, 4)))
        saves.step_began()
        wait_for(lambda: "saves are skipped while they fail" in caplog.text, 10, "the save's answer to be late")
        yield saves
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


def assert_saved_as_filled(adapter, scheduler, views, prompt: bytes) -> None:
    """The daemon holds `prompt` with what `a_late_save` put in blocks 3 and 4."""
    [hit] = scheduler.lookup([prompt])
    assert hit.tokens == 2 * TOKENS, "the late save was taken and copied"
    assert adapter.load(hit.node, [8, 9], 0, hit.lease) == 2
    scheduler.release([hit.lease])
    for layer, v in enumerate(views.values()):
        assert torch.equal(v[8], torch.full_like(v[8], 30 + layer))
        assert torch.equal(v[9], torch.full_like(v[9], 40 + layer))


def test_a_save_the_daemon_answers_too_late_keeps_its_blocks_until_it_is_over(shm_kv, daemon, caplog):
    """A save whose Insert gets no answer within timeout_s (the daemon frozen) may still
    be taken once the daemon runs again, and then it reads the blocks: the request's
    blocks stay held (not listed finished) until the daemon answered and the copy was
    acknowledged, and what is saved is what the blocks held."""
    prompt = torch.arange(4000, 4000 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()
    with open_sessions(shm_kv, daemon, timeout_s=0.3) as (views, adapter, scheduler):
        with a_late_save(daemon, views, adapter, prompt, caplog) as saves:
            assert saves.finished({"r"}, ["r"]) == set(), "vLLM would reuse blocks the daemon may still read"
        wait_for(lambda: saves.finished(set(), []) == {"r"}, 10, "the late save over")
        saves.close()
        assert_saved_as_filled(adapter, scheduler, views, prompt)


def test_a_call_that_ends_the_session_leaves_the_loads_in_flight_to_the_daemon(shm_kv, daemon):
    """A page-moving call of the worker's client that gets no answer ends the session;
    a load in flight on the same stream meanwhile is not failed locally (the frozen
    daemon, resumed, still writes its blocks): it stays held as late until the daemon
    answers it."""
    from radixkv import errors
    other = torch.arange(9000, 9000 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()
    with open_sessions(shm_kv, daemon, timeout_s=1.0) as (views, adapter, scheduler):
        [hit] = scheduler.lookup([SAVED])
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            pending = adapter.begin_load(hit.node, [8, 9], 0, hit.lease)
            with pytest.raises(errors.DeadlineExceeded):
                adapter._client.insert(other, [5, 6], async_=True)
            assert adapter.finish_load(pending) == 0 and pending.late, "the load was failed while it may still run"
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        wait_for(pending.answer.done, 10, "the daemon's answer to the load")
        assert not isinstance(pending.answer.result(), errors.RadixKVError)
        for layer, v in enumerate(views.values()):  # written late: the blocks had to stay held
            assert torch.equal(v[8], torch.full_like(v[8], 10 + layer))


def test_a_preemption_waits_for_a_late_save_however_long_the_daemon_takes(shm_kv, daemon, caplog, monkeypatch):
    """vLLM preempts a request whose save the frozen daemon left unanswered: `flush`
    returns only once the daemon answered (warning meanwhile), never after the held
    loads' limit, so what the daemon saves when it resumes is what the blocks held."""
    import threading

    import radixkv.vllm.saves as saves_module
    monkeypatch.setattr(saves_module, "LATE_FLUSH_TIMEOUT_S", 0.5)  # a held load's limit; not a save's
    prompt = torch.arange(5000, 5000 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()
    with open_sessions(shm_kv, daemon, timeout_s=0.3) as (views, adapter, scheduler):
        with a_late_save(daemon, views, adapter, prompt, caplog) as saves:
            flusher = threading.Thread(target=saves.flush, args=(["r"],), daemon=True)
            flusher.start()
            wait_for(lambda: "saves are unanswered after" in caplog.text or not flusher.is_alive(), 20,
                     "flush to wait and say so")
            assert flusher.is_alive(), "flush returned while the frozen daemon may still read the blocks"
        flusher.join(20)
        assert not flusher.is_alive(), "flush still waits after the daemon answered"
        saves.close()
        assert_saved_as_filled(adapter, scheduler, views, prompt)
