"""`python -m tests.soak [--minutes N | --seconds N] [--seed S] [--report out.json]`
(`make soak ARGS="--minutes 5"`): the soak run of tests/soak/runner.py on loopback
unix sockets. Prints progress and a summary whose last line is "<N> byte mismatches";
exits 0 when the run was clean, 1 otherwise."""

import argparse
import json
import signal
import sys

from .report import summary
from .runner import SoakConfig, run


def main(argv=None) -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=d.seconds / 60, help="how long (default 10)")
    p.add_argument("--seconds", type=float, default=None, help="how long, in seconds (overrides --minutes)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--engines-per-daemon", type=int, default=d.engines_per_daemon)
    p.add_argument("--no-steady", action="store_true", help="only the daemon that gets killed")
    p.add_argument("--no-storage", action="store_true", help="no storage tier on the daemon that gets killed")
    p.add_argument("--daemon-fault-every", type=float, default=d.daemon_fault_every, help="mean seconds")
    p.add_argument("--engine-kill-every", type=float, default=d.engine_kill_every, help="mean seconds")
    p.add_argument("--sample-every", type=float, default=d.sample_every)
    p.add_argument("--report", default="", help="write the full report (RSS samples too) as JSON here")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    # SIGTERM (a background run, a CI timeout) cleans up like Ctrl-C: no orphaned daemons.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seconds = a.seconds if a.seconds is not None else a.minutes * 60
    out = run(SoakConfig(seconds=seconds, seed=a.seed, engines_per_daemon=a.engines_per_daemon,
                         steady=not a.no_steady, storage=not a.no_storage, daemon_fault_every=a.daemon_fault_every,
                         engine_kill_every=a.engine_kill_every, sample_every=a.sample_every,
                         verbose=not a.quiet))
    if a.report:
        with open(a.report, "w") as f:
            json.dump(out, f, indent=1)
    print("\n".join(summary(out)), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
