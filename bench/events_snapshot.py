"""The events section's snapshot rows: what a router that joins costs the engines.

A `WatchEvents(snapshot=true)` reader makes the daemon walk a namespace's tree and send a
BlockStored for every resident (tier, node) pair, on the event loop the engines' calls run
on, a slice at a time (docs/events.md). Here a namespace of many one-node prompts is
snapshotted by a reader in another process (so it takes no GIL from the timed calls) while
this process times unary Matches of another namespace of the same daemon, one after
another, until the reader has the whole snapshot. The baseline is as many Matches right
before, with no reader. The snapshot ends for the reader at its first live batch: an
insert made once the snapshot began, which the daemon sends after the snapshot.
"""

import multiprocessing
import time

import numpy as np

from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pbg

from .daemon import channel
from .figures import Figure, Section, Table, fmt
from .rpc import PAGE, Side
from .timing import percentile, progress

NODES = {"tiny": 300, "quick": 10_000, "full": 20_000}  # one-node prompts in the snapshotted namespace
ROUNDS = {"tiny": 1, "quick": 2, "full": 3}  # snapshots, each with its idle baseline before it
IDLE_CALLS = {"tiny": 50, "quick": 500, "full": 1000}  # Matches with no reader, per round
PROMPT_PAGES = 2  # write-through: every node on device and host, two pairs to tell per node
NAMESPACE = "bench-ev-snapshot"


def read_snapshot(target: str, started, done, counts) -> None:
    """The reader (its own process): WatchEvents with a snapshot of NAMESPACE; `started`
    at the first batch, `done` at the first live one; counts[:] = (batches, events)."""
    stub = pbg.RadixKVStub(channel(target))
    call = stub.WatchEvents(pb.WatchEventsRequest(namespace=NAMESPACE, snapshot=True))
    batches = events = 0
    try:
        for batch in call:
            if not batch.snapshot:
                break
            batches += 1
            events += len(batch.events)
            started.set()
    finally:
        counts[0], counts[1] = batches, events
        call.cancel()
        done.set()


def measure(mode: str, target: str, match) -> dict:
    """Per round: Match latencies with no reader, then while a snapshot is read, and the
    snapshot's batches, events and seconds. `match()` times one Match (seconds)."""
    progress(f"events: {NODES[mode]:,} one-node prompts for the snapshot rows")
    side = Side(NAMESPACE, target, NODES[mode], 7, prompt_pages=PROMPT_PAGES)
    ctx = multiprocessing.get_context("spawn")
    out = {"idle": [], "during": [], "seconds": [], "batches": 0, "events": 0}
    try:
        for r in range(ROUNDS[mode]):
            progress(f"events: snapshot round {r + 1}/{ROUNDS[mode]}")
            started, done, counts = ctx.Event(), ctx.Event(), ctx.Array("q", 2)
            idle = [match() for _ in range(IDLE_CALLS[mode])]
            reader = ctx.Process(target=read_snapshot, args=(target, started, done, counts), daemon=True)
            reader.start()
            if not started.wait(60):
                raise RuntimeError("the snapshot reader got no batch within 60 s")
            t0 = time.perf_counter()
            # A new prompt: a live batch, the reader's end of the snapshot.
            marker = side.rng.integers(1, 1 << 30, size=PROMPT_PAGES * PAGE, dtype=np.int32).tobytes()
            side.stub.Insert(pb.InsertRequest(session=side.session, tokens=marker,
                                              device_pages=side.pages(PROMPT_PAGES)))
            during = []
            while not done.is_set():
                during.append(match())
            seconds = time.perf_counter() - t0
            reader.join(30)
            if counts[1] < NODES[mode]:
                raise RuntimeError(f"the snapshot told {counts[1]} events for {NODES[mode]} nodes")
            out["idle"] += idle
            out["during"] += during
            out["seconds"].append(seconds)
            out["batches"] += counts[0]
            out["events"] += counts[1]
    finally:
        side.close()
    return out


def report(sec: Section, mode: str, m: dict) -> None:
    idle = [s * 1e6 for s in m["idle"]]
    during = [s * 1e6 for s in m["during"]] or [0.0]
    rows = []
    for q in (50, 99):
        a, b = percentile(idle, q), percentile(during, q)
        sec.add(Figure(f"events.match_during_snapshot.p{q}", b, "us", "idle", a))
        rows.append([f"p{q}", f"{fmt(a)} us", f"{fmt(b)} us", f"{fmt(b / a)}x"])
    rows.append(["max", f"{fmt(max(idle))} us", f"{fmt(max(during))} us", f"{fmt(max(during) / max(idle))}x"])
    rounds = len(m["seconds"])
    sec.tables.append(Table(
        f"Match while a router reads a snapshot ({NODES[mode]:,} one-node prompts, {rounds} snapshots)",
        ["", "no reader", "during a snapshot", "ratio"], rows,
        f"Unary Match of a 2k-token prompt (full hit) in another namespace of the events-on daemon, "
        f"{len(idle)} calls with no reader, {len(m['during'])} while snapshots were read "
        f"({fmt(sum(m['seconds']) / rounds)} s each, {m['events'] // rounds:,} events in "
        f"{m['batches'] // rounds} batches). The reader runs in a process of its own."))


__all__ = ["measure", "report"]
