"""Section `events`: the cost of KV events on the engine path, and how many the daemon
publishes. Two daemon subprocesses in the same run, one with events off and one
publishing on ZMQ (and serving WatchEvents), each with a warm namespace of 2k-token
prompts (write_through, so an insert stores its new page on device, then on host: two
events). Match is timed call by call alone, then alternating with Insert, on
each daemon in turn;
a ZMQ subscriber in this process counts what the events-on daemon publishes. Then a
burst of back-to-back inserts on the events-on daemon gives the publish rate.
"""

import os
import random
import tempfile
import threading
import time

import zmq

from radixkv.routing.wire import BlockStored, decode_batch

from .daemon import DaemonProcess
from .figures import Figure, Section, Table, fmt
from .rpc import PROMPTS, Side, _ops
from .timing import percentile, progress

ROUNDS = {"tiny": 2, "quick": 5, "full": 10}
CALLS = {"tiny": 20, "quick": 200, "full": 400}  # per op per round per daemon
BURST_S = {"tiny": 0.5, "quick": 3.0, "full": 6.0}
TARGETS: dict[str, float] = {}  # the issue sets no number: the ratios are reported


class Counter:
    """A ZMQ SUB receiving on its own thread; it only keeps the payloads (decoding them
    there would take this process's GIL from the timed client calls). `snapshot` decodes
    and counts batches, events and stored blocks."""

    def __init__(self, endpoint: str):
        self._payloads: list[bytes] = []
        self._counted = (0, 0, 0, 0)  # payloads counted, batches, events, blocks
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self._payloads.append(self._sock.recv_multipart()[2])

    def snapshot(self) -> tuple[int, int, int]:
        n, batches, events, blocks = self._counted
        for payload in self._payloads[n:len(self._payloads)]:
            batch = decode_batch(payload)
            n, batches, events = n + 1, batches + 1, events + len(batch.events)
            blocks += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
        self._counted = (n, batches, events, blocks)
        return batches, events, blocks

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)


def _burst(ops, counter: Counter, seconds: float) -> dict:
    """Back-to-back inserts for `seconds`; what the subscriber received meanwhile."""
    before = counter.snapshot()
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < seconds:
        ops["insert"]()
        calls += 1
    # Until the subscriber has had everything (nothing new for 0.1 s): the publisher
    # thread may trail the last calls; the rate is what a router receives.
    seen, last = counter.snapshot(), time.perf_counter()
    while time.perf_counter() - last < 0.1:
        time.sleep(0.01)
        if counter.snapshot() != seen:
            seen, last = counter.snapshot(), time.perf_counter()
    wall = last - start
    after = seen
    b, e, k = (a - z for a, z in zip(after, before))
    return {"calls": calls, "wall": wall, "batches": b, "events": e, "blocks": k}


def run(mode: str, plot_dir=None, profiler=None) -> Section:
    sec = Section("events", "KV events (cost on the engine path, publish rate)",
                  intro=__doc__.split(". ", 1)[1].replace("\n", " "))
    rng = random.Random(13)
    pub = f"ipc://{os.path.join(tempfile.mkdtemp(prefix='rkv-bench-ev-'), 'pub')}"
    on_flags = ("--kv-events-endpoint", pub, "--kv-events-watch", "true")
    with DaemonProcess("--host-pool-size", "1GiB") as off, DaemonProcess("--host-pool-size", "1GiB", *on_flags) as on:
        counter = Counter(pub)
        progress(f"events: daemons off pid {off.pid}, on pid {on.pid}; warming {PROMPTS[mode]} prompts each")
        sides = {"off": Side("bench-ev-off", off.unix, PROMPTS[mode], 1),
                 "on": Side("bench-ev-on", on.unix, PROMPTS[mode], 1)}
        try:
            ops = {k: _ops(s, rng) for k, s in sides.items()}
            lat = {(k, op): [] for k in sides for op in ("match", "mixed_match", "insert")}
            for k in sides:  # warm-up: connections, caches
                for op in ("match", "insert"):
                    for _ in range(10):
                        ops[k][op]()
            for r in range(ROUNDS[mode]):
                progress(f"events: round {r + 1}/{ROUNDS[mode]}")
                for k in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    for _ in range(CALLS[mode]):  # Match alone: no residency change, no event
                        lat[(k, "match")].append(ops[k]["match"]())
                    for i in range(CALLS[mode]):  # beside inserts: their events are being built
                        for op in (("match", "insert") if i % 2 == 0 else ("insert", "match")):
                            lat[(k, "mixed_match" if op == "match" else op)].append(ops[k][op]())
            burst = _burst(ops["on"], counter, BURST_S[mode])
            _report(sec, lat, burst)
        finally:
            counter.close()
            for s in sides.values():
                s.close()
    return sec


def _report(sec: Section, lat, burst: dict) -> None:
    rows = []
    for op in ("match", "mixed_match", "insert"):
        off50, on50 = percentile(lat[("off", op)], 50) * 1e6, percentile(lat[("on", op)], 50) * 1e6
        off99, on99 = percentile(lat[("off", op)], 99) * 1e6, percentile(lat[("on", op)], 99) * 1e6
        rows.append([op, len(lat[("on", op)]), f"{fmt(off50)} / {fmt(on50)} us", f"{fmt(on50 / off50)}x",
                     f"{fmt(off99)} / {fmt(on99)} us", f"{fmt(on99 / off99)}x"])
        limit = TARGETS.get(op)
        sec.add(Figure(f"events.{op}.p50", on50, "us", "events_off", off50,
                       f"p50 <= {limit:g}x events off" if limit else "",
                       (on50 / off50 <= limit) if limit else None))
    per_s = burst["events"] / burst["wall"]
    sec.add(Figure("events.published_per_s", per_s, "events/s", "insert_calls_per_s",
                   burst["calls"] / burst["wall"]))
    sec.tables.append(Table(
        "Engine calls with events off / on (same run, alternating daemons)",
        ["operation", "calls each", "p50 off / on", "p50 ratio", "p99 off / on", "p99 ratio"], rows,
        "match: one 2k-token prompt, full device hit (no residency change, so no event), in rounds of "
        "Match alone. mixed_match: the same Match alternating with inserts, whose events the publisher "
        "thread builds meanwhile in the same process. insert: a cached 2k prompt plus one new page, "
        "write_through (device stored, then host stored: 2 events)."))
    sec.tables.append(Table(
        "Events published during back-to-back inserts (events on)",
        ["inserts", "seconds", "inserts/s", "batches/s", "events/s", "blocks stored/s"],
        [[burst["calls"], fmt(burst["wall"]), fmt(burst["calls"] / burst["wall"]),
          fmt(burst["batches"] / burst["wall"]), fmt(per_s), fmt(burst["blocks"] / burst["wall"])]],
        "Counted by a ZMQ subscriber in the bench process (vLLM-format batches decoded), so the rate "
        "is what a router receives; an insert's two events (device, then host once its backup finished) "
        "often share a batch with the next call's."))
