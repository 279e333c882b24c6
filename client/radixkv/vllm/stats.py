"""radixkv in vLLM's own metrics: what the connector did, in vLLM's log line and /metrics.

vLLM collects a connector's counts once per scheduler step (`get_kv_connector_stats`),
logs them every interval ("KV Transfer metrics: lookups=..., loaded_blocks=...") and
records them as Prometheus series on its /metrics (`build_prom_metrics`), one per name
in `COUNTERS`, labelled like vLLM's own (model, engine). The scheduler side counts
everything (`SchedulerSide.take_counts`): it hears every rank's report, so a load of a
tensor-parallel engine counts once.

Which tier a hit came from goes to vLLM's `vllm:prompt_tokens_cached_by_source`
(`hit_source`): host, or the daemon's storage tier (disk for file storage; Mooncake and
Redis are remote stores, which vLLM files as external_unspecified).
"""

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

# count -> (Prometheus name, help). Counts are totals over the interval vLLM collects.
COUNTERS = {
    "lookups": ("vllm:radixkv_lookups_total",
                "Prompts the scheduler looked up on the radixkv daemon (one batched Match per step)."),
    "lookup_failures": ("vllm:radixkv_lookup_failures_total",
                        "Lookups the radixkv daemon did not answer (away, timed out); counted as misses."),
    "staged": ("vllm:radixkv_staged_prompts_total",
               "Prompts whose hit radixkv fetched from its storage tier to host before the load."),
    "loads": ("vllm:radixkv_loads_total",
              "Loads from radixkv into vLLM's blocks, counted once every tensor-parallel rank reported."),
    "loaded_blocks": ("vllm:radixkv_loaded_blocks_total",
                      "Blocks loaded from radixkv (every rank's shard in place): prefill vLLM did not compute."),
    "failed_blocks": ("vllm:radixkv_load_failed_blocks_total",
                      "Blocks a radixkv load did not fill (daemon away, copy failed): vLLM recomputed them."),
    "save_blocks": ("vllm:radixkv_save_blocks_total",
                    "Full blocks handed to radixkv to save (the daemon skips those it holds already)."),
}


def hit_source(storage: str) -> CacheHitSource:
    """vLLM's name for where hits from the daemon's storage tier (`storage`, its kind as
    Register tells it) come from."""
    return CacheHitSource.DISK if storage == "file" else CacheHitSource.EXTERNAL_UNSPECIFIED


class RadixKVStats(KVConnectorStats):
    """`data`: count name -> total (names from COUNTERS), serializable as it is."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data[name] for name in COUNTERS if name in self.data}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class RadixKVPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per COUNTERS entry, a series per vLLM engine from the start
    (0 until something happens)."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counters = {name: self._counter_cls(name=prom, documentation=doc, labelnames=labelnames)
                    for name, (prom, doc) in COUNTERS.items()}
        self._series = {(engine, name): counter.labels(*values)
                        for engine, values in per_engine_labelvalues.items() for name, counter in counters.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, n in transfer_stats_data.items():
            series = self._series.get((engine_idx, name))
            if series is not None and n:  # a name this version does not know is left out
                series.inc(n)


__all__ = ["COUNTERS", "CacheHitSource", "RadixKVPromMetrics", "RadixKVStats", "hit_source"]
