"""Section `workload`: simulated engines (`radixkv.sim.Engine` over the blocking client)
against a real daemon whose device pool is far smaller than the working set.

multiturn: N chats of R rounds, each round appending a user turn and an answer to the
conversation (SGLang's bench_multiturn shape), Poisson think time between rounds.
shared_prefix: requests that start with one of a few long system prompts (Poisson
arrivals). Every config runs the same seeded requests; the engine verifies every byte it
reads from the cache. "saved" = prompt tokens served from the cache (device + host +
storage) / prompt tokens, i.e. prefill avoided. Baselines: no cache (0 saved) and a
device-only cache (host pool of 1 page).
"""

import shutil
import tempfile
from dataclasses import dataclass

import torch

from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.sim import Engine, MultiTurn, SharedPrefix
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pbg

from .daemon import DaemonProcess, channel
from .figures import Figure, Section, Table, fmt
from .timing import progress

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=16)  # 4 KiB pages
POLICIES = ("write_through", "write_through_selective", "write_back")
TARGET_POINTS = 30.0
SCALE = {  # mode -> (multiturn clients, rounds, shared_prefix requests)
    "tiny": (4, 3, 24),
    "quick": (32, 10, 320),
    "full": (64, 16, 1000),
}
DEVICE_PAGES = {"tiny": 256, "quick": 768, "full": 1536}
HOST_PAGES = 16384
STORAGE_HOST_PAGES = {"tiny": 128, "quick": 2048, "full": 2048}  # >= one batch of requests


def multiturn(mode: str, seed: int = 7) -> MultiTurn:
    clients, rounds, _ = SCALE[mode]
    return MultiTurn(clients * rounds, seed, clients=clients, rounds=rounds, system_tokens=256,
                     turn_tokens=(64, 256), answer_tokens=(32, 128), max_context=4096, rate=0.5)


def shared_prefix(mode: str, seed: int = 7) -> SharedPrefix:
    return SharedPrefix(SCALE[mode][2], seed, groups=8, system_tokens=1024, suffix_tokens=(64, 256),
                        answer_tokens=(32, 128), rate=2.0)


WORKLOADS = {"multiturn": multiturn, "shared_prefix": shared_prefix}


class PrefetchingEngine(Engine):
    """The sim engine, plus a Prefetch (wait_complete) of each prompt before its step, so
    pages only storage holds come to host first; counts the tokens loaded that came from
    storage (`storage_tokens`; they are part of the report's host tokens)."""

    def __init__(self, *args, stub, session: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._stub = stub
        self._session = session
        self._fetched: dict[int, int] = {}
        self.storage_tokens = 0

    def step(self, batch, workload, now):
        probe = self._stub.Match(pb.MatchRequest(session=self._session, include_storage=True,
                                                 prompts=[pb.Prompt(tokens=r.prompt, extra_key=r.extra_key)
                                                          for r in batch]))
        for r, m in zip(batch, probe.results):
            if not m.storage_tokens:
                continue
            for p in self._stub.Prefetch(pb.PrefetchRequest(session=self._session, tokens=r.prompt,
                                                            extra_key=r.extra_key, policy="wait_complete")):
                if p.state == pb.PrefetchProgress.DONE:
                    self._fetched[r.rid] = self._fetched.get(r.rid, 0) + p.host_tokens_added
        return super().step(batch, workload, now)

    def _finish(self, plan, outcomes):
        done = super()._finish(plan, outcomes)
        if done and all(outcomes[t].ok for t in plan.deps):
            self.storage_tokens += min(self._fetched.pop(plan.request.rid, 0), plan.loaded_tokens)
        return done


@dataclass
class Outcome:
    name: str
    prompt: int
    device: int
    host: int
    storage: int
    computed: int
    mismatches: int
    verified_bytes: int
    seconds: float
    ok: bool
    problems: list
    counters: dict

    def pct(self, x: int) -> float:
        return 100.0 * x / self.prompt if self.prompt else 0.0

    @property
    def saved(self) -> float:
        """Prompt tokens not recomputed: served from device, host, or (through a
        prefetch) storage. `host` excludes the storage ones, so they add up."""
        return self.pct(self.device + self.host + self.storage)


def run_engine(target: str, namespace: str, workload, mode: str, write_policy: str, host_pages: int,
               prefetch: bool = False) -> Outcome:
    buffers = ShmKvBuffers.create(LAYOUT, DEVICE_PAGES[mode])
    engine = None
    try:
        with Client(target) as client:
            client.wait_ready(30)
            reg = client.register(namespace, LAYOUT, buffers.specs(), DEVICE_PAGES[mode], write_policy=write_policy,
                                  host_pool_pages=host_pages, engine="radixkv bench")
            views = [buffers.buffer(i) for i in range(LAYOUT.num_buffers)]
            if prefetch:
                engine = PrefetchingEngine(client, LAYOUT, views, DEVICE_PAGES[mode], max_batch=8,
                                           stub=pbg.RadixKVStub(channel(target)), session=reg.session)
            else:
                engine = Engine(client, LAYOUT, views, DEVICE_PAGES[mode], max_batch=8)
            rep = engine.run(workload)
            engine.check_daemon(namespace)
            counters = dict(client.stats(namespace).namespaces[0].counters)
            storage = getattr(engine, "storage_tokens", 0)
            served = rep.device_tokens + rep.host_tokens
            return Outcome(namespace, rep.prompt_tokens, rep.device_tokens, rep.host_tokens - storage, storage,
                           rep.computed_tokens, rep.byte_mismatches,
                           served * LAYOUT.page_bytes // LAYOUT.page_size, rep.seconds, rep.ok,
                           rep.messages[:3] + rep.violations[:3], counters)
    finally:
        engine = None
        buffers.close()


def run(mode: str, plot_dir=None, profiler=None) -> Section:
    sec = Section("workload", "Workload (simulated engines, real daemon)",
                  intro=__doc__.split("\n\n", 1)[1].replace("\n", " "))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the sim's KV work is tiny; as radixkv-sim does
    results: dict[str, dict[str, Outcome]] = {}
    try:
        with DaemonProcess("--host-pool-size", "256MiB") as d:
            for wname, make in WORKLOADS.items():
                results[wname] = {}
                configs = [("device-only", "write_through", 1)] + [(p, p, HOST_PAGES) for p in POLICIES]
                for label, policy, host in configs:
                    progress(f"workload: {wname} / {label}")
                    results[wname][label] = run_engine(d.unix, f"{wname}-{label}", make(mode), mode, policy, host)
            progress("workload: multiturn with a small host pool, without storage")
            results["multiturn"]["small-host"] = run_engine(
                d.unix, "multiturn-small-host", multiturn(mode), mode, "write_through", STORAGE_HOST_PAGES[mode],
                prefetch=False)
        for policy in ("write_back", "write_through"):
            store = tempfile.mkdtemp(prefix="rkv-bench-store-")
            try:
                with DaemonProcess("--host-pool-size", "256MiB", "--storage", f"file://{store}",
                                   "--storage-policy", policy) as d:
                    progress(f"workload: multiturn, small host pool, --storage file:// (storage policy {policy})")
                    results["multiturn"][f"small-host+storage-{policy}"] = run_engine(
                        d.unix, "multiturn-storage", multiturn(mode), mode, "write_through", STORAGE_HOST_PAGES[mode],
                        prefetch=True)
            finally:
                shutil.rmtree(store, ignore_errors=True)
    finally:
        torch.set_num_threads(threads)
    _report(sec, results, mode)
    if plot_dir is not None:
        _plot(sec, results, plot_dir)
    return sec


def _report(sec: Section, results, mode: str) -> None:
    for wname, rs in results.items():
        base = rs["device-only"]
        for p in POLICIES:
            o = rs[p]
            target, met = "", None
            if wname == "multiturn":
                target = f"host tier adds >= {TARGET_POINTS:g} points over device-only"
                met = o.saved - base.saved >= TARGET_POINTS
            sec.add(Figure(f"workload.{wname}.{p}.saved", o.saved, "%", "device-only", base.saved, target, met))
    mt = results["multiturn"]
    for policy in ("write_back", "write_through"):
        sec.add(Figure(f"workload.multiturn.storage_{policy}.saved", mt[f"small-host+storage-{policy}"].saved, "%",
                       "small-host", mt["small-host"].saved))
    lost = lambda o: o.counters.get("skipped_backup_tokens", 0) + o.counters.get("dropped_write_back_tokens", 0)
    wb, wt, small = mt["small-host+storage-write_back"], mt["small-host+storage-write_through"], mt["small-host"]
    verdict = "raises" if min(wb.saved, wt.saved) >= small.saved else "lowers"
    sec.notes.append(
        f"**The storage tier {verdict} the prefill saved** on the small host pool: {fmt(wb.saved)} % with storage "
        f"policy write_back and {fmt(wt.saved)} % with write_through, vs {fmt(small.saved)} % without storage; "
        f"{fmt(wb.storage)} (write_back) and {fmt(wt.storage)} (write_through) prompt tokens came back from "
        f"storage through a prefetch. Backups and write-back evictions lost for want of a free host page: "
        f"{fmt(lost(wb))} and {fmt(lost(wt))} tokens with storage, {fmt(lost(small))} without (a host leaf "
        "not yet in storage frees its pages only when its store completes; `evict_host` frees leaves storage "
        "already holds first). Prefetching a whole batch before its step also fills the small host pool with "
        "pages that push out others before they are loaded back.")
    everything = [o for rs in results.values() for o in rs.values()]
    bad = sum(o.mismatches for o in everything)
    sec.add(Figure("workload.byte_mismatches", bad, "bytes", "verified", sum(o.verified_bytes for o in everything),
                   "0 byte mismatches", bad == 0))
    for wname, rs in results.items():
        rows = [["no cache", "-", "0", "0", "0", "100", "0", "-", "-", "-", "-", "-"]]
        for label, o in rs.items():
            c = o.counters
            rows.append([label, fmt(o.prompt), fmt(o.pct(o.device)), fmt(o.pct(o.host)), fmt(o.pct(o.storage)),
                         fmt(100 - o.saved), fmt(o.saved), o.mismatches,
                         fmt(c.get("backed_up_tokens", 0) + c.get("written_back_tokens", 0)),
                         fmt(c.get("skipped_backup_tokens", 0) + c.get("dropped_write_back_tokens", 0)),
                         fmt(c.get("stored_tokens", 0)), f"{o.seconds:.1f}"])
        clients, rounds, n = SCALE[mode]
        shape = (f"{clients} chats x {rounds} rounds" if wname == "multiturn" else f"{n} requests, 8 system prompts")
        sec.tables.append(Table(
            f"{wname}: % of prompt tokens by where they came from ({shape}; device pool {DEVICE_PAGES[mode]} pages, "
            f"host pool {HOST_PAGES} pages, small host {STORAGE_HOST_PAGES[mode]} pages)",
            ["config", "prompt tokens", "device %", "host %", "storage %", "recomputed %", "saved %",
             "byte mismatches", "tokens copied to host", "tokens lost for want of host room", "tokens stored",
             "seconds"], rows,
            "From the daemon's counters: tokens copied to host = write-through backups + write-back evictions "
            "(the policies differ in copy traffic more than in hits); lost = backups skipped + write-back "
            "evictions dropped because no host page could be had at that moment."))
        problems = [f"{label}: {p}" for label, o in rs.items() for p in o.problems if not o.ok]
        if problems:
            sec.notes.append("Problems the simulator reported:\n\n" + "\n".join(f"- {p}" for p in problems))


def _plot(sec: Section, results, plot_dir) -> None:
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(12, 4), sharey=True)
    for ax, (wname, rs) in zip(axes, results.items()):
        labels = list(rs)
        bottom = [0.0] * len(labels)
        for part, color in (("device", "tab:green"), ("host", "tab:blue"), ("storage", "tab:purple")):
            vals = [rs[k].pct(getattr(rs[k], part)) for k in labels]
            ax.bar(labels, vals, bottom=bottom, label=part, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.bar(labels, [100 - b for b in bottom], bottom=bottom, label="recomputed", color="lightgrey")
        ax.set_title(wname)
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    axes[0].set_ylabel("% of prompt tokens")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_dir / "workload_tiers.png", dpi=110)
    plt.close(fig)
    sec.plots.append(("workload_tiers.png", "Where prompt tokens came from, per config"))
