"""Loads answered once queued (`DaemonAdapter.begin_load(..., queued=True)`), as the
connector sends them on CUDA so that vLLM's forward starts while the daemon copies
(its layers wait on the load's per-layer events): the copy's outcome comes only with
the acknowledgement, which `settle_loads` collects after the forward. Shown here on
shared memory with a real daemon: a settled load's bytes are in the blocks; a copy that
fails is reported failed (the connector makes vLLM recompute it); one not answered in
time is failed too and its blocks stay held until the daemon answers.
"""

import torch

from tests.vllm.test_vllm_adapter import SAVED, assert_held_until_answered, open_sessions, shm_kv  # noqa: F401


def test_a_load_answered_once_queued_is_settled_with_its_bytes_in_place(shm_kv, daemon):
    with open_sessions(shm_kv, daemon) as (views, adapter, scheduler):
        [hit] = scheduler.lookup([SAVED])
        pending = adapter.begin_load(hit.node, [8, 9], 0, hit.lease, queued=True)
        assert adapter.finish_load(pending) == 2
        assert pending.transfer, "a queued load leaves its transfer to settle"
        assert adapter.settle_loads([pending.transfer]) == (set(), set())
        for layer, v in enumerate(views.values()):
            assert torch.equal(v[8], torch.full_like(v[8], 10 + layer))
            assert torch.equal(v[9], torch.full_like(v[9], 20 + layer))
        plain = adapter.begin_load(hit.node, [10], 0, hit.lease)  # answered once copied: nothing to settle
        assert adapter.finish_load(plain) == 1 and plain.transfer == 0
        scheduler.release([hit.lease])


def test_a_queued_load_whose_copy_fails_is_settled_as_failed(shm_kv, daemon_factory):
    daemon = daemon_factory("--fault-fail-loads", "1")  # every host->device copy fails
    with open_sessions(shm_kv, daemon) as (views, adapter, scheduler):
        [hit] = scheduler.lookup([SAVED])
        pending = adapter.begin_load(hit.node, [8, 9], 0, hit.lease, queued=True)
        assert adapter.finish_load(pending) == 2  # the answer came before the copy's end
        assert adapter.settle_loads([pending.transfer]) == ({pending.transfer}, set())
        scheduler.release([hit.lease])


def test_a_queued_load_unanswered_in_time_fails_and_holds_its_blocks(shm_kv, daemon_factory):
    daemon = daemon_factory("--fault-copy-delay", "1.0")  # every copy starts 1 s late
    with open_sessions(shm_kv, daemon, timeout_s=0.2) as (views, adapter, scheduler):
        [hit] = scheduler.lookup([SAVED])
        for v in views.values():
            v[8].fill_(-1)
        pending = adapter.begin_load(hit.node, [8, 9], 0, hit.lease, queued=True)
        assert adapter.finish_load(pending) == 2 and not pending.late
        failed, unanswered = adapter.settle_loads([pending.transfer])
        assert failed == unanswered == {pending.transfer}
        assert_held_until_answered(adapter, views, lambda saves: saves.hold_transfer("r", pending.transfer))
        scheduler.release([hit.lease])
