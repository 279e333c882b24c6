"""The core section's eviction-after-a-burst rows (#15 point 3): evict calls of one
scheduler step's size, timed one by one right after a burst of matches, against the
same calls with no match before them (the same-run baseline of this machine's noise)."""

import gc
import random
import resource
import time

from radixkv_server.core.pages import unpack

from .figures import Figure, Section
from .timing import median, percentile, progress

BURST_MATCHES = {"tiny": 20_000, "quick": 1_000_000, "full": 1_000_000}  # matches before timed evictions
BURST_EVICTS = {"tiny": 16, "quick": 600, "full": 1000}  # evict calls timed one by one after each burst
# ... and as many again right after them: the same calls with no matches before them, the
# same-run baseline of the spread (what this machine's noise makes of p99 over p50).
BURST_ROUNDS = {"tiny": 2, "quick": 3, "full": 5}


class EvictCall:
    """One timed evict call: wall and thread CPU seconds, and whether the OS switched the
    thread out during it (a context switch: the wall time then includes another process's
    time slice, and the CPU time the caches it left cold)."""

    __slots__ = ("wall", "cpu", "switched")

    def __init__(self, wall: float, cpu: float, switched: bool):
        self.wall, self.cpu, self.switched = wall, cpu, switched


def _switches() -> int:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_nvcsw + r.ru_nivcsw


def measure_evict_after_matches(trees, mode: str, rng: random.Random, evict_call: int):
    """Per round, each evict_device(evict_call) call timed one by one right after a burst
    of BURST_MATCHES full-hit matches (random cached prompts, every leaf refreshed many
    times): an eviction must not pay for the recency updates those matches made (#15).
    Then as many calls again, with no match in between (the steady baseline). The
    garbage the matches left is collected before timing, as `interleaved` does. Returns
    (rounds after the burst, steady rounds, garbage collections during timed calls)."""
    cache, rounds, steady = trees.cache, [], []
    collections = [0, 0, 0]

    def count_gc(phase, info):
        if phase == "start":
            collections[info["generation"]] += 1

    def timed(calls: list[EvictCall]) -> None:
        for _ in range(BURST_EVICTS[mode]):
            sw = _switches()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            freed = cache.evict_device(evict_call).freed_pages
            t1 = time.perf_counter()
            c1 = time.thread_time()
            calls.append(EvictCall(t1 - t0, c1 - c0, _switches() != sw))
            trees.free_device += unpack(freed).tolist()

    for _ in range(BURST_ROUNDS[mode]):
        rounds.append([])
        steady.append([])
        order = [trees.prompts[i] for i in rng.choices(range(len(trees.prompts)), k=BURST_MATCHES[mode])]
        for q in order:
            cache.match(q)
        del order
        gc.collect()
        gc.callbacks.append(count_gc)
        try:
            timed(rounds[-1])
            timed(steady[-1])
        finally:
            gc.callbacks.remove(count_gc)
    return rounds, steady, collections


def _spread(rounds: list[list[EvictCall]]) -> tuple[float, float, float, int]:
    """Medians over rounds of (p50, p99) of the calls the OS left alone (a switched-out
    call's wall time holds a neighbour's time slice), of p99 over every call, and the
    number of calls left out."""
    per_round = []
    for calls in rounds:
        kept = [c.wall for c in calls if not c.switched] or [c.wall for c in calls]
        per_round.append((percentile(kept, 50), percentile(kept, 99),
                          percentile([c.wall for c in calls], 99), len(calls) - len(kept)))
    return (median(r[0] for r in per_round), median(r[1] for r in per_round),
            median(r[2] for r in per_round), sum(r[3] for r in per_round))


def burst_figure(sec: Section, name: str, rounds: list[list[EvictCall]],
                 steady: list[list[EvictCall]], collections: list[int], mode: str) -> None:
    p50, p99, p99_all, switched = (x * 1e6 if i < 3 else x for i, x in enumerate(_spread(rounds)))
    s50, s99, _, _ = (x * 1e6 for x in _spread(steady))
    n = sum(len(c) for c in rounds)
    sec.add(Figure(f"{name}.p99", p99, "us", "p50", p50,
                   f"p99 <= 2x p50 (median of {len(rounds)} series of {len(rounds[0])} evict calls, "
                   f"each right after {BURST_MATCHES[mode]:,} matches; {switched} of {n} calls "
                   f"switched out by the OS left out; gc collections while timing, by generation: "
                   f"{'/'.join(map(str, collections))})", p99 <= 2 * p50))
    sec.add(Figure(f"{name}.p99_all", p99_all, "us", "p50", p50))
    sec.add(Figure(f"{name}.first", median(r[0].wall for r in rounds) * 1e6, "us", "p50", p50))
    sec.add(Figure(f"{name}.p99_vs_steady", p99, "us", "steady_p99", s99))
    sec.add(Figure(f"{name}.p50_vs_steady", p50, "us", "steady_p50", s50))
    cpu = sorted(c.cpu for c in rounds[-1])
    progress(f"{name}: p50 {p50:.0f} p99 {p99:.0f} p99(all) {p99_all:.0f} us; "
             f"steady p50 {s50:.0f} p99 {s99:.0f} us; last round CPU p50 {percentile(cpu, 50) * 1e6:.0f} "
             f"p99 {percentile(cpu, 99) * 1e6:.0f} us")
