"""vLLM with radixkv: real vLLM (CPU build), the tiny random Llama, a real daemon. Time to
first token (a generate with max_tokens=1) on one 2k-token prompt for: recompute (no
cache), a hit in vLLM's own prefix cache (the baseline), a radixkv host hit (vLLM's prefix
cache reset before each request, so the prefix comes from the daemon's host tier), the
same hit with `async_loads` (vLLM parks the request while the daemon copies), a radixkv
storage hit (two prompts in turn through a host tier that holds one, with file
storage written through: each request's prefix comes from the page files, staged to host
by the scheduler's lookup) and vLLM's ExampleConnector (safetensors files on disk, prefix
cache reset likewise). The prefix hit, ExampleConnector and the radixkv host hit run again
with the daemon on a core of its own and vLLM on the others (a sidecar's deployment: on
shared cores the daemon's copy and vLLM's OpenMP threads take turns on the same two). Also
the time vLLM's scheduler spends inside radixkv's scheduler-side connector methods per step,
measured in a case of its own by a subclass of the connector that times them (every TTFT
figure is the connector itself, not instrumented).

The engines run one after another in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
vLLM's engine core, scheduler and worker live here, so the timing subclass is read
directly). The model is tiny (2 layers, 2 KV heads of 64, float32: 2 KiB of KV per token),
so the figures compare the connectors' fixed costs more than copy bandwidth.
"""

import contextlib
import os
import tempfile
import time

from radixkv.vllm.testing import VOCAB, apply_cpu_env, engine_args, reset_prefix_cache, write_tiny_llama

from .daemon import DaemonProcess
from .figures import Figure, Section, Table, fmt
from .machine import pin_threads
from .timing import median, percentile, progress

PROMPT_TOKENS = {"tiny": 512, "quick": 2048, "full": 2048}
ROUNDS = {"tiny": 2, "quick": 24, "full": 60}  # timed requests per case, over all passes
PASSES = {"tiny": 1, "quick": 3, "full": 5}  # engines started per case
BLOCK = 128
TTFT_RATIO_TARGET = 1.5  # radixkv host hit within 1.5x of vLLM's own prefix-cache hit
OWN_CORE_CASES = ("vllm_prefix_hit", "example_connector", "radixkv_host_hit")
TIMED_CASE = "radixkv_host_hit_timed"  # the timing subclass: scheduler figures and profile only
BLOCKED_P50_TARGET_US = 100.0
TIMED = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished")
# Worker-side methods timed for the hit path's profile (per call, seconds).
WORKER_TIMED = ("start_load_kv", "wait_for_save", "get_finished")

# Filled by TimedRadixKVConnector (scheduler role): seconds spent in radixkv per step, and
# per step whether it scheduled tokens (a forward other requests wait for).
STEP_BLOCKED: list[float] = []
STEP_BUSY: list[bool] = []
_current = [0.0]
# Per call of the worker methods, and per request: seconds from the first lookup ask to
# the answer, and the scheduler steps in between.
WORKER_CALLS: dict[str, list[float]] = {n: [] for n in WORKER_TIMED}
SCHEDULER_CALLS: dict[str, list[float]] = {n: [] for n in TIMED}
LOOKUP_WAIT: list[tuple[float, int]] = []
_asked: dict[str, tuple[float, int]] = {}
_steps = [0]
# Only steps and calls of the timed requests count (not the warm-up request, nor the steps
# that `reset_prefix_cache` runs while saves are still being acknowledged).
_recording = [False]


def _timed(name: str, inner):
    def method(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            result = inner(self, *args, **kwargs)
        finally:
            _current[0] += time.perf_counter() - t
            if _recording[0]:
                SCHEDULER_CALLS[name].append(time.perf_counter() - t)
            if name == "build_connector_meta":  # once per scheduler step: close the step
                if _recording[0]:
                    STEP_BLOCKED.append(_current[0])
                    STEP_BUSY.append(bool(args[0].total_num_scheduled_tokens))
                _current[0] = 0.0
                _steps[0] += 1
        if name == "get_num_new_matched_tokens" and _recording[0]:
            req_id = args[0].request_id
            if result[0] is None:
                _asked.setdefault(req_id, (t, _steps[0]))
            elif req_id in _asked:
                t0, s0 = _asked.pop(req_id)
                LOOKUP_WAIT.append((time.perf_counter() - t0, _steps[0] - s0))
        return result
    method.__name__ = name
    return method


def _timed_worker(name: str, inner):
    """Times calls with work in them: loads for start_load_kv, saves for wait_for_save."""
    field = {"start_load_kv": "loads", "wait_for_save": "saves"}.get(name)

    def method(self, *args, **kwargs):
        meta = self._meta()
        busy = field is None or (meta is not None and bool(getattr(meta, field)))
        t = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            if busy and _recording[0]:
                WORKER_CALLS[name].append(time.perf_counter() - t)
    method.__name__ = name
    return method


def _timed_class():
    from radixkv.vllm import RadixKVConnector
    methods = {n: _timed(n, getattr(RadixKVConnector, n)) for n in TIMED}
    methods.update({n: _timed_worker(n, getattr(RadixKVConnector, n)) for n in WORKER_TIMED})
    return type("TimedRadixKVConnector", (RadixKVConnector,), methods)


def __getattr__(name: str):
    """vLLM loads `TimedRadixKVConnector` from this module by name (lazily: vLLM is only
    imported when the section runs)."""
    if name == "TimedRadixKVConnector":
        cls = _timed_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _prompt(n: int, seed: int = 12) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    """Seconds of one greedy generate of one token, and the prompt tokens vLLM reported cached."""
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1)
    t = time.perf_counter()
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - t, out.num_cached_tokens or 0


def _measure(model: str, kv_transfer_config: dict | None, prompts: list[list[int]], rounds: int,
             reset: bool, want: int, case: str) -> list[float]:
    """Start an engine, run each of `prompts` once to fill the caches, then `rounds` timed
    requests, the prompts in turn (each after `reset_prefix_cache()` when `reset`). Returns
    the times. Raises unless vLLM reports `want` cached tokens on every timed request: the
    radixkv cases recompute what a load failed to bring (kv_load_failure_policy), and such a
    request would otherwise pass unseen into the case's median."""
    from vllm import LLM
    overrides = {"kv_transfer_config": kv_transfer_config} if kv_transfer_config else {}
    llm = LLM(**engine_args(model, **overrides))
    try:
        for prompt in prompts:
            _ttft(llm, prompt)  # fills vLLM's prefix cache and the connector's store
        times, short = [], []
        for r in range(rounds):
            if reset:
                reset_prefix_cache(llm)
            _recording[0] = True
            try:
                dt, cached = _ttft(llm, prompts[r % len(prompts)])
            finally:
                _recording[0] = False
            times.append(dt)
            if cached != want:
                short.append(cached)
        if short:
            raise RuntimeError(f"vllm {case}: {len(short)} of {rounds} timed requests had "
                               f"{sorted(short)} cached tokens, not {want}")
        return times
    finally:
        llm.llm_engine.engine_core.shutdown()


def run(mode: str, plot_dir=None, profiler=None) -> Section:
    # vLLM logs to stdout by default; the bench's stdout carries only figure lines.
    apply_cpu_env({"VLLM_LOGGING_STREAM": "ext://sys.stderr"})
    sec = Section("vllm", "vLLM (real vLLM CPU build, tiny model, real daemon)",
                  intro=" ".join(__doc__.split("\n\n")[0].split()))
    work = tempfile.mkdtemp(prefix="rkv-bench-vllm-")
    model = write_tiny_llama(f"{work}/model")
    prompt, passes = _prompt(PROMPT_TOKENS[mode]), PASSES[mode]
    other = _prompt(PROMPT_TOKENS[mode], seed=13)
    rounds = ROUNDS[mode] // passes
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": f"{work}/example"}}
    times = {c: [] for c in ("recompute", "vllm_prefix_hit", "example_connector", "radixkv_host_hit",
                             "radixkv_host_hit_async_load", "radixkv_storage_hit", TIMED_CASE)}
    cacheable = (len(prompt) - 1) // BLOCK * BLOCK
    STEP_BLOCKED.clear()
    STEP_BUSY.clear()
    LOOKUP_WAIT.clear()
    for calls in (*WORKER_CALLS.values(), *SCHEDULER_CALLS.values()):
        calls.clear()
    with DaemonProcess("--host-pool-size", "256MiB") as d, \
            DaemonProcess("--host-pool-size", "256MiB", "--storage", f"file://{work}/pages",
                          "--storage-policy", "write_through") as stored:
        plain = {"kv_connector": "RadixKVConnector", "kv_connector_module_path": "radixkv.vllm",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"target": d.unix, "namespace": "bench-tiny"}}
        # The timing subclass runs as a case of its own, for the scheduler and profile figures
        # only: the host hit's TTFT (the target) comes from the connector itself, like its baseline.
        timed = {**plain, "kv_connector": "TimedRadixKVConnector", "kv_connector_module_path": "bench.vllm",
                 "kv_connector_extra_config": {"target": d.unix, "namespace": "bench-timed"}}
        async_load = {**plain, "kv_connector_extra_config": {"target": d.unix, "namespace": "bench-async",
                                                             "async_loads": True}}
        blocks = -(-len(prompt) // BLOCK)  # a host tier of one prompt and a half: each request evicts the other
        from_storage = {**plain, "kv_connector_extra_config": {"target": stored.unix, "namespace": "bench-storage",
                                                               "host_pool_pages": blocks * 3 // 2}}
        cases = {"recompute": (None, True, [prompt]), "vllm_prefix_hit": (None, False, [prompt]),
                 "example_connector": (example, True, [prompt]), "radixkv_host_hit": (plain, True, [prompt]),
                 "radixkv_host_hit_async_load": (async_load, True, [prompt]),
                 "radixkv_storage_hit": (from_storage, True, [prompt, other]), TIMED_CASE: (timed, True, [prompt])}
        for p in range(passes):  # every case in every pass: load changes spread over all cases
            progress(f"vllm: pass {p + 1}/{passes}, {len(prompt)}-token prompt, {rounds} requests per case")
            order = list(cases) if p % 2 == 0 else list(reversed(cases))
            for case in order:
                config, reset, prompts = cases[case]
                want = 0 if case == "recompute" else cacheable  # tokens cached on every request
                times[case] += _measure(model, config, prompts, rounds, reset, want, case)
    own = _own_core(model, prompt, rounds, passes, plain,
                    {**example, "kv_connector_extra_config": {"shared_storage_path": f"{work}/example-own"}})
    timed_ttft = times.pop(TIMED_CASE)
    _report(sec, times, {c: 0 if c == "recompute" else cacheable for c in times}, len(prompt), passes, timed_ttft)
    if own is not None:
        _report_own_core(sec, own, {c: cacheable for c in own}, len(prompt), passes)
    return sec


def _own_core(model: str, prompt: list[int], rounds: int, passes: int, radixkv: dict, example: dict):
    """OWN_CORE_CASES again with a fresh daemon on the first core and this process (vLLM's
    engine, its OpenMP threads and the connector) on the others; None on one core.
    `radixkv`: the connector's config, pointed at that daemon here.
    Returns the times per case (every request checked for a full hit)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    times = {c: [] for c in OWN_CORE_CASES}
    cacheable = (len(prompt) - 1) // BLOCK * BLOCK
    with DaemonProcess("--host-pool-size", "256MiB", cpus={cores[0]}) as d:
        cases = {"vllm_prefix_hit": (None, False), "example_connector": (example, True),
                 "radixkv_host_hit": ({**radixkv, "kv_connector_extra_config": {"target": d.unix,
                                                                               "namespace": "bench-own-core"}}, True)}
        for p in range(passes):
            progress(f"vllm: daemon on core {cores[0]}, vLLM on {cores[1:]}: pass {p + 1}/{passes}")
            for case in (OWN_CORE_CASES if p % 2 == 0 else reversed(OWN_CORE_CASES)):
                config, reset = cases[case]
                with _on_cores(set(cores[1:])):
                    times[case] += _measure(model, config, [prompt], rounds, reset, cacheable, f"own_core.{case}")
    return times


@contextlib.contextmanager
def _on_cores(cpus: set[int]):
    """This process's threads on `cpus`, with as many torch threads, for the block."""
    import torch
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it started
    # (cpu_worker.init_device): set the intra-op pool's size underneath it.
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    pin_threads(cpus)
    torch._C.set_num_threads(len(cpus))
    try:
        yield
    finally:
        pin_threads(before)
        torch._C.set_num_threads(threads)


def _ttft_figures(sec: Section, prefix: str, times: dict, cached: dict, tokens: int, passes: int, title: str,
                  baseline: str = "vllm_prefix_hit") -> float:
    """The TTFT figures and table of one set of cases, against vLLM's prefix hit among
    them; the radixkv host hit's figure carries the target. Returns that baseline (ms)."""
    base = median(times["vllm_prefix_hit"]) * 1e3
    rows = []
    for case, ts in times.items():
        ms = median(ts) * 1e3
        rows.append([case, f"{fmt(min(ts) * 1e3)} ms", f"{fmt(ms)} ms", f"{fmt(percentile(ts, 90) * 1e3)} ms",
                     f"{fmt(min(ts) / min(times['vllm_prefix_hit']))}x", f"{fmt(ms / base)}x",
                     f"{cached[case]} / {tokens}"])
        target, met = "", None
        if case == "radixkv_host_hit":
            target = f"<= {TTFT_RATIO_TARGET:g}x {baseline} and < example_connector"
            met = ms / base <= TTFT_RATIO_TARGET and ms < median(times["example_connector"]) * 1e3
        if case != "vllm_prefix_hit":
            sec.add(Figure(f"{prefix}{case}", ms, "ms", baseline, base, target, met))
    cacheable = (tokens - 1) // BLOCK * BLOCK
    sec.tables.append(Table(
        f"{title}, {tokens}-token prompt (median of {len(times['vllm_prefix_hit'])} requests each, "
        f"{passes} engine starts per case)",
        ["case", "min", "p50", "p90", "min vs vLLM prefix hit", "p50 vs vLLM prefix hit",
         "cached tokens (vLLM, every request)"],
        rows,
        f"A hit can cover {cacheable} tokens (vLLM computes at least the last prompt token); every timed "
        "request of a hit case is checked to have cached that many (recompute: none), and the bench stops "
        "if one did not (a radixkv load that fails is recomputed, and would hide in the median). On a machine "
        "shared with other work the minimum is the least disturbed comparison; the figures use p50."))
    return base


def _report_own_core(sec: Section, times: dict, cached: dict, tokens: int, passes: int) -> None:
    _ttft_figures(sec, "vllm.ttft.own_core.", times, cached, tokens, passes,
                  "Time to first token, the daemon on a core of its own", "own_core.vllm_prefix_hit")
    sec.notes.append(
        "Own core: a fresh daemon pinned to the first core, vLLM's engine (with as many torch threads as "
        "it has cores) and the connector on the others, every case of that table alike. On shared cores "
        "the daemon's copy runs while vLLM prepares the forward and its OpenMP threads spin, and the "
        "forward after a load ran 0.7-1 ms longer than after a prefix hit in traces here.")


def _report(sec: Section, times: dict, cached: dict, tokens: int, passes: int, timed_ttft: list[float]) -> None:
    base = _ttft_figures(sec, "vllm.ttft.", times, cached, tokens, passes, "Time to first token")
    steps = [s * 1e6 for s in STEP_BLOCKED]
    busy = [s for s, b in zip(steps, STEP_BUSY) if b] or [0.0]
    p50, p99 = percentile(steps, 50), percentile(steps, 99)
    sec.add(Figure("vllm.scheduler_blocked.p50", p50, "us", "ttft_vllm_prefix_hit", base * 1e3,
                   f"p50 <= {BLOCKED_P50_TARGET_US:g} us per step", p50 <= BLOCKED_P50_TARGET_US))
    sec.add(Figure("vllm.scheduler_blocked.p99", p99, "us", "ttft_vllm_prefix_hit", base * 1e3))
    sec.notes.append(
        f"Scheduler blocked on radixkv: the {len(steps)} scheduler steps of the radixkv engine's timed "
        "requests (not the steps that empty vLLM's prefix cache between them), the time per "
        f"step spent in the connector's scheduler-side methods ({', '.join(TIMED)}), summed per step "
        f"(a step closes with build_connector_meta): p50 {fmt(p50)} us, p99 {fmt(p99)} us, "
        f"max {fmt(max(steps) if steps else 0)} us. Steps count while a request waits for its lookup "
        f"answer (the scheduler asks again each step; those steps are nearly empty): "
        f"{len(steps) / max(1, len(timed_ttft)):.0f} steps per request here. "
        f"Of them, the {len(busy)} steps that scheduled tokens (a forward other requests wait for): "
        f"p50 {fmt(percentile(busy, 50))} us, p99 {fmt(percentile(busy, 99))} us; the "
        f"{len(steps) - len(busy)} idle ones (nothing to run but the connector's loop passes: the step "
        "that sends a Match writes it, a later one reads the answer) make up the rest. These come from a "
        f"case of their own, {TIMED_CASE}, run by the timing subclass in every pass (its TTFT p50 "
        f"{fmt(median(timed_ttft) * 1e3)} ms, the connector itself {fmt(median(times['radixkv_host_hit']) * 1e3)} "
        "ms); radixkv_host_hit's figure is the connector itself, as the own-core row's.")
    _profile(sec)
    sec.notes.append(
        f"One engine at a time (vLLM keeps one KV connector per process): {passes} passes over the "
        "seven cases, each pass starting every engine again, in alternating order, so load changes on "
        "the shared machine spread over all cases; the p90 column shows how noisy each case was.")


def _profile(sec: Section) -> None:
    """Where a radixkv hit's time goes: the lookup's wait (asked until answered), the
    worker's wait for its load (the LoadBack went out as the step began), queueing the
    saves, get_finished."""
    rows = []
    waits = [w for w, _ in LOOKUP_WAIT]
    if waits:
        rows.append(["lookup: first ask until the hit is known (scheduler session, batched Match)",
                     f"{fmt(median(waits) * 1e3)} ms", f"{fmt(percentile(waits, 90) * 1e3)} ms",
                     f"{median([s for _, s in LOOKUP_WAIT]):.0f} scheduler steps, {len(waits)} lookups"])
    labels = {"start_load_kv": "load: start_load_kv waiting for the LoadBack begun as the step began (worker; per request)",
              "wait_for_save": "saves: Inserts queued (the saves thread sends them; the copy runs in the daemon)",
              "get_finished": "get_finished: polling the saves' acks (every step)"}
    for name, calls in WORKER_CALLS.items():
        if calls:
            rows.append([labels[name], f"{fmt(median(calls) * 1e3)} ms", f"{fmt(percentile(calls, 90) * 1e3)} ms",
                         f"{len(calls)} calls"])
    for name, calls in SCHEDULER_CALLS.items():
        if calls:
            rows.append([f"scheduler: {name} (per call)", f"{fmt(median(calls) * 1e3)} ms",
                         f"{fmt(percentile(calls, 90) * 1e3)} ms", f"{len(calls)} calls, max {fmt(max(calls) * 1e3)} ms"])
    sec.tables.append(Table("Where a radixkv host hit's time goes (radixkv engine, every pass)",
                            ["part", "p50", "p90", "count"], rows,
                            "Measured in the same run by the timing subclass (wall time of each call)."))
