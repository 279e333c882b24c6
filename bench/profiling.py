"""py-spy sampling of a process while a load runs, summarised as its hottest functions.

Used where a target is missed: the markdown then names what bounds the figure. py-spy
is in the `bench` extra; without it (or without ptrace rights) profiles are skipped.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


@dataclass
class Profile:
    label: str
    what: str
    samples: int
    self_top: list[tuple[str, float]] = field(default_factory=list)   # (function, % of samples)
    total_top: list[tuple[str, float]] = field(default_factory=list)

    def markdown(self) -> str:
        out = [f"*py-spy, {self.what}: {self.samples} samples.* Hottest functions by own time:", ""]
        out += [f"- `{f}` {p:.0f}%" for f, p in self.self_top]
        out += ["", "By inclusive time (radixkv and grpc frames):", ""]
        out += [f"- `{f}` {p:.0f}%" for f, p in self.total_top]
        return "\n".join(out)


class Profiler:
    def __init__(self, out_dir: Path, seconds: float = 3.0, rate: int = 200):
        self.exe = py_spy()
        self.out_dir = Path(out_dir)
        self.seconds = seconds
        self.rate = rate
        self.profiles: dict[str, Profile] = {}

    @property
    def available(self) -> bool:
        return self.exe is not None

    def record(self, label: str, pid: int, load, what: str = "") -> Profile | None:
        """Sample `pid` while calling `load()` repeatedly for `seconds`."""
        if not self.available:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / f"{label}.txt"
        proc = subprocess.Popen([self.exe, "record", "-p", str(pid), "-r", str(self.rate), "-f", "raw",
                                 "-o", str(raw), "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # let it attach
        end = time.monotonic() + self.seconds
        try:
            while time.monotonic() < end:
                load()
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not raw.exists():
            return None
        prof = summarise(label, what or f"pid {pid}", raw.read_text())
        self.profiles[label] = prof
        return prof

    def in_process(self, label: str, load, what: str = "this process") -> Profile | None:
        return self.record(label, os.getpid(), load, what)


def _func(frame: str) -> str:
    """'name (path/file.py:123)' -> 'name (file.py)'."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({os.path.basename(path)})" if path else name


def summarise(label: str, what: str, text: str, top: int = 10) -> Profile:
    own, total = Counter(), Counter()
    samples = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = [_func(f) for f in stack.split(";") if f]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        own[frames[-1]] += n
        for f in set(frames):
            total[f] += n
    pct = (lambda c: 100.0 * c / samples) if samples else (lambda c: 0.0)
    bench_files = ("(profiling.py)", "(core.py)", "(copying.py)", "(rpc.py)", "(storage.py)", "(workload.py)",
                   "(__main__.py)", "(runpy)")
    interesting = [(f, pct(c)) for f, c in total.most_common() if not f.endswith(bench_files)
                   if any(k in f for k in ("radixkv", "servicer", "daemon", "namespace", "cache", "tree",
                                           "state", "eviction", "loadback", "_server", "grpc", "shm", "copy",
                                           "storage", "base.py", "file.py", "record", "host_pool", "mover"))
                   and not f.startswith("<module>")]
    own_top = [(f, pct(c)) for f, c in own.most_common() if not f.endswith(bench_files)][:top]
    return Profile(label, what, samples, own_top, interesting[:top])
