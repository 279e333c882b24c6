"""radixkv in vLLM's own metrics: what the connector did, in vLLM's log line and /metrics.

vLLM collects a connector's counts once per scheduler step (`get_kv_connector_stats`),
logs them every interval ("KV Transfer metrics: lookups=..., loaded_blocks=...") and
records them as Prometheus series on its /metrics (`build_prom_metrics`), one per name
in `COUNTERS`, labelled like vLLM's own (model, engine). The scheduler side counts
everything (`SchedulerSide.take_counts`): it hears every rank's report, so a load of a
tensor-parallel engine counts once.

How long radixkv makes vLLM wait goes to one Prometheus histogram per name in
`HISTOGRAMS` (seconds, `BUCKETS`), and the log line shows each one's mean and max in
milliseconds over the interval: the scheduler's lookups and its own time per step
(`radixkv.vllm.latency`), and each worker's waits for its loads. Those come from every
worker's own stats, which vLLM merges across tensor-parallel ranks (`aggregate`): a load
of a TP engine is observed once per rank, each rank's own wait.

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

# observation list -> (Prometheus name, help, log line's short name). Seconds, each list
# the observations of the interval vLLM collects.
HISTOGRAMS = {
    "lookup_seconds": ("vllm:radixkv_lookup_seconds",
                       "Seconds from the scheduler's first ask for a prompt to its radixkv lookup's answer "
                       "(the request waits meanwhile; its Match goes out at the end of the step).",
                       "lookup"),
    "load_wait_seconds": ("vllm:radixkv_load_wait_seconds",
                          "Seconds a worker waited for a radixkv load's answer before the forward "
                          "(async loads: from the load's start to its answer); observed on every tensor-parallel rank.",
                          "load_wait"),
    "scheduler_step_seconds": ("vllm:radixkv_scheduler_step_seconds",
                               "Seconds vLLM's scheduler spent inside the radixkv connector, per scheduler step.",
                               "scheduler_step"),
}
# 50 us .. 10 s
BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def hit_source(storage: str) -> CacheHitSource:
    """vLLM's name for where hits from the daemon's storage tier (`storage`, its kind as
    Register tells it) come from."""
    return CacheHitSource.DISK if storage == "file" else CacheHitSource.EXTERNAL_UNSPECIFIED


class RadixKVStats(KVConnectorStats):
    """`data`: count name -> total (names from COUNTERS) and histogram name -> list of
    seconds (HISTOGRAMS), serializable as it is. `aggregate` adds `other`'s into this
    object's own lists (`of` copies them)."""

    @classmethod
    def of(cls, data: dict[str, Any] | None) -> "RadixKVStats":
        """Stats owning a copy of `data`'s lists."""
        return cls(data={name: list(v) if isinstance(v, list) else v for name, v in (data or {}).items()})

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, n in other.data.items():
            if isinstance(n, list):
                self.data.setdefault(name, []).extend(n)
            else:
                self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts, then each histogram's mean and max in milliseconds (`lookup_ms_avg`...)."""
        out = {name: self.data[name] for name in COUNTERS if name in self.data}
        for name, (_, _, short) in HISTOGRAMS.items():
            seen = self.data.get(name)
            if seen:
                out[f"{short}_ms_avg"] = round(sum(seen) / len(seen) * 1e3, 3)
                out[f"{short}_ms_max"] = round(max(seen) * 1e3, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class RadixKVPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per COUNTERS entry and one histogram per HISTOGRAMS entry, a
    series per vLLM engine from the start (0 until something happens)."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        metrics = {name: self._counter_cls(name=prom, documentation=doc, labelnames=labelnames)
                   for name, (prom, doc) in COUNTERS.items()}
        metrics.update({name: self._histogram_cls(name=prom, documentation=doc, labelnames=labelnames,
                                                  buckets=list(BUCKETS))
                        for name, (prom, doc, _) in HISTOGRAMS.items()})
        self._series = {(engine, name): metric.labels(*values)
                        for engine, values in per_engine_labelvalues.items() for name, metric in metrics.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, n in transfer_stats_data.items():
            series = self._series.get((engine_idx, name))
            if series is None or not n:  # a name this version does not know is left out
                continue
            if isinstance(n, list):
                for seconds in n:
                    series.observe(seconds)
            else:
                series.inc(n)


__all__ = ["BUCKETS", "COUNTERS", "HISTOGRAMS", "CacheHitSource", "RadixKVPromMetrics", "RadixKVStats", "hit_source"]
