"""Prometheus metrics on their own HTTP port.

Two kinds: events observed as they happen (RPCs, copy durations, invariant violations:
plain prometheus-client metrics, which are thread-safe), and the cache's state and
counters, read at scrape time. The scrape runs on the HTTP server's thread while the
event loop owns the cache, so the state is read by a snapshot coroutine scheduled on
the loop: always consistent, never racing a mutation. Labels stay low-cardinality:
namespace, tier, reason, method, code; never tokens, pages or sessions.
"""

import asyncio
import errno
import logging
import time

from prometheus_client import (
    GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge, Histogram, Info,
    disable_created_metrics, start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from . import __version__
from .core.transfers import TransferKind
from .logs import log_event
from .storage.record import VERSION as RECORD_FORMAT

log = logging.getLogger("radixkv.metrics")

SNAPSHOT_TIMEOUT_S = 5.0  # a scrape's wait for the loop to read the cache's state
COPY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5)
STORAGE_OPERATIONS = ("exists", "get", "put")  # the storage mover's timed calls
RPC_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5, 1, 5)


class Metrics:
    def __init__(self):
        disable_created_metrics()  # *_created series double the output and say little here
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        Info("radixkv_build", "The daemon's version and the storage record format it reads and writes (daemons "
             "of two formats share no stored pages: docs/operations.md, Upgrades)", registry=self.registry).info(
            {"version": __version__, "record_format": str(RECORD_FORMAT)})
        r = self.registry
        self.rpc_requests = Counter("radixkv_rpc_requests", "RPCs answered, by method and status code",
                                    ["method", "code"], registry=r)
        self.rpc_duration = Histogram("radixkv_rpc_duration_seconds", "RPC handling time, by method",
                                      ["method"], buckets=RPC_BUCKETS, registry=r)
        self.copy_duration = Histogram(
            "radixkv_copy_duration_seconds",
            "Page copy time from start to completion (load: host->device, backup and write_back: "
            "device->host, store: host->storage tier, fetch: storage tier->host)",
            ["namespace", "direction"], buckets=COPY_BUCKETS, registry=r)
        self.invariant_violations = Counter("radixkv_invariant_violations", "Invariant violations found",
                                            ["namespace"], registry=r)
        self.expirations = Counter("radixkv_expirations", "Leases, load-backs and engine-managed saves the "
                                   "daemon released or finished after lease_timeout / ack_timeout (a slow or "
                                   "stuck engine), and sessions it closed after idle_session_timeout (kind session)",
                                   ["namespace", "kind"], registry=r)
        self.namespaces_reclaimed = Counter("radixkv_namespaces_reclaimed", "Namespaces no engine was attached to, "
                                            "dropped to make room for a new namespace (--reclaim-detached-after)",
                                            registry=r)
        self.config_reload_ok = Gauge(
            "radixkv_config_last_reload_successful", "1 when SIGHUP's last reading of the token file (what=tokens) "
            "or the TLS files (what=tls) took effect; 0 when it failed and the daemon serves on with the previous "
            "ones (the log's auth.reload_failed / tls.reload_failed says why)", ["what"], registry=r)
        self.storage_duration = Histogram(
            "radixkv_storage_operation_duration_seconds", "Storage tier calls (batched), by operation",
            ["operation"], buckets=COPY_BUCKETS, registry=r)
        self.storage_errors = Counter("radixkv_storage_errors", "Storage tier calls that failed, by operation",
                                      ["operation"], registry=r)
        self._rpc_children: dict[tuple[str, str], tuple] = {}  # (method, code) -> labelled series
        self._server = None

    def rpc_done(self, method: str, code: str, seconds: float) -> None:
        """Count one answered RPC and observe its handling time. The labelled series are
        looked up once per (method, code): `labels()` costs several times the update."""
        children = self._rpc_children.get((method, code))
        if children is None:
            children = self._rpc_children[(method, code)] = (self.rpc_requests.labels(method, code),
                                                             self.rpc_duration.labels(method))
        children[0].inc()
        children[1].observe(seconds)

    def observe_storage(self, operation: str, seconds: float, ok: bool) -> None:
        """Called from storage worker threads (prometheus-client metrics are thread-safe)."""
        self.storage_duration.labels(operation).observe(seconds)
        if not ok:
            self.storage_errors.labels(operation).inc()

    def add_storage(self) -> None:
        """Export the storage tier's error counters from 0 (called once a tier is configured):
        an alert on their rate needs the series before the first failure."""
        for operation in STORAGE_OPERATIONS:
            self.storage_errors.labels(operation)

    def reloadable(self, what: str) -> None:
        """`what` ("tokens", "tls") is read again on SIGHUP: its series starts at 1 (the
        start read it)."""
        self.config_reload_ok.labels(what).set(1)

    def reloaded(self, what: str, ok: bool) -> None:
        self.config_reload_ok.labels(what).set(1 if ok else 0)

    def add_namespace(self, name: str) -> None:
        """Export the namespace's counters from 0 at once, not from their first increment
        (a dashboard's rate and an `absent()` alert need the series)."""
        self.invariant_violations.labels(name)
        for kind in ("lease", "load_back", "save", "session"):
            self.expirations.labels(name, kind)

    def forget_namespace(self, name: str) -> None:
        """Stop exporting the series labelled with namespace `name` (it was dropped); the
        state the collector reads at scrape time forgets it by itself. A namespace of that
        name registered later starts its series from zero."""
        for metric in (self.copy_duration, self.invariant_violations, self.expirations):
            metric.remove_by_labels({"namespace": name})

    def watch(self, daemon, loop: asyncio.AbstractEventLoop) -> None:
        """Export the daemon's state, read on `loop` at each scrape."""
        self.registry.register(_StateCollector(daemon, loop))

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on host:port (port 0: off). "::" listens on every address, IPv6
        and IPv4 (Linux's dual stack); where the kernel has no IPv6 at all it falls back
        to 0.0.0.0 and says so, so that one image default serves both kinds of cluster."""
        if not port:
            return
        try:
            self._server, _ = start_http_server(port, host, registry=self.registry)
        except OSError as e:
            if host != "::" or e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            log_event(log, "metrics.no_ipv6", logging.WARNING, error=str(e),
                      note="this kernel has no IPv6: /metrics listens on 0.0.0.0 (IPv4) instead of ::")
            host = "0.0.0.0"
            self._server, _ = start_http_server(port, host, registry=self.registry)
        shown = f"[{host}]" if ":" in host else host
        log_event(log, "metrics.listening", address=f"http://{shown}:{port}/metrics")

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def snapshot(daemon) -> dict:
    """The state the collector exports, read in one go (call on the event loop)."""
    out = {"sessions": len(daemon.sessions), "namespaces": {}, "storage": None,
           "host_budget": daemon.host_memory_limit}
    events = getattr(daemon, "events", None)
    out["events"] = events.stats() if events is not None else None
    if daemon.storage is not None:
        health = daemon.storage.health
        out["storage"] = {
            "stats": daemon.storage.stats.snapshot(),
            "contents_lost": daemon.storage.generation,
            "up": daemon.storage_answered is not False and health.reads_answer,
            "failing": {d: d in health.failing for d in ("read", "write")},
            "full_refusals": health.full_refusals,
        }
    for ns in daemon.namespaces.values():
        cache = ns.cache
        kinds = {k: 0 for k in TransferKind}
        pins = 0
        for t in cache.transfers.values():
            kinds[t.kind] += 1
            if t.kind is TransferKind.LOAD:
                pins += len(t.nodes) + len(t.shared)
        out["namespaces"][ns.name] = {
            "counters": cache.counters.as_dict(),
            "loaded_bytes": ns.copies.loaded_bytes,
            "backed_up_bytes": ns.copies.backed_up_bytes,
            "page_bytes": ns.host_pool.layout.page_bytes,  # a host page (every TP rank's shard)
            "host_used": cache.host.num_used,
            "host_capacity": cache.host.capacity,
            "host_pinned": ns.host_pool.pinned,
            "device_pages": cache.device.num_pages,
            "device_held": cache.device.num_held,
            "device_protected": cache.protected_pages,
            "device_evictable": cache.evictable_pages,
            "transfers": {k.value: v for k, v in kinds.items()},
            "pins": pins,
            "nodes": len(cache.tree.nodes) - len(cache.tree.roots),
            "duplicates": len(cache.duplicates),
            "held": daemon.sessions.holdings(ns),
            "storage_queued": ns.copies.storage.pending_pages if ns.copies.storage is not None else 0,
        }
    return out


class _StateCollector(Collector):
    """The cache's state, read on the daemon's loop at each scrape. A loop that cannot
    answer within SNAPSHOT_TIMEOUT_S (stuck, or stopping) gets the last state it gave
    again, with `radixkv_state_age_seconds` saying how old it is: the scrape exported no
    radixkv series at all, and dashboards and alerts saw the daemon's series vanish."""

    def __init__(self, daemon, loop):
        self._daemon = daemon
        self._loop = loop
        self._last: tuple[float, dict] | None = None  # (when read, the snapshot)

    def describe(self):
        # Without describe(), registering this collector (on the event loop) would call
        # collect(), which waits for a snapshot coroutine on that same loop: a 5 s stall.
        return []

    def _snapshot(self) -> dict | None:
        async def read():
            return snapshot(self._daemon)

        try:
            snap = asyncio.run_coroutine_threadsafe(read(), self._loop).result(timeout=SNAPSHOT_TIMEOUT_S)
        except Exception:  # loop stopping or stuck: the last state read, said to be old
            return None
        self._last = (time.monotonic(), snap)
        return snap

    def collect(self):
        if self._snapshot() is None and self._last is None:
            return
        read_at, snap = self._last
        yield GaugeMetricFamily("radixkv_state_age_seconds", "Seconds since the cache state in these series was "
                                "read (0: at this scrape; growing while the daemon's loop does not answer)",
                                value=round(time.monotonic() - read_at, 3))
        yield GaugeMetricFamily("radixkv_sessions", "Engine sessions attached", value=snap["sessions"])
        yield GaugeMetricFamily("radixkv_namespaces", "Namespaces held", value=len(snap["namespaces"]))
        yield GaugeMetricFamily("radixkv_host_memory_budget_bytes", "Bytes all namespaces' host pools may take "
                                "together (--max-host-memory, else the cgroup's limit less 1 GiB or 80% of the "
                                "machine); compare with the sum of radixkv_host_pool_capacity_bytes",
                                value=snap["host_budget"])
        families = {
            "hits": CounterMetricFamily("radixkv_hit_tokens", "Prompt tokens matched in the cache, by tier",
                                        labels=["namespace", "tier"]),
            "miss": CounterMetricFamily("radixkv_miss_tokens", "Prompt tokens matched on no tier",
                                        labels=["namespace"]),
            "req": CounterMetricFamily("radixkv_matched_prompts", "Prompts matched", labels=["namespace"]),
            "ins": CounterMetricFamily("radixkv_inserted_tokens", "Tokens newly inserted", labels=["namespace"]),
            "lt": CounterMetricFamily("radixkv_load_back_tokens", "Tokens loaded host->device",
                                      labels=["namespace"]),
            "lb": CounterMetricFamily("radixkv_load_back_bytes", "Bytes copied host->device",
                                      labels=["namespace"]),
            "lf": CounterMetricFamily("radixkv_load_back_failed_tokens", "Tokens whose load-back failed",
                                      labels=["namespace"]),
            "bt": CounterMetricFamily("radixkv_backup_tokens", "Tokens copied device->host "
                                      "(write-through backups and write-backs)", labels=["namespace"]),
            "bb": CounterMetricFamily("radixkv_backup_bytes", "Bytes copied device->host", labels=["namespace"]),
            "ev": CounterMetricFamily("radixkv_evicted_tokens", "Tokens evicted, by tier and reason",
                                      labels=["namespace", "tier", "reason"]),
            "dw": CounterMetricFamily("radixkv_dropped_write_back_tokens",
                                      "Tokens dropped at device eviction for want of host room",
                                      labels=["namespace"]),
            "dr": CounterMetricFamily("radixkv_duplicate_reclaimed_tokens",
                                      "Host copies of device+host duplicates freed under host pressure",
                                      labels=["namespace"]),
            "hu": GaugeMetricFamily("radixkv_host_pool_used_bytes", "Host pool bytes in use", labels=["namespace"]),
            "hc": GaugeMetricFamily("radixkv_host_pool_capacity_bytes", "Host pool size", labels=["namespace"]),
            "hp": GaugeMetricFamily("radixkv_host_pool_pinned", "1 while the host pool is pinned (page-locked); 0 "
                                    "with CUDA means pinning was refused (memlock limit)", labels=["namespace"]),
            "dh": GaugeMetricFamily("radixkv_device_pages_held", "Engine device pages held by the cache",
                                    labels=["namespace", "state"]),
            "dp": GaugeMetricFamily("radixkv_device_pages", "Engine device pages registered", labels=["namespace"]),
            "tf": GaugeMetricFamily("radixkv_transfers_in_flight", "Copies in flight, by kind",
                                    labels=["namespace", "kind"]),
            "lease": GaugeMetricFamily("radixkv_leases", "Leases engines hold (Match or Insert with lease)",
                                       labels=["namespace"]),
            "unacked": GaugeMetricFamily("radixkv_load_backs_unacked", "Load-backs answered, not acknowledged yet",
                                         labels=["namespace"]),
            "lease_age": GaugeMetricFamily("radixkv_oldest_lease_seconds", "Age of the oldest lease engines "
                                           "hold (0: none)", labels=["namespace"]),
            "unacked_age": GaugeMetricFamily("radixkv_oldest_unacked_load_back_seconds", "Age of the oldest "
                                             "load-back answered and not acknowledged (0: none); engine-managed "
                                             "loads and saves included", labels=["namespace"]),
            "pin": GaugeMetricFamily("radixkv_load_back_pins", "Pins held by unacknowledged load-backs",
                                     labels=["namespace"]),
            "nodes": GaugeMetricFamily("radixkv_tree_nodes", "Radix tree nodes", labels=["namespace"]),
            "dup": GaugeMetricFamily("radixkv_tracked_duplicates", "Settled device+host duplicates",
                                     labels=["namespace"]),
            "st": CounterMetricFamily("radixkv_stored_tokens", "Tokens written to the storage tier",
                                      labels=["namespace"]),
            "sf": CounterMetricFamily("radixkv_store_failed_tokens", "Tokens whose storage write failed",
                                      labels=["namespace"]),
            "pf": CounterMetricFamily("radixkv_prefetched_tokens", "Tokens fetched from storage into host",
                                      labels=["namespace"]),
            "sq": GaugeMetricFamily("radixkv_storage_queued_pages", "Pages queued for storage writes; past "
                                    "--storage-queue-pages new stores are refused (storage.queue_full)",
                                    labels=["namespace"]),
        }
        f = families
        for name, s in snap["namespaces"].items():
            c = s["counters"]
            f["hits"].add_metric([name, "device"], c["device_hit_tokens"])
            f["hits"].add_metric([name, "host"], c["host_hit_tokens"])
            f["hits"].add_metric([name, "storage"], c.get("storage_hit_tokens", 0))
            # Tokens storage holds past the cache are hits too (counted when Match asks).
            f["miss"].add_metric([name], c["match_prompt_tokens"] - c["device_hit_tokens"] - c["host_hit_tokens"]
                                 - c.get("storage_hit_tokens", 0))
            f["req"].add_metric([name], c["match_requests"])
            f["ins"].add_metric([name], c["inserted_tokens"])
            f["lt"].add_metric([name], c["loaded_tokens"])
            f["lb"].add_metric([name], s["loaded_bytes"])
            f["lf"].add_metric([name], c["failed_load_tokens"])
            f["bt"].add_metric([name], c["backed_up_tokens"] + c["written_back_tokens"])
            f["bb"].add_metric([name], s["backed_up_bytes"])
            f["ev"].add_metric([name, "device", "host_copy"], c["device_evicted_tokens"] - c["written_back_tokens"])
            f["ev"].add_metric([name, "device", "write_back"], c["written_back_tokens"])
            f["ev"].add_metric([name, "device", "dropped"], c["dropped_write_back_tokens"])
            f["ev"].add_metric([name, "host", "duplicate"], c["reclaimed_duplicate_tokens"])
            f["ev"].add_metric([name, "host", "capacity"], c["host_evicted_tokens"])
            f["dw"].add_metric([name], c["dropped_write_back_tokens"])
            f["dr"].add_metric([name], c["reclaimed_duplicate_tokens"])
            f["hu"].add_metric([name], s["host_used"] * s["page_bytes"])
            f["hc"].add_metric([name], s["host_capacity"] * s["page_bytes"])
            f["hp"].add_metric([name], int(s["host_pinned"]))
            f["dh"].add_metric([name, "protected"], s["device_protected"])
            f["dh"].add_metric([name, "evictable"], s["device_evictable"])
            f["dh"].add_metric([name, "failed_load"], s["device_held"] - s["device_evictable"] - s["device_protected"])
            f["dp"].add_metric([name], s["device_pages"])
            for kind, n in s["transfers"].items():
                f["tf"].add_metric([name, kind], n)
            f["pin"].add_metric([name], s["pins"])
            f["lease"].add_metric([name], s["held"].leases)
            f["unacked"].add_metric([name], s["held"].unacked_loads)
            f["lease_age"].add_metric([name], s["held"].oldest_lease_seconds)
            f["unacked_age"].add_metric([name], s["held"].oldest_unacked_seconds)
            f["nodes"].add_metric([name], s["nodes"])
            f["dup"].add_metric([name], s["duplicates"])
        for name, s in snap["namespaces"].items():
            c = s["counters"]
            f["st"].add_metric([name], c["stored_tokens"])
            f["sf"].add_metric([name], c["store_failed_tokens"])
            f["pf"].add_metric([name], c["prefetched_tokens"])
            f["sq"].add_metric([name], s["storage_queued"])
        yield from families.values()
        if snap["storage"] is not None:
            st = snap["storage"]["stats"]
            up = GaugeMetricFamily("radixkv_storage_up", "1 while the storage tier answers reads "
                                   "(lookups, fetches), else 0; for writes see radixkv_storage_failing")
            up.add_metric([], 1 if snap["storage"]["up"] else 0)
            failing = GaugeMetricFamily("radixkv_storage_failing", "1 while storage calls of this direction "
                                        "fail (a full store fails writes and serves reads), else 0",
                                        labels=["direction"])
            for direction, on in snap["storage"]["failing"].items():
                failing.add_metric([direction], 1 if on else 0)
            pages = CounterMetricFamily("radixkv_storage_pages", "Storage pages by operation and result",
                                        labels=["operation", "result"])
            pages.add_metric(["get", "hit"], st.gets - st.misses - st.corrupt)
            pages.add_metric(["get", "miss"], st.misses)
            pages.add_metric(["get", "corrupt"], st.corrupt)
            pages.add_metric(["put", "stored"], st.puts)
            pages.add_metric(["put", "already_present"], st.put_skipped)
            pages.add_metric(["evict", "removed"], st.evicted)
            nbytes = CounterMetricFamily("radixkv_storage_bytes", "Storage payload bytes by direction",
                                         labels=["direction"])
            nbytes.add_metric(["read"], st.get_bytes)
            nbytes.add_metric(["write"], st.put_bytes)
            lost = CounterMetricFamily("radixkv_storage_contents_lost", "Times the store was seen to have "
                                       "lost what it held (a Redis server restarted: a new run_id)")
            lost.add_metric([], snap["storage"]["contents_lost"])
            full = CounterMetricFamily("radixkv_storage_full_refusals", "Store calls a full store refused "
                                       "(a Mooncake pool at capacity): no outage, their pages stay on host")
            full.add_metric([], snap["storage"]["full_refusals"])
            yield from (up, failing, pages, nbytes, lost, full)
        if snap["events"] is not None:
            yield from _event_families(snap["events"])


# EventHub.stats() key -> (metric, help); docs/events.md lists them.
_EVENT_COUNTERS = {
    "published": ("radixkv_kv_event_batches_published", "KV event batches published (ZMQ and WatchEvents)"),
    "dropped": ("radixkv_kv_event_batches_dropped", "KV event batches dropped for want of queue room "
                "(each followed by a resync of its namespace)"),
    "send_errors": ("radixkv_kv_event_send_errors", "KV event batches a ZMQ socket refused"),
    "replays": ("radixkv_kv_event_replays", "ZMQ replay requests answered"),
    "build_errors": ("radixkv_kv_event_build_errors", "KV event batches that failed to build (each followed "
                     "by a resync of its namespace)"),
    "lagged_subscribers": ("radixkv_kv_event_subscribers_lagged", "WatchEvents streams cut off for "
                           "falling behind"),
}
_EVENT_GAUGES = {
    "queue_depth": ("radixkv_kv_event_queue_depth", "KV event batches waiting for the publisher thread"),
    "subscribers": ("radixkv_kv_event_watchers", "WatchEvents streams open"),
}


def _event_families(stats: dict):
    for table, family in ((_EVENT_COUNTERS, CounterMetricFamily), (_EVENT_GAUGES, GaugeMetricFamily)):
        for key, (name, help_text) in table.items():
            yield family(name, help_text, value=stats[key])
