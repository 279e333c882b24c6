"""python -m bench [--quick | --full | --tiny] [--only core,rpc,copy,workload,storage,events,routing,node,vllm] [--out DIR]"""

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path

from radixkv_server.config import DaemonConfig
from radixkv_server.malloc import keep_freed_heap

from . import machine, report
from .profiling import Profiler
from .timing import progress

SECTIONS = ("core", "rpc", "copy", "workload", "storage", "events", "routing", "node", "vllm")
MODULES = {"core": "core", "rpc": "rpc", "copy": "copying", "workload": "workload", "storage": "storage",
           "events": "events", "routing": "routing", "node": "node_load", "vllm": "vllm"}
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick", help="a few minutes (default)")
    g.add_argument("--full", dest="mode", action="store_const", const="full", help="longer, larger trees")
    g.add_argument("--tiny", dest="mode", action="store_const", const="tiny",
                   help="seconds per section: checks the bench code runs (tests), figures mean little")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {','.join(SECTIONS)}")
    p.add_argument("--out", type=Path, default=REPO / "docs",
                   help="where benchmarks.md and img/ go (default: docs/)")
    p.add_argument("--no-plots", action="store_true", help="skip matplotlib")
    p.add_argument("--no-profile", action="store_true", help="skip py-spy profiles of missed targets")
    a = p.parse_args(argv)
    a.mode = a.mode or "quick"
    a.sections = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in a.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    # The daemons under test keep freed heap (--malloc-trim-threshold); the baselines that
    # run in this process get the same setting. Left to glibc's adaptive default, a raw
    # client's page faults would depend on what earlier sections happened to free.
    keep_freed_heap(DaemonConfig().malloc_trim_threshold)
    img = a.out / "img"
    plot_dir = None
    if not a.no_plots:
        import matplotlib
        matplotlib.use("Agg")
        img.mkdir(parents=True, exist_ok=True)
        plot_dir = img
    profiler = None
    if not a.no_profile and a.mode != "tiny":
        profiler = Profiler(Path(tempfile.mkdtemp(prefix="rkv-bench-pyspy-")))
        if not profiler.available:
            progress("py-spy not found: no profiles (pip install '.[bench]')")
            profiler = None
    sections = []
    for name in a.sections:
        progress(f"section {name} ({a.mode})")
        mod = importlib.import_module(f".{MODULES[name]}", __package__)
        t = time.monotonic()
        sec = mod.run(a.mode, plot_dir=plot_dir, profiler=profiler)
        sec.seconds = time.monotonic() - t
        for f in sec.figures:
            print(f.line(), flush=True)
        sections.append(sec)
    profiles = profiler.profiles if profiler else {}
    command = "python -m bench --" + a.mode + ("" if a.sections == list(SECTIONS) else f" --only {a.only}")
    text = report.markdown(sections, a.mode, machine.describe(), profiles, command=command)
    report.write(a.out / "benchmarks.md", text)
    missed = [f for s in sections for f in s.figures if f.met is False]
    met = [f for s in sections for f in s.figures if f.met]
    progress(f"wrote {a.out / 'benchmarks.md'}; targets met {len(met)}, missed {len(missed)}"
             + "".join(f"\n  missed {f.name}: {f.line().split(': ', 1)[1]} target {f.target}" for f in missed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
