"""Timing helpers for a noisy shared machine: interleave candidates, repeat, take medians."""

import gc
import math
import statistics
import sys
import time
from collections.abc import Callable

_START = time.monotonic()


def progress(message: str) -> None:
    """One progress line on stderr (stdout carries only figure lines)."""
    print(f"[bench {time.monotonic() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def percentile(xs, q: float) -> float:
    """The q-th percentile (0..100) by nearest rank."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))
    return xs[k]


def per_op(fn: Callable[[], object], ops: int) -> float:
    """Seconds per operation of one call of `fn`, which performs `ops` operations."""
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) / ops


def interleaved(candidates: dict[str, tuple[Callable[[], object], int]], rounds: int,
                before: Callable[[], object] | None = None) -> dict[str, float]:
    """Run each candidate `(fn, ops)` once per round, in alternating order, collecting
    (and calling `before`, untimed) before each; the median over rounds of seconds per
    operation, by name."""
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    names = list(candidates)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else reversed(names)):
            fn, ops = candidates[name]
            gc.collect()
            if before is not None:
                before()
            samples[name].append(per_op(fn, ops))
    return {k: median(v) for k, v in samples.items()}

