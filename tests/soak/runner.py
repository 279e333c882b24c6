"""The soak run: mixed load and faults for a bounded time, every byte verified.

Two daemons on loopback unix sockets. The "crashy" one is SIGKILLed (now and then
SIGTERMed) and restarted at random points, with a file storage tier written through
(`storage`) that outlives its restarts, so its engines also prefetch what an earlier
incarnation stored (and, at SIGTERM, stored at shutdown); the "steady" one is never killed, so its
resident memory over the whole run shows whether anything grows. Each daemon serves
`engines_per_daemon` ChaosEngine processes (write_through, write_through_selective,
write_back in turn) that are themselves SIGKILLed and restarted at random points and
now and then act stuck (the daemons run with lease and ack timeouts). Every
`sample_every` seconds: each daemon's RSS and CheckInvariants. At the end: engines
stop, invariants once more, both daemons must shut down cleanly (exit 0) and never
have logged a traceback.

The schedule is event-based: the clock (and the first fault) starts only once every
engine reported itself registered (its readiness file), so a short run on a loaded
machine, where an engine takes 10-20 s to import torch, still faults engines that are
up and lets them see the daemon restart. The run goes on past its time until the
minimum faults (min_daemon_faults, min_engine_kills) happened and, after the last one,
the engines reported seeing a daemon restart and at least min_session_losses lost
sessions (both bounded by OVERTIME_S).

The run is clean when: zero byte mismatches, zero invariant violations, no engine
protocol or page-accounting error, no client error that no fault explains (each one's
message is listed among the problems), no engine crash, bytes were verified and loads made
on both daemons, the faults happened, and (runs of 2 minutes or more) the steady
daemon's RSS after warm-up grew less than max(16 MiB, 10%).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from radixkv.client import Client
from radixkv.errors import RadixKVError

from tests.support.daemon import DaemonProcess

from .report import rss_verdict

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("write_through", "write_through_selective", "write_back")
DAEMON_FLAGS = ("--lease-timeout", "5", "--ack-timeout", "5", "--copy-workers", "1")
MiB = 1 << 20
READY_TIMEOUT_S = 180.0  # every engine registered (imports torch first: slow on a loaded machine)
OVERTIME_S = 120.0  # past `seconds`, how long the minimum faults, the work checked and the faults being seen may take


@dataclass
class SoakConfig:
    seconds: float = 600.0
    seed: int = 0
    engines_per_daemon: int = 2
    steady: bool = True              # also run the never-killed daemon (RSS flatness)
    daemon_fault_every: float = 40.0  # mean seconds between faults of the crashy daemon
    engine_kill_every: float = 25.0   # mean seconds between engine SIGKILLs
    sample_every: float = 5.0
    stall: float = 0.01              # per-step chance of a stuck-engine misstep
    warmup: float = 60.0
    verbose: bool = True
    min_daemon_faults: int = 1       # the run goes on past `seconds` until this many happened
    min_engine_kills: int = 1
    min_session_losses: int = 1      # ... and, after the last fault, until engines reported this many
    storage: bool = True             # the crashy daemon has a file storage tier (write-through)

    def scaled(self) -> "SoakConfig":
        """Short runs get proportionally frequent faults (several even in 20 s)."""
        c = SoakConfig(**asdict(self))
        c.daemon_fault_every = min(c.daemon_fault_every, c.seconds / 5)
        c.engine_kill_every = min(c.engine_kill_every, c.seconds / 4)
        c.sample_every = min(c.sample_every, max(1.0, c.seconds / 10))
        c.warmup = min(c.warmup, c.seconds / 4)
        return c


@dataclass
class EngineSlot:
    name: str
    daemon: str
    namespace: str
    policy: str
    proc: subprocess.Popen | None = None
    incarnation: int = 0
    stats_files: list = field(default_factory=list)
    crashes: list = field(default_factory=list)


class Soak:
    def __init__(self, config: SoakConfig):
        self.cfg = config.scaled()
        self.rng = random.Random(self.cfg.seed)
        self.dir = tempfile.mkdtemp(prefix="rkv-soak-")
        self.stop_file = os.path.join(self.dir, "stop")
        # Copies on the crashy daemon take a little longer, so kills often catch some in flight.
        storage = ("--storage", os.path.join(self.dir, "storage"), "--storage-policy", "write_through")
        self.daemons: dict[str, DaemonProcess] = {
            "crashy": DaemonProcess(*DAEMON_FLAGS, "--fault-copy-delay", "0.005",
                                    *(storage if self.cfg.storage else ()))}
        if self.cfg.steady:
            self.daemons["steady"] = DaemonProcess(*DAEMON_FLAGS)
        self.engines: list[EngineSlot] = []
        self.faults = {"daemon_sigkill": 0, "daemon_sigterm": 0, "engine_sigkill": 0}
        self.samples: list[dict] = []
        self.violations: list[str] = []
        self.problems: list[str] = []
        self.started = 0.0
        self.counters: dict = {}

    # -- processes ---------------------------------------------------------------------

    def ready_file(self, slot: EngineSlot) -> str:
        return os.path.join(self.dir, f"{slot.name}-{slot.incarnation}.ready")

    def spawn(self, slot: EngineSlot) -> None:
        slot.incarnation += 1
        stats = os.path.join(self.dir, f"{slot.name}-{slot.incarnation}.json")
        slot.stats_files.append(stats)
        log = open(os.path.join(self.dir, f"{slot.name}-{slot.incarnation}.log"), "wb")
        slot.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.soak.engine", "--target", self.daemons[slot.daemon].target,
             "--namespace", slot.namespace, "--policy", slot.policy, "--stall", str(self.cfg.stall),
             "--seed", str(self.rng.randrange(1 << 30)), "--stats", stats, "--stop", self.stop_file,
             "--max-seconds", str(self.cfg.seconds + READY_TIMEOUT_S + 120), "--ready", self.ready_file(slot),
             *(["--storage"] if self.cfg.storage and slot.daemon == "crashy" else [])],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def check_engines(self) -> None:
        for slot in self.engines:
            if slot.proc is not None and slot.proc.poll() not in (None, 0, -signal.SIGKILL):
                tail = self.tail(f"{slot.name}-{slot.incarnation}.log")
                slot.crashes.append(tail)
                self.problems.append(f"engine {slot.name} exited with {slot.proc.returncode}; its log ends:\n"
                                     f"{tail[-1500:]}")
                self.spawn(slot)

    def tail(self, name: str, n: int = 3000) -> str:
        try:
            return Path(self.dir, name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_engines_ready(self) -> None:
        """Block until every engine's current incarnation has registered; an engine that
        exits first is restarted (check_engines). Fails after READY_TIMEOUT_S."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(os.path.exists(self.ready_file(s)) for s in self.engines):
            self.check_engines()
            if time.monotonic() > deadline:
                late = [s.name for s in self.engines if not os.path.exists(self.ready_file(s))]
                tails = "\n".join(self.tail(f"{s.name}-{s.incarnation}.log", 1500) for s in self.engines
                                  if s.name in late)
                raise RuntimeError(f"engines {late} not registered within {READY_TIMEOUT_S}s:\n{tails}")
            time.sleep(0.1)  # polling the readiness files against the deadline

    # -- faults ------------------------------------------------------------------------

    def daemon_fault(self) -> None:
        d = self.daemons["crashy"]
        if self.rng.random() < 0.25:
            self.faults["daemon_sigterm"] += 1
            code = d.stop()
            if code != 0:
                self.problems.append(f"crashy daemon exited with {code} on SIGTERM")
        else:
            self.faults["daemon_sigkill"] += 1
            d.kill()
        time.sleep(self.rng.uniform(0.0, 1.5))  # the daemon is down for a while (not a sync)
        d.start()

    def engine_fault(self) -> None:
        slot = self.rng.choice(self.engines)
        if slot.proc is not None and slot.proc.poll() is None:
            slot.proc.kill()
            slot.proc.wait()
            self.faults["engine_sigkill"] += 1
        self.spawn(slot)

    # -- sampling ----------------------------------------------------------------------

    def sample(self) -> None:
        row = {"t": round(time.monotonic() - self.started, 1)}
        for name, d in self.daemons.items():
            row[f"{name}_rss_mib"] = round(d.rss_bytes() / MiB, 1)
            row[f"{name}_starts"] = d.starts
            if d.alive:
                self.violations += self.check(d)
        self.samples.append(row)
        if self.cfg.verbose:
            print(f"[soak] t={row['t']:>6}s " + " ".join(f"{k}={v}" for k, v in row.items() if k != "t")
                  + f" faults={sum(self.faults.values())} violations={len(self.violations)}", flush=True)

    @staticmethod
    def daemon_counters(d: DaemonProcess) -> dict:
        """What the daemon itself counted (since its last start), summed over namespaces."""
        keys = ("loaded_tokens", "failed_load_tokens", "leases_expired", "load_backs_expired")
        try:
            with Client(d.target, timeout=10, reconnect=None) as c:
                namespaces = c.stats().namespaces
        except RadixKVError as e:
            return {"error": str(e)}
        return {k: sum(ns.counters.get(k, 0) for ns in namespaces) for k in keys}

    def check(self, d: DaemonProcess) -> list[str]:
        try:
            with Client(d.target, timeout=10, reconnect=None) as c:
                return [f"{v.namespace}: {v.message}" for v in c.check_invariants()]
        except RadixKVError:
            return []  # went down meanwhile

    # -- the run -----------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.cfg
        for d in self.daemons.values():
            d.start()
        for name in self.daemons:
            for i in range(cfg.engines_per_daemon):
                policy = POLICIES[len(self.engines) % len(POLICIES)]  # every policy, across daemons
                slot = EngineSlot(f"{name}-e{i}", name, f"soak-{name}/e{i}", policy)
                self.engines.append(slot)
                self.spawn(slot)
        self.wait_engines_ready()
        self.started = time.monotonic()
        end = self.started + cfg.seconds
        # The first fault of each kind comes early at a fixed point, so even a short run
        # on a slow machine injects both kinds; later ones follow a Poisson schedule.
        next_engine = self.started + min(cfg.engine_kill_every, 0.15 * cfg.seconds)
        next_daemon = self.started + min(cfg.daemon_fault_every, 0.3 * cfg.seconds)
        next_sample = self.started
        while (now := time.monotonic()) < end or not self.minimums_met():
            if now >= end:  # time is up, a minimum is not: inject what is missing now
                if now > end + OVERTIME_S:
                    self.problems.append(f"minimums not met within {OVERTIME_S}s: faults {self.faults}, "
                                         f"work {self.work_seen()}")
                    break
                next_daemon, next_engine = self.overdue(now, next_daemon, next_engine)
            if now >= next_sample:
                self.sample()
                next_sample += cfg.sample_every
            if now >= next_daemon:
                self.daemon_fault()
                next_daemon = time.monotonic() + self.rng.expovariate(1 / cfg.daemon_fault_every)
            if now >= next_engine:
                self.engine_fault()
                next_engine = time.monotonic() + self.rng.expovariate(1 / cfg.engine_kill_every)
            self.check_engines()
            time.sleep(0.1)  # the schedule's tick
        self.wait_restarts_seen()
        return self.finish()

    def daemon_faults(self) -> int:
        return self.faults["daemon_sigkill"] + self.faults["daemon_sigterm"]

    def minimums_met(self) -> bool:
        """The faults the run must inject, and the work its verdict checks was covered
        (loads from host, storage hits prefetched): a short run on a slow machine goes on
        until both, within OVERTIME_S, instead of failing for want of time."""
        return (self.daemon_faults() >= self.cfg.min_daemon_faults
                and self.faults["engine_sigkill"] >= self.cfg.min_engine_kills
                and all(self.work_seen().values()))

    def work_seen(self) -> dict[str, bool]:
        return {"host loads": self.engine_totals("host_loaded_pages") > 0,
                "storage prefetches": not self.cfg.storage or self.engine_totals("staged_pages") > 0}

    def overdue(self, now: float, next_daemon: float, next_engine: float) -> tuple[float, float]:
        if self.daemon_faults() < self.cfg.min_daemon_faults:
            next_daemon = min(next_daemon, now)
        if self.faults["engine_sigkill"] < self.cfg.min_engine_kills:
            next_engine = min(next_engine, now)
        return next_daemon, next_engine

    def engine_totals(self, key: str) -> int:
        total = 0
        for slot in self.engines:
            for path in slot.stats_files:
                try:
                    total += json.loads(Path(path).read_text()).get(key, 0)
                except (OSError, ValueError):
                    pass  # not written yet, or killed before its first write
        return total

    def wait_restarts_seen(self) -> None:
        """After the last fault: wait (bounded) until some engine reported a daemon restart
        and the engines min_session_losses lost sessions (an engine counts a loss at its
        next call, and one killed before it wrote its stats takes its count along), so
        "engines saw the restarts" judges the daemon, not the clock."""
        deadline = time.monotonic() + OVERTIME_S
        while self.daemon_faults() and not self.restarts_seen():
            self.check_engines()
            if time.monotonic() > deadline:
                return  # the verdict's check fails and says so
            time.sleep(0.2)  # polling the engines' stats files against the deadline

    def restarts_seen(self) -> bool:
        return (self.engine_totals("daemon_restarts") > 0
                and self.engine_totals("session_losses") >= self.cfg.min_session_losses)

    def finish(self) -> dict:
        Path(self.stop_file).touch()
        if not self.daemons["crashy"].alive:
            self.daemons["crashy"].start()
        for slot in self.engines:
            try:
                code = slot.proc.wait(90)
            except subprocess.TimeoutExpired:
                slot.proc.kill()
                code = "hung"
            if code != 0:
                self.problems.append(f"engine {slot.name} ended with {code}: "
                                     f"{self.tail(f'{slot.name}-{slot.incarnation}.log', 800)}")
        self.sample()
        self.counters = {name: self.daemon_counters(d) for name, d in self.daemons.items()}
        exits = {}
        for name, d in self.daemons.items():
            exits[name] = d.stop()
            log = d.log()
            if exits[name] != 0:
                self.problems.append(f"{name} daemon exited with {exits[name]} on SIGTERM")
            if "Traceback" in log or "level=error" in log:
                self.problems.append(f"{name} daemon logged an error: {log[log.find('Traceback') - 500:][:3000]}")
        return self.report(exits)

    def report(self, exits: dict) -> dict:
        totals, per_daemon = {}, {}
        for slot in self.engines:
            for path in slot.stats_files:
                try:
                    counts = json.loads(Path(path).read_text())
                except (OSError, ValueError):
                    continue  # killed before its first write
                messages = counts.pop("pool_messages", [])
                if messages:
                    self.problems.append(f"{slot.name}: page accounting: {messages}")
                for message in counts.pop("error_messages", []):
                    self.problems.append(f"{slot.name}: client error: {message}")
                for k, v in counts.items():
                    totals[k] = totals.get(k, 0) + v
                    per_daemon.setdefault(slot.daemon, {}).setdefault(k, 0)
                    per_daemon[slot.daemon][k] += v
        out = {
            "config": asdict(self.cfg), "seconds": round(time.monotonic() - self.started, 1),
            "faults": self.faults, "totals": totals, "per_daemon": per_daemon,
            "daemon_starts": {n: d.starts for n, d in self.daemons.items()}, "daemon_exit_codes": exits,
            "daemon_counters": self.counters,
            "invariant_violations": self.violations[:20], "num_violations": len(self.violations),
            "problems": self.problems[:40], "rss": rss_verdict(self.samples, "steady" if self.cfg.steady else "crashy",
                                                      self.cfg.warmup, self.cfg.seconds), "samples": self.samples,
        }
        out["ok"] = self.verdict(out)
        return out

    def verdict(self, out: dict) -> bool:
        t, faults = out["totals"], self.faults
        checks = {
            "no byte mismatches": t.get("byte_mismatches", 0) == 0,
            "no invariant violations": not self.violations,
            "no protocol or accounting errors": t.get("protocol_errors", 0) == 0 and t.get("pool_errors", 0) == 0,
            "no unexplained client errors": t.get("errors", 0) == 0,
            "no problems": not self.problems,
            "bytes verified on every daemon": all(d.get("bytes_verified", 0) > 0 for d in out["per_daemon"].values())
            and len(out["per_daemon"]) == len(self.daemons),
            "loads verified": t.get("host_loaded_pages", 0) > 0,
            "storage hits prefetched": not self.cfg.storage or t.get("staged_pages", 0) > 0,
            "faults injected": faults["daemon_sigkill"] + faults["daemon_sigterm"] > 0 and faults["engine_sigkill"] > 0,
            "engines saw the restarts": t.get("daemon_restarts", 0) > 0
            and t.get("session_losses", 0) >= self.cfg.min_session_losses,
            "rss flat after warm-up": not out["rss"].get("checked") or out["rss"]["flat"],
        }
        out["checks"] = checks
        return all(checks.values())

    def cleanup(self) -> None:
        for slot in self.engines:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()
                slot.proc.wait()
        for d in self.daemons.values():
            d.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)


def run(config: SoakConfig) -> dict:
    soak = Soak(config)
    try:
        return soak.run()
    finally:
        soak.cleanup()

