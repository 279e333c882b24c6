"""Part of section `rpc` (#15 point 1): what a Match costs an engine over the Session
stream (the client library with `stream=True`, asyncio and blocking), against today's
unary Match (what an engine pays through the blocking `Client`, and the bare generated
stub) and a raw Unix-socket ping-pong with a second Python process (8 KiB each way: the
floor of any IPC from Python here), call by call, interleaved, in the same run on the
same daemon.

Each client has its own namespace with the same warm tree as the unary side (the same
2k-token prompts, full device hits); every Match asks for one random prompt of them.
The target compares engine-visible costs (client library on both sides); the ratio to
the bare stub is reported beside it.
"""

import asyncio
import os
import socket
import subprocess
import sys
import time

from radixkv.aio import AsyncClient
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv_server.core.pages import pack

from .figures import Figure, Section, Table, fmt
from .timing import percentile

TARGET = 0.6  # stream Match p50 <= 0.6x unary Match p50 (#15)
OPS = ("floor", "unary_match_stub", "unary_match", "stream_echo", "stream_match", "stream_match_blocking")

_ECHO = """
import socket, sys
s = socket.socket(fileno=int(sys.argv[1])); n = int(sys.argv[2]); buf = bytearray(n); v = memoryview(buf)
while True:
    got = 0
    while got < n:
        k = s.recv_into(v[got:])
        if not k:
            sys.exit(0)
        got += k
    s.sendall(buf)
"""


class Floor:
    """A raw Unix-socket ping-pong of `size` bytes with a second Python process."""

    def __init__(self, size: int):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([sys.executable, "-c", _ECHO, str(theirs.fileno()), str(size)],
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        self.sock, self.payload = mine, os.urandom(size)
        self.view = memoryview(bytearray(size))

    def ping(self) -> float:
        t = time.perf_counter()
        self.sock.sendall(self.payload)
        got, n = 0, len(self.view)
        while got < n:
            got += self.sock.recv_into(self.view[got:])
        return time.perf_counter() - t

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


class StreamClients:
    """An AsyncClient and a blocking Client with `stream=True`, and a blocking Client
    without (unary, as engines call today), each registered on its own namespace warmed
    with `prompts` (whole device hits afterwards)."""

    def __init__(self, target: str, layout, prompts: list[bytes], prompt_pages: int, loop):
        self.loop, self.prompts = loop, prompts
        pages = len(prompts) * prompt_pages
        self.buffers = [ShmKvBuffers.create(layout, pages) for _ in range(3)]
        self.aio = loop.run_until_complete(self._warm_aio(target, layout, pages, prompt_pages))
        self.sync = Client(target, timeout=30, stream=True)
        self.unary = Client(target, timeout=30)
        for c, name, buffers in ((self.sync, "bench-stream-sync", self.buffers[1]),
                                 (self.unary, "bench-unary-client", self.buffers[2])):
            c.register(name, layout, buffers.specs(), pages, host_pool_pages=pages)
            for i, p in enumerate(prompts):
                c.insert(p, pack(range(i * prompt_pages, (i + 1) * prompt_pages)))

    async def _warm_aio(self, target: str, layout, pages: int, prompt_pages: int) -> AsyncClient:
        aio = AsyncClient(target, timeout=30, stream=True)  # on this loop
        await aio.register("bench-stream-aio", layout, self.buffers[0].specs(), pages, host_pool_pages=pages)
        for i, p in enumerate(self.prompts):
            await aio.insert(p, pack(range(i * prompt_pages, (i + 1) * prompt_pages)))
        return aio

    def close(self) -> None:
        self.loop.run_until_complete(self.aio.close())
        self.sync.close()
        self.unary.close()
        for b in self.buffers:
            b.close()


def measure(side, clients: StreamClients, floor: Floor, rng, calls: int, lat: dict) -> None:
    """`calls` of each op, interleaved call by call (order alternating), into `lat`."""
    from radixkv.v1 import radixkv_pb2 as pb

    stub, session, prompts, payload = side.stub, side.session, side.prompts, side.payload

    async def run() -> None:
        for i in range(calls):
            tokens = rng.choice(prompts)
            ops = list(OPS) if i % 2 == 0 else list(reversed(OPS))
            for op in ops:
                t = time.perf_counter()
                if op == "floor":
                    lat[op].append(floor.ping())
                    continue
                if op == "unary_match_stub":
                    stub.Match(pb.MatchRequest(session=session, prompts=[pb.Prompt(tokens=tokens)]))
                elif op == "unary_match":
                    clients.unary.match([tokens])
                elif op == "stream_echo":
                    await clients.aio.echo(payload)
                elif op == "stream_match":
                    [m] = await clients.aio.match([tokens])
                    assert m.device_tokens == len(tokens) // 4, "the stream's match missed its warm tree"
                else:
                    clients.sync.match([tokens])
                lat[op].append(time.perf_counter() - t)

    clients.loop.run_until_complete(run())


def report(sec: Section, lat: dict) -> None:
    p = {op: (percentile(lat[op], 50) * 1e6, percentile(lat[op], 99) * 1e6) for op in OPS}
    u50, u99 = p["unary_match"]
    f50, _ = p["floor"]
    s50, s99 = p["stream_match"]
    sec.add(Figure("rpc.stream.match.p50", s50, "us", "unary-match", u50,
                   f"p50 <= {TARGET:g}x unary Match, both through the client (#15)", s50 / u50 <= TARGET))
    sec.add(Figure("rpc.stream.match.p99", s99, "us", "unary-match", u99))
    sec.add(Figure("rpc.stream.match_vs_stub.p50", s50, "us", "unary-stub-match", p["unary_match_stub"][0]))
    b50, b99 = p["stream_match_blocking"]
    sec.add(Figure("rpc.stream.match_blocking.p50", b50, "us", "unary-match", u50))
    sec.add(Figure("rpc.stream.match_blocking.p99", b99, "us", "unary-match", u99))
    sec.add(Figure("rpc.stream.match_over_floor.p50", s50, "us", "raw-socket", f50))
    rows = [[op, len(lat[op]), f"{fmt(p50)} us", f"{fmt(p99)} us", f"{fmt(p50 / u50)}x", f"{fmt(p99 / u99)}x",
             f"{fmt(p50 / f50)}x"] for op, (p50, p99) in p.items()]
    sec.tables.append(Table(
        "Match over the Session stream (#15: engine-visible, unix socket)",
        ["call", "calls", "p50", "p99", "p50 / unary match p50", "p99 / unary match p99", "p50 / floor p50"], rows,
        "floor: raw Unix-socket ping-pong of 8 KiB with a second Python process (no gRPC). unary_match: "
        "Client.match (blocking, unary: what an engine pays today); unary_match_stub: Match on the bare "
        "generated stub (no request building, no result objects). stream_echo / stream_match: "
        "AsyncClient(stream=True), one call in flight, result objects built; stream_match_blocking: "
        "Client(stream=True). One 2k-token prompt, full device hit. Target: stream_match p50 <= "
        f"{TARGET:g}x unary_match p50."))


__all__ = ["OPS", "Floor", "StreamClients", "measure", "report"]
