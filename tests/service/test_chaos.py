"""Randomized faults over the gRPC API, and the short soak run that `make test` includes.

A cache failure must never become wrong model output: with daemons and engines killed
at random (seeded) points, every page an engine was told is valid holds the right
bytes, and everything else was reported to it as a miss or a failed load. The engines'
checker itself is shown to catch corruption.
"""

import subprocess
import sys
from pathlib import Path

from tests.soak import engine as chaos
from tests.soak.report import summary
from tests.soak.runner import SoakConfig, run

ROOT = Path(__file__).resolve().parents[2]


def test_randomized_kills_and_restarts_never_give_wrong_bytes():
    out = run(SoakConfig(seconds=15, seed=20261129, engines_per_daemon=3, steady=False, daemon_fault_every=3,
                         engine_kill_every=4, stall=0.02, verbose=False,
                         min_daemon_faults=2, min_engine_kills=1, min_session_losses=2))
    lines = "\n".join(summary(out))
    assert out["ok"], lines
    t = out["totals"]
    assert t["byte_mismatches"] == 0 and out["num_violations"] == 0, lines
    assert out["faults"]["daemon_sigkill"] + out["faults"]["daemon_sigterm"] >= 2, lines
    assert out["faults"]["engine_sigkill"] >= 1 and t["session_losses"] >= 2, lines
    assert t["host_loaded_pages"] > 100 and t["bytes_verified"] > 0, lines


def test_short_soak_run():
    """`make soak` with a short duration: the same entry point, a subprocess."""
    proc = subprocess.run([sys.executable, "-m", "tests.soak", "--seconds", "10", "--quiet", "--seed", "7"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "0 byte mismatches", proc.stdout
    assert "invariant violations: 0" in proc.stdout


def test_the_checker_catches_corrupted_pages(daemon_factory):
    """The engines' verification is live: KV changed behind the daemon's back is counted."""
    d = daemon_factory()
    engine = chaos.ChaosEngine(d.target, "chaos/check", "write_back", seed=3)
    try:
        for _ in range(40):
            engine.guarded_step()
        assert engine.counts.byte_mismatches == 0 and engine.counts.prefix_pages_verified > 0
        cached = engine.pool.cached()
        assert cached
        for i in range(chaos.LAYOUT.num_buffers):
            engine.page_view(i)[cached] ^= 0x5A
        for _ in range(40):
            engine.guarded_step()
        assert engine.counts.byte_mismatches > 0
    finally:
        engine.close()
