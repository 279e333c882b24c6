"""Section `node`: one real daemon carrying a node's engines (#15 point 4).

N engines (1, 2, 4, 8) each register their own namespace (shared-memory buffers, tiny
pages so copies cost next to nothing, write-through) and run a scheduler loop paced at
50 steps per second: every step is one batched Match of 4 prompts (2k tokens each,
drawn from 3x what the device holds, so prompts hit the device, hit the host or miss),
a LoadBack of the first host hit and its ack on the session's Acks stream, an Insert of
the first miss, and an Evict when the engine is short of free pages. The engines are
asyncio tasks in ONE bench process (one grpc.aio channel each, raw generated stubs, no
client library): on a 2-core machine 8 engine processes would measure the scheduler,
not the daemon. Steps start on a fixed 20 ms grid and never catch up in bursts: an
engine that falls behind runs its steps back to back.

Figures: sustained steps/s against the offered 50 x N, and Match p99 (engine-side,
request sent to answer read) against the 2 ms target; the daemon's and the engines'
CPU (utime+stime over the window, in cores) show which side saturates. A last window
runs the largest count unpaced (steps back to back). The daemon's CPU per step (its
CPU over the window / steps done) is the capacity figure that scheduling noise does not
move: one core / CPU per step is how many steps/s one daemon process carries with a core
of its own. The largest count runs again over the Session stream (`stream` rows).
"""

import asyncio
import os
import random
import time

import grpc
import numpy as np

from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pbg
from radixkv_server.core.pages import pack, unpack

from .daemon import DaemonProcess, channel, register
from .figures import Figure, Section, Table, fmt
from .machine import pin_threads
from .timing import median, percentile, progress

PAGE = 16
PROMPT_PAGES = 128
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=PAGE)
STEPS_PER_S = 50
BATCH = 4
DEVICE_PROMPTS = 16    # device pages per engine: this many whole prompts
UNIVERSE = 48          # distinct prompts per engine (3x the device)
ENGINES = {"tiny": (1, 2), "quick": (1, 2, 4, 8), "full": (1, 2, 4, 8)}
SECONDS = {"tiny": 1.0, "quick": 8.0, "full": 20.0}  # measured window per engine count
WARM_S = 1.0           # paced steps before the window (connections, caches, steady mix)
REPEATS = {"tiny": 1, "quick": 2, "full": 3}         # windows per engine count (median)
TARGET_P99_MS = 2.0
RPC_TIMEOUT_S = 30.0


class Engine:
    """One engine: its namespace and session, free device pages, prompts, ack stream."""

    def __init__(self, target: str, index: int, seed: int, stream: bool = False):
        self.index = index
        self.stream = stream  # calls as messages on the session's Session stream, else unary
        self.num_pages = DEVICE_PROMPTS * PROMPT_PAGES
        self.buffers = ShmKvBuffers.create(LAYOUT, self.num_pages)
        with channel(target) as ch:
            reg = register(pbg.RadixKVStub(ch), f"node/e{index}", LAYOUT, self.buffers, self.num_pages,
                           write_policy="write_through", host_pool_pages=UNIVERSE * PROMPT_PAGES * 2)
        self.session = reg.session
        self.target = target
        rng = np.random.default_rng(seed)
        self.prompts = [rng.integers(1, 1 << 30, size=PROMPT_PAGES * PAGE, dtype=np.int32).tobytes()
                        for _ in range(UNIVERSE)]
        self.free = list(range(self.num_pages))
        self.rng = random.Random(seed)
        self.match_s: list[float] = []
        self.step_s: list[float] = []
        self.steps = 0
        self.skipped = 0  # inserts or load-backs given up for want of pages
        self.stub = None
        self._acks: dict[int, asyncio.Future] = {}
        self._ack_q: asyncio.Queue | None = None
        self._ack_call = None
        self._ack_reader = None
        self._session_call = None
        self._ids = 0

    async def call(self, field: str, request):
        """One engine call: unary, or a message on the Session stream (one in flight)."""
        if not self.stream:
            method = {"match": "Match", "load_back": "LoadBack", "insert": "Insert", "evict": "Evict"}[field]
            return await getattr(self.stub, method)(request, timeout=RPC_TIMEOUT_S)
        self._ids += 1
        await self._session_call.write(pb.SessionRequest(id=self._ids, **{field: request}))
        resp = await self._session_call.read()  # plain, as CallStream reads: `_deadline` bounds the phase
        if resp is grpc.aio.EOF or resp.WhichOneof("result") != field:
            raise RuntimeError(f"engine {self.index}: {field} on the Session stream: {resp}")
        return getattr(resp, field)

    async def open(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.target, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pbg.RadixKVStub(self.channel)
        self._ack_q = asyncio.Queue()
        self._ack_call = self.stub.Acks(self._ack_requests())
        self._ack_reader = asyncio.get_running_loop().create_task(self._read_acks())
        if self.stream:
            self._session_call = self.stub.Session()

    async def _ack_requests(self):
        yield pb.AckRequest(session=self.session, transfer=0)
        while (t := await self._ack_q.get()) is not None:
            yield pb.AckRequest(transfer=t)

    async def _read_acks(self) -> None:
        async for resp in self._ack_call:
            fut = self._acks.pop(resp.transfer, None)
            if fut is not None and not fut.done():
                fut.set_result(resp)

    async def ack(self, transfer: int) -> pb.AckResponse:
        fut = asyncio.get_running_loop().create_future()
        self._acks[transfer] = fut
        self._ack_q.put_nowait(transfer)
        return await asyncio.wait_for(fut, RPC_TIMEOUT_S)

    async def pages(self, n: int) -> bytes | None:
        """`n` free device pages, evicting from the daemon when short; None if it cannot."""
        if len(self.free) < n:
            ev = await self.call("evict", pb.EvictRequest(session=self.session,
                                                          num_pages=n - len(self.free) + PROMPT_PAGES))
            self.free += unpack(ev.freed_pages).tolist()
        if len(self.free) < n:
            return None
        out = self.free[-n:]
        del self.free[-n:]
        return pack(out)

    async def step(self, record: bool) -> None:
        """One scheduler step: batched Match, LoadBack + ack of a host hit, Insert of a miss."""
        t0 = time.perf_counter()
        picks = self.rng.sample(range(UNIVERSE), BATCH)
        req = pb.MatchRequest(session=self.session, prompts=[pb.Prompt(tokens=self.prompts[i]) for i in picks])
        results = (await self.call("match", req)).results
        t1 = time.perf_counter()
        full = PROMPT_PAGES * PAGE
        host = next((r for r in results if r.host_tokens), None)
        if host is not None:
            pages = await self.pages(host.host_tokens // PAGE)
            if pages is None:
                self.skipped += 1
            else:
                lb = await self.call("load_back", pb.LoadBackRequest(session=self.session, node=host.host_node,
                                                                     device_pages=pages))
                self.free += unpack(lb.unused_pages).tolist()
                if lb.transfer:
                    a = await self.ack(lb.transfer)
                    if a.code or a.load_failed:
                        raise RuntimeError(f"engine {self.index}: load-back {lb.transfer} failed: {a.message}")
        miss = next(((i, r) for i, r in zip(picks, results)
                     if not r.host_tokens and r.device_tokens < full), None)
        if miss is not None:
            i, r = miss
            new = await self.pages(PROMPT_PAGES - r.device_tokens // PAGE)
            if new is None:
                self.skipped += 1
            else:
                ins = await self.call("insert", pb.InsertRequest(session=self.session, tokens=self.prompts[i],
                                                                 device_pages=r.device_pages + new))
                self.free += unpack(ins.redundant_pages).tolist()
        if record:
            self.match_s.append(t1 - t0)
            self.step_s.append(time.perf_counter() - t0)
            self.steps += 1

    async def run(self, start: float, warm_end: float, end: float, period: float) -> None:
        """Paced steps on a `period` grid from `start` (0: back to back); recorded from
        `warm_end` to `end`."""
        due = start
        while True:
            now = time.perf_counter()
            if now >= end:
                return
            if due > now:
                await asyncio.sleep(due - now)
            await self.step(record=time.perf_counter() >= warm_end)
            due = max(due + period, time.perf_counter() - period)  # behind: no burst to catch up

    async def close(self) -> None:
        if self._ack_q is not None:
            self._ack_q.put_nowait(None)
            try:
                await asyncio.wait_for(self._ack_reader, 10)
            except (asyncio.TimeoutError, grpc.RpcError):
                pass
            if self._session_call is not None:
                await self._session_call.done_writing()
            await self.stub.Close(pb.CloseRequest(session=self.session), timeout=RPC_TIMEOUT_S)
            await self.channel.close()
        self.buffers.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _window(engines: list[Engine], seconds: float, daemon_pid: int, paced: bool = True) -> dict:
    for e in engines:
        e.match_s, e.step_s, e.steps, e.skipped = [], [], 0, 0
    period = 1.0 / STEPS_PER_S if paced else 0.0
    start = time.perf_counter() + 0.05
    warm_end, end = start + WARM_S, start + WARM_S + seconds
    tasks = [asyncio.ensure_future(e.run(start + k * period / len(engines), warm_end, end, period))
             for k, e in enumerate(engines)]
    await asyncio.sleep(max(0.0, warm_end - time.perf_counter()))
    d0, s0, w0 = cpu_seconds(daemon_pid), cpu_seconds(os.getpid()), time.perf_counter()
    await _deadline(asyncio.gather(*tasks), seconds + RPC_TIMEOUT_S)
    d1, s1, w1 = cpu_seconds(daemon_pid), cpu_seconds(os.getpid()), time.perf_counter()
    matches = [x for e in engines for x in e.match_s]
    steps = [x for e in engines for x in e.step_s]
    return {"steps_per_s": sum(e.steps for e in engines) / seconds, "match_p50": percentile(matches, 50),
            "match_p99": percentile(matches, 99), "step_p99": percentile(steps, 99),
            "daemon_cpu": (d1 - d0) / (w1 - w0), "engines_cpu": (s1 - s0) / (w1 - w0),
            "skipped": sum(e.skipped for e in engines)}


async def _fill(engines: list[Engine]) -> None:
    for e in engines:  # every prompt inserted once (the device keeps the newest)
        for _ in range(UNIVERSE // BATCH * 3):
            await e.step(record=False)


async def _deadline(coro, seconds: float):
    """`coro` within `seconds`, else TimeoutError: the one deadline of a phase. The Session
    stream's reads have no timer each (one per read would be a task and a timer handle, work
    the client library's CallStream does not do); unary calls carry gRPC's own deadline."""
    try:
        return await asyncio.wait_for(coro, seconds)
    except asyncio.TimeoutError:
        raise TimeoutError(f"node bench: a phase passed its {seconds:g} s deadline (the daemon stopped answering?)")


async def _measure(target: str, mode: str, daemon_pid: int, profile=None, counts=None, unpaced: bool = True) -> dict:
    """{engines: medians of windows, "unpaced": ...} over unary calls for each of `counts`
    (default: the mode's), then the same for the largest count over the Session stream as
    "stream" and "stream unpaced"."""
    out = {}
    counts = counts or ENGINES[mode]
    top = max(counts)
    for n, stream in [(n, False) for n in counts] + [(top, True)]:
        how = "Session stream" if stream else "unary"
        progress(f"node: {n} engine(s) at {STEPS_PER_S} steps/s, {how}, {REPEATS[mode]} x {SECONDS[mode]:g} s")
        engines = [Engine(target, 100 * n + i + 1000 * stream, seed=100 * n + i, stream=stream) for i in range(n)]
        try:
            for e in engines:
                await e.open()
            await _deadline(_fill(engines), RPC_TIMEOUT_S)
            runs = [await _window(engines, SECONDS[mode], daemon_pid) for _ in range(REPEATS[mode])]
            out["stream" if stream else n] = {k: median(r[k] for r in runs) for k in runs[0]}
            if n == top and unpaced:
                progress(f"node: {n} engines unpaced (steps back to back), {how}: what one daemon carries")
                free = [await _window(engines, SECONDS[mode], daemon_pid, paced=False) for _ in range(REPEATS[mode])]
                out["stream unpaced" if stream else "unpaced"] = {k: median(r[k] for r in free) for k in free[0]}
                if profile is not None and not stream:
                    await profile(engines)
        finally:
            for e in engines:
                await e.close()
    return out


def run(mode: str, plot_dir=None, profiler=None) -> Section:
    sec = Section("node", "Node load (one daemon, N engines at 50 steps/s)",
                  intro=__doc__.split("\n\n", 1)[1].replace("\n", " "))
    with DaemonProcess("--host-pool-size", "1GiB") as d:
        progress(f"node: daemon pid {d.pid} on {d.unix}")
        profile = None
        if profiler is not None:
            async def profile(engines):
                loop = asyncio.get_running_loop()
                task = asyncio.ensure_future(_window(engines, profiler.seconds + 2.0, d.pid))
                await loop.run_in_executor(None, profiler.record, "node.daemon", d.pid, lambda: time.sleep(0.05),
                                           f"daemon under {len(engines)} engines at {STEPS_PER_S} steps/s")
                await task
        results = _run_loop(_measure(d.unix, mode, d.pid, profile))
        _check(d)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        results["own core"] = _own_core(mode, cores)
    _report(sec, results)
    sec.notes.append(
        "Engine-side latencies include the engines' own process: its event loop and its wake-ups "
        "compete for the same cores as the daemon and its copy threads (and, on a shared machine, "
        "everyone else's processes), so a p99 far above the p50 while the daemon's CPU stays below one "
        "core is scheduling delay, not the daemon's work. The unpaced window shows where the daemon's "
        "one event loop saturates: its CPU approaches one core (the tree and the gRPC server share "
        "that loop; copy threads add a little), unless the engines' round trips, each waiting for a "
        "core, bound the rate first.")
    return sec


def _run_loop(coro):
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _check(d: DaemonProcess) -> None:
    with channel(d.unix) as ch:
        bad = pbg.RadixKVStub(ch).CheckInvariants(pb.CheckInvariantsRequest()).violations
    if bad:
        raise RuntimeError(f"daemon invariants broken during node bench: {[v.message for v in bad][:3]}")


def _own_core(mode: str, cores: list[int]) -> dict:
    """The largest count again (unary, then the Session stream; paced windows) with a fresh
    daemon on a core of its own and this process's threads (the engines) on the others:
    a node where engines do not share the daemon's core, as a real one's schedulers do."""
    top = max(ENGINES[mode])
    before = os.sched_getaffinity(0)
    progress(f"node: daemon on core {cores[0]}, engines on {cores[1:]}")
    with DaemonProcess("--host-pool-size", "1GiB", cpus={cores[0]}) as d:
        pin_threads(set(cores[1:]))
        try:
            out = _run_loop(_measure(d.unix, mode, d.pid, counts=(top,), unpaced=False))
        finally:
            pin_threads(before)
        _check(d)
    return {"unary": out[top], "stream": out["stream"]}


def _report(sec: Section, results: dict) -> None:
    results = dict(results)
    own = results.pop("own core", None)
    counts = [k for k in results if isinstance(k, int)]
    top, low = max(counts), min(counts)
    labels = {n: (str(n), STEPS_PER_S * n) for n in counts}
    labels.update({"unpaced": (f"{top}, back to back", "unpaced"), "stream": (f"{top}, Session stream", STEPS_PER_S * top),
                   "stream unpaced": (f"{top}, Session stream, back to back", "unpaced")})
    rows = []
    for key, r in results.items():
        name, offered = labels[key]
        rows.append([name, f"{fmt(r['steps_per_s'])} / {offered}", f"{fmt(r['match_p50'] * 1e3)} ms",
                     f"{fmt(r['match_p99'] * 1e3)} ms", f"{fmt(r['step_p99'] * 1e3)} ms",
                     f"{fmt(r['daemon_cpu'])}", f"{fmt(r['engines_cpu'])}", int(r["skipped"])])
    for how, r in (own or {}).items():
        rows.append([f"{top}, {how}, daemon on a core of its own", f"{fmt(r['steps_per_s'])} / {STEPS_PER_S * top}",
                     f"{fmt(r['match_p50'] * 1e3)} ms", f"{fmt(r['match_p99'] * 1e3)} ms",
                     f"{fmt(r['step_p99'] * 1e3)} ms", f"{fmt(r['daemon_cpu'])}", f"{fmt(r['engines_cpu'])}",
                     int(r["skipped"])])
    sec.tables.append(Table(f"Engines x {STEPS_PER_S} steps/s on one daemon (medians of windows)",
                            ["engines", "steps/s sustained / offered", "Match p50", "Match p99", "step p99",
                             "daemon CPU (cores)", "engines' process CPU (cores)", "inserts/loads skipped"], rows))
    r, base = results[top], results[low]
    met = r["match_p99"] * 1e3 < TARGET_P99_MS and r["steps_per_s"] >= 0.95 * STEPS_PER_S * top
    sec.add(Figure(f"node.match.p99@{top}", r["match_p99"] * 1e3, "ms", f"match_p50@{low}", base["match_p50"] * 1e3,
                   f"Match p99 < {TARGET_P99_MS:g} ms with {top} engines sustaining >= 95% of {STEPS_PER_S} "
                   "steps/s each (unary)", met))
    sec.add(Figure(f"node.steps_per_s@{top}", r["steps_per_s"], "steps/s", "offered", STEPS_PER_S * top))
    for n in counts:
        if n != top:
            sec.add(Figure(f"node.match.p99@{n}", results[n]["match_p99"] * 1e3, "ms", f"match_p50@{low}",
                           base["match_p50"] * 1e3))
    sec.add(Figure(f"node.daemon_cpu@{top}", r["daemon_cpu"] * 100, "%", "one_core", 100.0))
    free = results["unpaced"]
    sec.add(Figure(f"node.unpaced_steps_per_s@{top}", free["steps_per_s"], "steps/s", "offered", STEPS_PER_S * top))
    sec.add(Figure(f"node.unpaced_daemon_cpu@{top}", free["daemon_cpu"] * 100, "%", "one_core", 100.0))
    st, st_free = results["stream"], results["stream unpaced"]
    per_step = {k: results[k]["daemon_cpu"] / results[k]["steps_per_s"] * 1e3 for k in (top, "stream")}
    sec.add(Figure(f"node.daemon_cpu_per_step@{top}", per_step[top], "ms", "step_period", 1e3 / STEPS_PER_S))
    sec.add(Figure(f"node.stream.daemon_cpu_per_step@{top}", per_step["stream"], "ms", "unary", per_step[top]))
    sec.add(Figure(f"node.one_core_steps_per_s@{top}", 1e3 / per_step[top], "steps/s", "target",
                   STEPS_PER_S * top))
    sec.add(Figure(f"node.stream.one_core_steps_per_s@{top}", 1e3 / per_step["stream"], "steps/s", "target",
                   STEPS_PER_S * top))
    met_st = st["match_p99"] * 1e3 < TARGET_P99_MS and st["steps_per_s"] >= 0.95 * STEPS_PER_S * top
    sec.add(Figure(f"node.stream.match.p99@{top}", st["match_p99"] * 1e3, "ms", "unary", r["match_p99"] * 1e3,
                   f"Match p99 < {TARGET_P99_MS:g} ms with {top} engines sustaining >= 95% of {STEPS_PER_S} "
                   "steps/s each (Session stream)", met_st))
    sec.add(Figure(f"node.stream.match.p50@{top}", st["match_p50"] * 1e3, "ms", "unary", r["match_p50"] * 1e3))
    sec.add(Figure(f"node.stream.unpaced_steps_per_s@{top}", st_free["steps_per_s"], "steps/s", "unary",
                   free["steps_per_s"]))
    if own is not None:
        _report_own_core(sec, own, results, top)


def _report_own_core(sec: Section, own: dict, shared: dict, top: int) -> None:
    for how, prefix, r, base in (("unary", "node.own_core", own["unary"], shared[top]),
                                 ("Session stream", "node.own_core.stream", own["stream"], shared["stream"])):
        met = r["match_p99"] * 1e3 < TARGET_P99_MS and r["steps_per_s"] >= 0.95 * STEPS_PER_S * top
        sec.add(Figure(f"{prefix}.match.p99@{top}", r["match_p99"] * 1e3, "ms", "shared_cores",
                       base["match_p99"] * 1e3,
                       f"Match p99 < {TARGET_P99_MS:g} ms with {top} engines sustaining >= 95% of {STEPS_PER_S} "
                       f"steps/s each ({how}, the daemon on a core of its own)", met))
