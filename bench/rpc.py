"""Section `rpc`: a real daemon subprocess, called with the generated stubs (no client
library in between), over its unix socket and over TCP on 127.0.0.1.

Each operation is timed call by call, interleaved with `Echo` carrying a payload of the
same size as one 2k-token prompt (8 KiB): the floor of a unary call in Python gRPC here.
The tree is warm: whole 2k-token prompts (page_size 16, tiny pages so copies cost nothing).
Each round ends with the Session stream rows (#15, rpc_stream.py): Match through the
client library over the stream, against unary Match and a raw Unix-socket ping-pong.
"""

import asyncio
import os
import random
import time

import numpy as np

from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pbg
from radixkv_server.core.pages import pack, unpack

from . import rpc_stream
from .daemon import AckChannel, DaemonProcess, channel, register
from .figures import Figure, Section, Table, fmt
from .timing import percentile, progress

PAGE = 16
PROMPT_PAGES = 128
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=PAGE)
PROMPTS = {"tiny": 32, "quick": 256, "full": 512}
ROUNDS = {"tiny": 2, "quick": 5, "full": 10}
CALLS = {"tiny": 20, "quick": 200, "full": 400}  # per op per round
LOADS = {"tiny": 8, "quick": 30, "full": 60}      # load-backs per round
BATCH = 32
TARGETS = {"match": 1.3, "match_batch32": 3.0}


class Side:
    """One namespace and session reached over one transport, with its warm tree:
    `num_prompts` prompts of `prompt_pages` pages, write-through, one node each."""

    def __init__(self, name: str, target: str, num_prompts: int, seed: int, prompt_pages: int = PROMPT_PAGES):
        self.stub = pbg.RadixKVStub(channel(target))
        spare = 64 * 1024
        used = num_prompts * prompt_pages
        self.num_pages = used + spare
        self.buffers = ShmKvBuffers.create(LAYOUT, self.num_pages)
        reg = register(self.stub, name, LAYOUT, self.buffers, self.num_pages,
                       write_policy="write_through", host_pool_pages=self.num_pages)
        self.session = reg.session
        rng = np.random.default_rng(seed)
        self.prompts = [rng.integers(1, 1 << 30, size=prompt_pages * PAGE, dtype=np.int32).tobytes()
                        for _ in range(num_prompts)]
        self.free = list(range(self.num_pages - 1, used - 1, -1))
        self.rng = rng
        # Each prompt's device pages while wholly on device (None while partly on host).
        self.pages_of: list[bytes | None] = [pack(range(i * prompt_pages, (i + 1) * prompt_pages))
                                             for i in range(num_prompts)]
        for p, pages in zip(self.prompts, self.pages_of):
            self.stub.Insert(pb.InsertRequest(session=self.session, tokens=p, device_pages=pages))
        self.acks = AckChannel(self.stub, self.session)
        self.payload = os.urandom(len(self.prompts[0]))

    def pages(self, n: int) -> bytes:
        out = self.free[-n:]
        del self.free[-n:]
        return pack(out)

    def close(self) -> None:
        self.acks.close()
        try:
            self.stub.Close(pb.CloseRequest(session=self.session), timeout=30)
        finally:
            self.buffers.close()


def _ops(side: Side, rng: random.Random):
    """name -> callable doing one timed call and returning its seconds."""
    stub, session, prompts = side.stub, side.session, side.prompts
    echo_req = pb.EchoRequest(payload=side.payload)

    def timed(fn, req):
        t = time.perf_counter()
        fn(req)
        return time.perf_counter() - t

    def echo():
        return timed(stub.Echo, echo_req)

    def match():
        req = pb.MatchRequest(session=session, prompts=[pb.Prompt(tokens=rng.choice(prompts))])
        return timed(stub.Match, req)

    def match32():
        req = pb.MatchRequest(session=session, prompts=[pb.Prompt(tokens=p) for p in rng.sample(prompts, BATCH)])
        return timed(stub.Match, req)

    def insert():
        i = rng.choice([k for k, p in enumerate(side.pages_of) if p is not None])
        tokens = prompts[i] + side.rng.integers(1, 1 << 30, size=PAGE, dtype=np.int32).tobytes()
        pages = side.pages_of[i] + side.pages(1)
        return timed(stub.Insert, pb.InsertRequest(session=session, tokens=tokens, device_pages=pages))

    return {"echo": echo, "match": match, "match_batch32": match32, "insert": insert}


def _loadbacks(side: Side, count: int) -> list[float]:
    """Evict enough for `count` prompts to be host-only, then time LoadBack + its ack each."""
    stub, session = side.stub, side.session
    ev = stub.Evict(pb.EvictRequest(session=session, num_pages=count * PROMPT_PAGES))
    side.free += list(unpack(ev.freed_pages))
    results = stub.Match(pb.MatchRequest(session=session, prompts=[pb.Prompt(tokens=p) for p in side.prompts])).results
    out = []
    for i, r in enumerate(results):
        full = r.device_tokens == PROMPT_PAGES * PAGE
        side.pages_of[i] = r.device_pages if full else None
        if not r.host_tokens or len(out) >= count:
            continue
        pages = side.pages(r.host_tokens // PAGE)
        t = time.perf_counter()
        lb = stub.LoadBack(pb.LoadBackRequest(session=session, node=r.host_node, device_pages=pages))
        ack = side.acks.ack(lb.transfer)
        out.append(time.perf_counter() - t)
        if ack.code or ack.load_failed:
            raise RuntimeError(f"load-back {lb.transfer} failed: {ack.message}")
        side.free += list(unpack(lb.unused_pages))
        if lb.device_tokens == PROMPT_PAGES * PAGE:
            side.pages_of[i] = lb.device_pages
    return out


def run(mode: str, plot_dir=None, profiler=None) -> Section:
    sec = Section("rpc", "RPC (real daemon, generated stubs)", intro=__doc__.split("\n\n", 1)[1].replace("\n", " "))
    rng = random.Random(2)
    with DaemonProcess("--host-pool-size", "1GiB", tcp=True) as d:
        progress(f"rpc: daemon pid {d.pid} on {d.unix} and {d.tcp}; warming {PROMPTS[mode]} prompts per transport")
        sides = {"unix": Side("bench-unix", d.unix, PROMPTS[mode], 1), "tcp": Side("bench-tcp", d.tcp, PROMPTS[mode], 2)}
        loop, streams, floor = asyncio.new_event_loop(), None, None
        stream_lat = {op: [] for op in rpc_stream.OPS}
        try:
            streams = rpc_stream.StreamClients(d.unix, LAYOUT, sides["unix"].prompts, PROMPT_PAGES, loop)
            floor = rpc_stream.Floor(len(sides["unix"].payload))
            rpc_stream.measure(sides["unix"], streams, floor, rng, 10, {op: [] for op in rpc_stream.OPS})  # warm-up
            lat = {(t, op): [] for t in sides for op in ("echo", "match", "match_batch32", "insert", "loadback_ack")}
            ops = {t: _ops(s, rng) for t, s in sides.items()}
            for t, s in sides.items():  # warm-up: connections, caches
                for fn in ops[t].values():
                    for _ in range(10):
                        fn()
            for r in range(ROUNDS[mode]):
                progress(f"rpc: round {r + 1}/{ROUNDS[mode]}")
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for t in order:
                    names = list(ops[t])
                    for i in range(CALLS[mode]):
                        for op in (names if i % 2 == 0 else reversed(names)):
                            lat[(t, op)].append(ops[t][op]())
                    lat[(t, "loadback_ack")] += _loadbacks(sides[t], LOADS[mode])
                rpc_stream.measure(sides["unix"], streams, floor, rng, CALLS[mode], stream_lat)
            violations = []
            for t, s in sides.items():
                bad = s.stub.CheckInvariants(pb.CheckInvariantsRequest()).violations
                violations += [v.message for v in bad]
            if violations:
                raise RuntimeError(f"daemon invariants broken during rpc bench: {violations[:3]}")
            _report(sec, lat, sides)
            rpc_stream.report(sec, stream_lat)
            missed = [f for f in sec.figures if f.met is False]
            if profiler is not None and missed:
                progress("rpc: profiling the daemon under Match and under Echo (py-spy)")
                for op in ("match", "echo"):
                    fn = ops["unix"][op]
                    profiler.record(f"rpc.daemon.{op}", d.pid, fn, f"daemon under back-to-back unix {op} calls")
        finally:
            for closing in (streams, floor):
                if closing is not None:
                    closing.close()
            loop.close()
            for s in sides.values():
                s.close()
    return sec


def _report(sec: Section, lat, sides) -> None:
    rows = []
    for t in sides:
        e50, e99 = percentile(lat[(t, "echo")], 50) * 1e6, percentile(lat[(t, "echo")], 99) * 1e6
        for op in ("echo", "match", "match_batch32", "insert", "loadback_ack"):
            xs = lat[(t, op)]
            p50, p99 = percentile(xs, 50) * 1e6, percentile(xs, 99) * 1e6
            rows.append([t, op, len(xs), f"{fmt(p50)} us", f"{fmt(p99)} us", f"{fmt(p50 / e50)}x", f"{fmt(p99 / e99)}x"])
            if op == "echo":
                continue
            limit = TARGETS.get(op)
            target = f"p50 <= {limit:g}x echo" if limit else ""
            sec.add(Figure(f"rpc.{t}.{op}.p50", p50, "us", "echo", e50, target,
                           (p50 / e50 <= limit) if limit else None))
            sec.add(Figure(f"rpc.{t}.{op}.p99", p99, "us", "echo", e99))
    sec.tables.append(Table(
        "Latency per call (client-side, includes the Python stub)",
        ["transport", "operation", "calls", "p50", "p99", "p50 / echo p50", "p99 / echo p99"], rows,
        "echo: 8 KiB payload each way. match: one 2k-token prompt, full device hit. match_batch32: 32 "
        "such prompts in one call. insert: a cached 2k prompt plus one new page (write_through: one page "
        "backed up). loadback_ack: LoadBack of a 2k prompt evicted to host + its ack on the Acks stream."))
