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
loads and saves (`radixkv.vllm.scheduler`); it also reports what it did to vLLM's metrics
(`get_kv_connector_stats`, `get_external_cache_hit_sources`; `radixkv.vllm.stats`, with
its own time per step, `radixkv.vllm.latency`; the workers report their loads' waits) and,
when vLLM publishes KV events, adds the daemon's host and storage blocks to them
(`take_events`; `radixkv.vllm.tier_events`). docs/vllm.md describes the mapping.
"""

import dataclasses
import logging
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from .config import ConnectorConfig, model_identity, on_device
from .daemon import DaemonAdapter
from .kvmemory import ShmAllocation, layout_from_spec
from .latency import StepClock, ends_step, timed
from .layer_waits import LayerWaits
from .loads import WorkerLoads
from .lookups import Lookups
from .metadata import RadixKVMetadata, RadixKVWorkerMetadata
from .registration import register_worker
from .saves import Saves
from .scheduler import SchedulerSide
from .stats import RadixKVPromMetrics, RadixKVStats
from .supported import check_supported, check_version
from .tier_events import TierEvents

log = logging.getLogger("vllm.radixkv")  # vLLM's log handlers show it

# vLLM keeps one worker-side connector per process (kv_transfer_state's global): a second
# engine in the same process gets the first one's, which would describe the second
# engine's KV memory over the first's and copy both engines' blocks into one of them.
SECOND_ENGINE = (
    "radixkv: another vLLM engine in this process already uses this KV connector, and vLLM "
    "keeps one worker-side connector per process: this engine's KV memory would be registered "
    "over the first engine's, and both would read wrong KV. Run each engine in a process of its "
    "own (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default), or shut the first engine down first")


class RadixKVConnector(KVConnectorBase_V1):
    """vLLM's KVConnectorBase_V1 backed by a radixkv daemon."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_supported(vllm_config, kv_cache_config)  # vLLM fails to start, saying what is not supported
        check_version()
        tc = self._kv_transfer_config
        config = ConnectorConfig.from_extra(tc.kv_connector_extra_config, str(vllm_config.model_config.model))
        # `model` from the settings names the weights only: the engine's settings that
        # change their KV (KV cache dtype, RoPE choice, overrides) are appended to it too.
        identity = model_identity(vllm_config.model_config, vllm_config.cache_config,
                                  vllm_config.load_config.download_dir, model=config.model)
        # The scheduler's and every worker's connector are made with the engine's one
        # kv_cache_config, which carries the KV layout vLLM resolved (0.32).
        self.config = dataclasses.replace(config, model=on_device(
            identity, vllm_config.device_config.device.type, getattr(kv_cache_config, "kv_cache_layout", None)))
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank, self.tp_size = _tp_rank(vllm_config)
        self._adapter: DaemonAdapter | None = None
        self._saves: Saves | None = None
        self._loads: WorkerLoads | None = None
        self._saves_started: RadixKVMetadata | None = None  # the metadata whose saves wait_for_save started
        self._allocation: ShmAllocation | None = None
        self._scheduler: SchedulerSide | None = None
        self._tier_events: TierEvents | None = None
        self.clock = StepClock()  # the scheduler's seconds in this connector, per step
        if role == KVConnectorRole.SCHEDULER:
            # kv_role: kv_both loads and saves; kv_consumer only loads, kv_producer only saves
            loads, saves = tc.is_kv_consumer, tc.is_kv_producer
            self._scheduler = SchedulerSide(self.block_size, self.tp_size,
                                            self._scheduler_session(kv_cache_config) if loads else None,
                                            lambda: self._kv_cache_manager, self.config.async_loads, saves=saves)
            if not (loads and saves):
                log.info("radixkv: kv_role %s: %s", tc.kv_role,
                         "loads only, nothing is saved" if loads else "saves only, nothing is looked up")
            if loads and self.config.tier_events and _publishes_kv_events(vllm_config):
                self._tier_events = TierEvents.for_connector(self.config)
        if role == KVConnectorRole.SCHEDULER and getattr(tc, "kv_load_failure_policy", "") == "fail":
            log.warning("radixkv: kv_load_failure_policy is 'fail': a request whose load fails "
                        "(daemon restarted, page evicted) fails too; set it to 'recompute'")

    # -- worker side -------------------------------------------------------------------

    def get_mem_pool_context(self):
        """On CPU: place vLLM's one KV allocation in a shared-memory segment. RuntimeError
        (SECOND_ENGINE) for a second engine of this process."""
        if self._allocation is not None or self._adapter is not None:
            raise RuntimeError(SECOND_ENGINE)
        if self._vllm_config.device_config.device.type != "cpu":
            return None  # CUDA: vLLM allocates; register_kv_caches exports IPC handles
        self._allocation = ShmAllocation()
        return self._allocation

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's KV memory to the daemon and open the session: on CPU the
        shared-memory allocation, on CUDA the views' storages by IPC handle (backend
        "cuda", docs/vllm.md). Raises RuntimeError (vLLM fails to start) when the daemon
        is unreachable or refuses, and for a second engine of this process (SECOND_ENGINE)."""
        if self._adapter is not None:
            raise RuntimeError(SECOND_ENGINE)
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
        # A forward replayed as a full CUDA graph runs no wait_for_layer_load: loads wait whole then.
        layers = None if _full_cuda_graphs(self._vllm_config) else LayerWaits(kv_caches, adapter.wait_loaded)
        self._loads = WorkerLoads(adapter, self._saves, layers, queued=adapter.cuda_device is not None,
                                  async_loads=self.config.async_loads)

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
        if meta.early_loads:
            self._loads.begin_early(meta.loads)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Load this step's hits into their blocks before the forward (`WorkerLoads.load`:
        from the node and with the lease of the scheduler's Match; on CUDA answered once
        queued, the forward's layers waiting on the copy's events)."""
        meta = self._meta()
        if meta is not None and self._loads is not None:
            self._loads.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """CUDA: vLLM's stream waits for this layer's part of the step's loads (`layer_waits`)."""
        if self._loads is not None:
            self._loads.layer_begins(layer_name)

    def _forward_queued(self) -> None:
        """After the forward (the first of wait_for_save and get_block_ids_with_load_errors,
        whichever vLLM calls first): `WorkerLoads.forward_queued`."""
        if self._loads is not None:
            meta = self._meta()
            self._loads.forward_queued(meta.loads if meta is not None else [])

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved in wait_for_save

    def wait_for_save(self) -> None:
        """Queue the Inserts of the blocks this step filled (asynchronous: the saves'
        thread sends them and the copies run in the daemon while vLLM goes on;
        `get_finished` says when a finished request's blocks are free). A request whose
        load left blocks unfilled saves nothing more (`WorkerLoads.short`): its forward
        read those blocks, so what it computed is wrong (vLLM recomputes it). (Another
        request holding such a block, and every rank's saves over a load, wait on the
        scheduler side until every rank reported the load: `SchedulerSide.build`.)"""
        self._forward_queued()
        meta = self._meta()
        if meta is None or self._loads is None:
            return
        short = self._loads.short
        for spec in meta.saves:
            if spec.req_id in short:
                self._saves.skip(spec.req_id)
            else:
                self._saves.start(spec)
        self._saves_started = meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose blocks the scheduler kept for saves in flight, once
        those are copied: vLLM frees their blocks; requests whose asynchronous load is
        over, failed or not: vLLM schedules them, recomputing the failed blocks)."""
        if self._saves is None:
            return None, None
        meta = self._meta()
        # With speculative decoding vLLM calls this before wait_for_save (which it defers
        # past the drafter): a request whose last save is in this step's metadata must not
        # be listed before that save is in flight.
        unstarted = {s.req_id for s in meta.saves} if meta and self._saves_started is not meta else ()
        sending = self._saves.finished(finished_req_ids, meta.delayed if meta else (), unstarted)
        self._loads.forget(finished_req_ids)
        recving = self._loads.received()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        if self._loads is not None:
            results.failed_recving = self._loads.take_failed_receiving(results.finished_recving)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._forward_queued()
        return self._loads.take_errors() if self._loads is not None else set()

    def build_connector_worker_meta(self) -> RadixKVWorkerMetadata | None:
        """The loads this worker finished (their leases can go), the saves that are over
        and the loads it holds since its last report."""
        if self._saves is None:
            return None
        self._saves.poll()
        saved, held = self._saves.report()
        loaded = self._loads.take_loaded()
        if not loaded and not saved and not held:
            return None
        rank = self.tp_rank
        return RadixKVWorkerMetadata(*({req: {rank: n} for req, n in table.items()} for table in (loaded, saved, held)))

    def shutdown(self) -> None:
        if self._tier_events is not None:
            self._tier_events.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._saves is not None:
            self._saves.close()
        if self._adapter is not None:
            self._adapter.close()
        if self._allocation is not None and self._allocation.segment is not None:
            self._allocation.segment.unlink()

    # -- scheduler side ----------------------------------------------------------------

    @timed
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    @timed
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    @ends_step
    def build_connector_meta(self, scheduler_output) -> RadixKVMetadata:
        return self._scheduler.build(scheduler_output)

    @timed
    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, RadixKVWorkerMetadata):
            self._scheduler.answered(meta)
        self._scheduler.sent(connector_output.finished_sending or ())

    @timed
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (keep the blocks) for a request that had saves: the workers list it in
        `get_finished` once the daemon's copies out of its blocks are done."""
        return self._scheduler.finished(request), None

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come back once their saves are done: vLLM waits a
        step for them rather than preempting a running request."""
        return self._scheduler is not None and self._scheduler.frees_pending

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a cache, not a hand-off. A save cut by a preemption is a later miss, so
        vLLM need not drop a preempted request's sampled tokens (as it does for producers)."""
        return False

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (after a weight update): this
        engine stops matching anything saved before (`SchedulerSide.reset`). True."""
        if self._scheduler is not None:
            self._scheduler.reset()
            log.info("radixkv: cache reset: nothing saved before is matched again by this engine")
        return True

    def take_events(self):
        """The daemon's host and storage blocks of this namespace, as KV events vLLM
        publishes with its own (`radixkv.vllm.tier_events`; when vLLM publishes events)."""
        return self._tier_events.take() if self._tier_events is not None else ()

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """The tokens of the load just planned, by tier: on host already, or fetched from
        the daemon's storage for this request (vLLM's prompt_tokens_cached_by_source)."""
        if num_external_tokens == 0:
            return {}
        return self._scheduler.hit_sources(request.request_id, num_external_tokens)

    def get_kv_connector_stats(self) -> RadixKVStats | None:
        """What happened since vLLM last asked (`radixkv.vllm.stats`). The scheduler: its
        counts (it hears every rank's report, so a load counts once), its lookups' waits
        and its own time per step. A worker: its loads' waits only (vLLM merges every
        rank's, so a tensor-parallel load is observed once per rank)."""
        if self._scheduler is not None:
            data = self._scheduler.take_counts()
            lookups = self._scheduler.lookups
            data.update(lookup_seconds=lookups.take_waits() if lookups is not None else [],
                        scheduler_step_seconds=self.clock.take())
        elif self._loads is not None:
            data = {"load_wait_seconds": self._loads.take_waits()}
        else:
            return None
        data = {name: v for name, v in data.items() if v}
        return RadixKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RadixKVStats:
        return RadixKVStats.of(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> RadixKVPromMetrics:
        return RadixKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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


def _register_by_name() -> None:
    """vLLM's MultiConnector finds a child's stats class by connector name in its factory's
    registry, which lists vLLM's own connectors only: add this one (once per process; any
    process that loads the class through `kv_connector_module_path` runs this)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    try:
        KVConnectorFactory.register_connector("RadixKVConnector", __name__, "RadixKVConnector")
    except ValueError:
        pass  # registered already


def _publishes_kv_events(vllm_config) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def _full_cuda_graphs(vllm_config) -> bool:
    """Whether vLLM may replay whole forwards as CUDA graphs (no Python runs per layer)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return bool(mode is not None and vllm_config.device_config.device.type == "cuda" and mode.has_full_cudagraphs())


def _tp_rank(vllm_config) -> tuple[int, int]:
    size = vllm_config.parallel_config.tensor_parallel_size
    if size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    try:
        return get_tensor_model_parallel_rank(), size
    except (AssertionError, RuntimeError):
        return 0, size  # the scheduler process has no TP group


_register_by_name()

__all__ = ["RadixKVConnector"]
