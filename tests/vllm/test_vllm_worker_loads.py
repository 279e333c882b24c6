"""A worker's loads through a step (`WorkerLoads`), with a real daemon and no vLLM engine:
what vLLM is told (blocks with load errors, requests that must not save, pages loaded
for the scheduler's report) when a load is answered once copied (shared memory) and when
it is answered once queued and settled after the forward (as on CUDA; here on shared
memory, reading the blocks only after the settle), for a healthy and a failing daemon.
"""

import torch

from radixkv.vllm.layer_waits import LayerWaits
from radixkv.vllm.loads import WorkerLoads
from radixkv.vllm.metadata import LoadSpec
from radixkv.vllm.saves import Saves
from tests.vllm.test_vllm_adapter import SAVED, open_sessions, shm_kv  # noqa: F401 (shm_kv: a fixture)


def one_step(views, adapter, scheduler, *, queued: bool, early: bool = False) -> tuple[WorkerLoads, LoadSpec]:
    """A step that loads the saved 2-page prompt into blocks 8 and 9 (request "r"), through
    the forward; returns the loads and the spec."""
    [hit] = scheduler.lookup([SAVED])
    spec = LoadSpec("r", (8, 9), 0, hit.node, hit.lease)
    saves = Saves(adapter)
    loads = WorkerLoads(adapter, saves, LayerWaits(views, adapter.wait_loaded), queued=queued)
    try:
        if early:
            loads.begin_early([spec])
        loads.load([spec])
        for name in views:  # the forward
            loads.layer_begins(name)
        loads.forward_queued([spec])
        loads.forward_queued([spec])  # vLLM's second call in the step: nothing more
    finally:
        saves.close()
        scheduler.release([hit.lease])
    return loads, spec


def assert_loaded(views) -> None:
    for layer, v in enumerate(views.values()):
        assert torch.equal(v[8], torch.full_like(v[8], 10 + layer))
        assert torch.equal(v[9], torch.full_like(v[9], 20 + layer))


def test_a_healthy_load_reports_its_pages_and_no_errors_answered_either_way(shm_kv, daemon):
    with open_sessions(shm_kv, daemon) as (views, adapter, scheduler):
        for queued, early in ((False, False), (True, False), (True, True)):
            for v in views.values():
                v[8:10].fill_(-1)
            loads, spec = one_step(views, adapter, scheduler, queued=queued, early=early)
            assert loads.take_errors() == set() and loads.short == set()
            assert loads.take_loaded() == {"r": 2}, (queued, early)
            assert_loaded(views)


def test_a_failed_copy_makes_vllm_recompute_whether_answered_once_copied_or_once_queued(shm_kv, daemon_factory):
    """Answered once copied, the failure comes with the answer; answered once queued, it
    comes only with the acknowledgement after the forward. Either way vLLM is told the
    blocks failed (it recomputes them) and the request saves nothing more until it finishes."""
    daemon = daemon_factory("--fault-fail-loads", "1")  # every host->device copy fails
    with open_sessions(shm_kv, daemon) as (views, adapter, scheduler):
        for queued in (False, True):
            loads, spec = one_step(views, adapter, scheduler, queued=queued)
            assert loads.take_errors() == {8, 9}, queued
            assert loads.short == {"r"}
            loads.forget({"r"})
            assert loads.short == set()
            assert loads.take_loaded() == {"r": 0}
            assert loads.take_errors() == set()  # told once
