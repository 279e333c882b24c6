"""RadixKVConnector: radixkv as a vLLM (0.32) KV connector.

    LLM(model, kv_transfer_config={"kv_connector": "RadixKVConnector",
                                   "kv_connector_module_path": "radixkv.vllm",
                                   "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"target": "unix:///..."}})

vLLM makes one instance per role. The worker instance (one per TP rank) places vLLM's
KV cache in shared memory (`get_mem_pool_context`), registers it with the daemon
(`register_kv_caches`), loads hits into the blocks the scheduler chose before the
forward (`start_load_kv`), starts asynchronous Inserts of newly full blocks after it
(`wait_for_save`) and reports when a finished request's copies are done (`get_finished`),
blocks that failed to load (`get_block_ids_with_load_errors`, vLLM recomputes them) and
its loads (`build_connector_worker_meta`, so the scheduler releases their leases). The
scheduler instance looks prefixes up on its own daemon session without waiting, and plans
loads and saves (`radixkv.vllm.scheduler`). docs/vllm.md describes the mapping.
"""

import logging
import os
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from .config import ConnectorConfig
from .daemon import DaemonAdapter, PendingLoad
from .kvmemory import ShmAllocation, layout_from_spec
from .layer_waits import LayerWaits
from .lookups import Lookups
from .metadata import RadixKVMetadata, RadixKVWorkerMetadata
from .registration import register_worker
from .saves import Saves
from .scheduler import SchedulerSide

log = logging.getLogger("vllm.radixkv")  # vLLM's log handlers show it


class RadixKVConnector(KVConnectorBase_V1):
    """vLLM's KVConnectorBase_V1 backed by a radixkv daemon."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config,
                                                 vllm_config.model_config.served_model_name)
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank, self.tp_size = _tp_rank(vllm_config)
        self._adapter: DaemonAdapter | None = None
        self._saves: Saves | None = None
        self._layers: LayerWaits | None = None
        self._allocation: ShmAllocation | None = None
        self._scheduler: SchedulerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.block_size, self.tp_size, self._scheduler_session(kv_cache_config),
                                            lambda: self._kv_cache_manager, self.config.async_loads)
        self._load_errors: set[int] = set()
        self._short_loads: set[str] = set()  # requests whose load this step left blocks unfilled
        self._loaded: dict[str, int] = {}  # loads done since the last worker report: pages
        self._pending: dict[str, PendingLoad] = {}  # loads begun in handle_preemptions, by request
        self._unsettled: dict[str, int] = {}  # CUDA loads of this step answered once queued: transfer
        self._receiving: dict[str, tuple] = {}  # async loads in flight: request -> (spec, PendingLoad)
        self._recv_done: set[str] = set()  # async loads over, for get_finished
        self._recv_failed: set[str] = set()
        if role == KVConnectorRole.SCHEDULER and getattr(tc, "kv_load_failure_policy", "") == "fail":
            log.warning("radixkv: kv_load_failure_policy is 'fail': a request whose load fails "
                        "(daemon restarted, page evicted) fails too; set it to 'recompute'")

    # -- worker side -------------------------------------------------------------------

    def get_mem_pool_context(self):
        """On CPU: place vLLM's one KV allocation in a shared-memory segment."""
        if self._vllm_config.device_config.device.type != "cpu":
            return None  # CUDA: vLLM allocates; register_kv_caches exports IPC handles
        self._allocation = ShmAllocation()
        return self._allocation

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's KV memory to the daemon and open the session: on CPU the
        shared-memory allocation, on CUDA the views' storages by IPC handle (backend
        "cuda", docs/vllm.md). Raises RuntimeError (vLLM fails to start) when the daemon
        is unreachable or refuses."""
        adapter = DaemonAdapter(self.config, engine=f"vllm pid {os.getpid()} rank {self.tp_rank}",
                                tp_rank=self.tp_rank, tp_size=self.tp_size,
                                instance=self._kv_transfer_config.engine_id or "")
        try:
            register_worker(adapter, kv_caches, self.block_size, self._allocation)
        except BaseException:
            adapter.close()
            if self._allocation is not None and self._allocation.segment is not None:
                self._allocation.segment.unlink()
            raise
        self._adapter = adapter
        self._saves = Saves(adapter)
        self._layers = LayerWaits(kv_caches, adapter.wait_loaded)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Before the forward (vLLM calls this first thing in a step): the saves of requests
        preempted this step finish (vLLM freed their blocks and may fill them in this
        forward), then this step's loads start, so the daemon copies while vLLM prepares
        the forward's inputs; `start_load_kv` waits for them. Not in a step that zeroes or
        copies blocks before the forward (hybrid models): those load in `start_load_kv`."""
        meta = kv_connector_metadata if isinstance(kv_connector_metadata, RadixKVMetadata) else None
        if meta is None or self._saves is None:
            return
        self._saves.step_began()
        if meta.flush:
            self._saves.flush(meta.flush)
        if meta.early_loads and not self.config.async_loads:
            for spec in meta.loads:
                self._pending[spec.req_id] = self._adapter.begin_load(spec.node, spec.block_ids, spec.local_blocks,
                                                                     spec.lease, queued=self._queued_loads)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Load this step's hits into their blocks (synchronously: vLLM runs this before a
        forward with loads) from the node and with the lease of the scheduler's Match:
        wait for the loads `handle_preemptions` started, do the others now."""
        meta = self._meta()
        if meta is None or self._adapter is None:
            return
        for spec in meta.loads:
            if self.config.async_loads:  # answered in get_finished, once the daemon copied
                pending = self._adapter.begin_load(spec.node, spec.block_ids, spec.local_blocks, spec.lease)
                self._receiving[spec.req_id] = (spec, pending)
                if pending.late:  # held like a save: a request aborted meanwhile keeps its blocks
                    self._saves.hold(spec.req_id, pending.answer)
                continue
            pending = self._pending.pop(spec.req_id, None)
            if pending is None:
                pending = self._adapter.begin_load(spec.node, spec.block_ids, spec.local_blocks, spec.lease,
                                                   queued=self._queued_loads)
            self._loads_over(spec, self._finish_load(spec.req_id, pending, self._layers))
        # Loads begun in a step that returned before its start_load_kv (vLLM's encoder-only
        # steps do): wait for them too, so that none is left writing blocks unobserved.
        for req_id, pending in self._pending.items():
            self._finish_load(req_id, pending)
        self._pending.clear()

    @property
    def _queued_loads(self) -> bool:
        """CUDA: a step's loads are answered once queued (with their layer events), so the
        forward starts while they copy; their outcome is settled after it (`_forward_queued`)."""
        return self._adapter is not None and self._adapter.cuda_device is not None

    def _finish_load(self, req_id: str, pending: PendingLoad, layers: LayerWaits | None = None) -> int:
        """Wait for a begun load's answer: the blocks it filled. One answered too late fills
        none (vLLM recomputes them) and holds the request's blocks until the daemon answers.
        With `layers`, its CUDA events are waited layer by layer in the forward. One
        answered once queued is settled after the forward."""
        on_events = None if layers is None else (lambda events: layers.loaded(req_id, events))
        got = self._adapter.finish_load(pending, on_events)
        if pending.late:
            self._saves.hold(req_id, pending.answer)
        if pending.transfer:
            self._unsettled[req_id] = pending.transfer
        return got

    def _loads_over(self, spec, got: int) -> None:
        """A load filled the first `got` of its blocks: report it, fail the rest."""
        self._loaded[spec.req_id] = got
        failed = spec.load_blocks[got:]
        if failed:
            self._load_errors.update(failed)
            self._short_loads.add(spec.req_id)
        if self.config.async_loads:
            self._recv_done.add(spec.req_id)
            if failed:
                self._recv_failed.add(spec.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """CUDA: vLLM's stream waits for this layer's part of the step's loads (their host
        side finished in start_load_kv; `layer_waits`)."""
        if self._layers is not None:
            self._layers.layer_begins(layer_name)

    def _forward_queued(self) -> None:
        """After the forward (the first of wait_for_save and get_block_ids_with_load_errors,
        whichever vLLM calls first): a load whose events some layer never waited for, or
        whose copy failed (settled now: loads answered once queued), counts as failed, so
        vLLM recomputes its blocks and the step saves nothing of it."""
        early = self._layers.step_over() if self._layers is not None else set()
        if early:
            log.warning("radixkv: vLLM's forward did not wait for every layer of %d load(s): they count as failed "
                        "(recomputed) and loads wait for all layers before the forward from now on", len(early))
        bad = early | self._settle_loads()
        meta = self._meta()
        if not bad or meta is None:
            return
        for spec in meta.loads:
            if spec.req_id in bad:
                self._loads_over(spec, 0)

    def _settle_loads(self) -> set[str]:
        """The step's loads answered once queued: acknowledged and waited for now, while
        the GPU runs the forward. Returns the requests whose load failed; one unanswered
        keeps its blocks held until the daemon answers."""
        if not self._unsettled:
            return set()
        unsettled, self._unsettled = self._unsettled, {}
        failed, unanswered = self._adapter.settle_loads(unsettled.values())
        for req_id, transfer in unsettled.items():
            if transfer in unanswered:
                self._saves.hold_transfer(req_id, transfer)
        return {req_id for req_id, transfer in unsettled.items() if transfer in failed}

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved in wait_for_save

    def wait_for_save(self) -> None:
        """Queue the Inserts of the blocks this step filled (asynchronous: the saves'
        thread sends them and the copies run in the daemon while vLLM goes on;
        `get_finished` says when a finished request's blocks are free). A request whose
        load this step left blocks unfilled saves nothing: its forward read those
        blocks, so what it computed is wrong (vLLM recomputes it)."""
        self._forward_queued()
        meta = self._meta()
        short, self._short_loads = self._short_loads, set()
        if meta is None or self._saves is None:
            return
        for spec in meta.saves:
            if spec.req_id in short:
                self._saves.skip(spec.req_id)
            else:
                self._saves.start(spec)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose blocks the scheduler kept for saves in flight, once
        those are copied: vLLM frees their blocks; requests whose asynchronous load is
        over, failed or not: vLLM schedules them, recomputing the failed blocks)."""
        if self._saves is None:
            return None, None
        meta = self._meta()
        sending = self._saves.finished(finished_req_ids, meta.delayed if meta else ())
        answered = self._answered_loads()
        if self._receiving and not answered:
            # Hand the GIL over: vLLM's loop, stepping while these requests wait, holds it,
            # and the stream's reader thread that carries the answers would get it only
            # every switch interval (5 ms).
            time.sleep(0)
            answered = self._answered_loads()
        for req_id in answered:
            spec, pending = self._receiving.pop(req_id)
            self._loads_over(spec, self._adapter.finish_load(pending))  # does not wait: answered
        recving, self._recv_done = self._recv_done, set()
        return sending or None, recving or None

    def _answered_loads(self) -> list[str]:
        """Requests whose asynchronous load `finish_load` would not wait for (answered, or never sent)."""
        return [r for r, (_, pending) in self._receiving.items() if not pending.late]

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving, self._recv_failed = self._recv_failed & results.finished_recving, set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._forward_queued()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> RadixKVWorkerMetadata | None:
        """The loads this worker finished (their leases can go), the saves that are over
        and the loads it holds since its last report."""
        if self._saves is None:
            return None
        self._saves.poll()
        saved, held = self._saves.report()
        if not self._loaded and not saved and not held:
            return None
        loaded, self._loaded = self._loaded, {}
        rank = self.tp_rank
        return RadixKVWorkerMetadata(*({req: {rank: n} for req, n in table.items()} for table in (loaded, saved, held)))

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._saves is not None:
            self._saves.close()
        if self._adapter is not None:
            self._adapter.close()
        if self._allocation is not None and self._allocation.segment is not None:
            self._allocation.segment.unlink()

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> RadixKVMetadata:
        return self._scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, RadixKVWorkerMetadata):
            self._scheduler.answered(meta)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (keep the blocks) for a request that had saves: the workers list it in
        `get_finished` once the daemon's copies out of its blocks are done."""
        return self._scheduler.finished(request), None

    # -- internals ---------------------------------------------------------------------

    def _scheduler_session(self, kv_cache_config) -> Lookups | None:
        """The scheduler's own daemon session (role "scheduler": Match and Release, no
        buffers), registered with the layout the workers registered. Raises RuntimeError
        (vLLM fails to start) when the daemon is unreachable or refuses it."""
        try:
            layout = layout_from_spec(kv_cache_config)
        except (AttributeError, ValueError) as e:
            log.warning("radixkv: no scheduler session (%s): every lookup is a miss", e)
            return None
        return Lookups.open(self.config, layout, engine=f"vllm pid {os.getpid()} scheduler", tp_size=self.tp_size,
                            instance=self._kv_transfer_config.engine_id or "")

    def _meta(self) -> RadixKVMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, RadixKVMetadata) else None


def _tp_rank(vllm_config) -> tuple[int, int]:
    size = vllm_config.parallel_config.tensor_parallel_size
    if size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    try:
        return get_tensor_model_parallel_rank(), size
    except (AssertionError, RuntimeError):
        return 0, size  # the scheduler process has no TP group


__all__ = ["RadixKVConnector"]
