"""A minimal engine for the operability tests that speaks raw gRPC, on purpose.

Its device side is the shared engine double (`tests.support.engine`: shared-memory KV
buffers holding pattern KV, a page pool). What differs on purpose: every call goes
through the generated stubs alone, with its own long-lived Acks stream, as an engine
without the Python client would, so the tests can also send what `radixkv.Client`
refuses to (an unknown session, a late Register). `cycle()` is the known workload the
metrics tests count on: insert N tokens, evict them to host, match them (host hit),
load them back into fresh device pages and acknowledge the transfer.
"""

import itertools
import queue
import threading
import time

import grpc
from radixkv.sim.kv import page_keys
from radixkv.types import pack, unpack
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

from tests.support.engine import LAYOUT, PS, EngineDouble

PAGE_SIZE = PS
RPC_TIMEOUT_S = 10.0
_bases = itertools.count(1)


def fresh_tokens(n: int) -> list[int]:
    """n tokens no other call of this process returns (distinct prompts, no shared prefix)."""
    base = next(_bases) * 1_000_000
    return list(range(base, base + n))


class AckStream:
    """The session's Acks stream: `ack(transfer)` sends one ack and waits for its answer."""

    def __init__(self, stub: pb_grpc.RadixKVStub, session: str):
        self._session = session
        self._requests: queue.Queue = queue.Queue()
        self._answers: dict[int, pb.AckResponse] = {}
        self._cond = threading.Condition()
        self.ended = False
        self.error: grpc.RpcError | None = None
        self._call = stub.Acks(self._send())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _send(self):
        while (item := self._requests.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for answer in self._call:
                with self._cond:
                    self._answers[answer.transfer] = answer
                    self._cond.notify_all()
        except grpc.RpcError as e:
            self.error = e
        finally:
            with self._cond:
                self.ended = True
                self._cond.notify_all()

    def ack(self, transfer: int, timeout: float = RPC_TIMEOUT_S) -> pb.AckResponse:
        self._requests.put(pb.AckRequest(session=self._session, transfer=transfer))
        deadline = time.monotonic() + timeout
        with self._cond:
            while transfer not in self._answers:
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    raise ConnectionError(f"no answer to ack {transfer} (stream ended: {self.ended}, "
                                          f"error: {self.error})")
                self._cond.wait(left)
            return self._answers.pop(transfer)

    def close(self, timeout: float = RPC_TIMEOUT_S) -> None:
        """Half-close and wait for the daemon to end the stream (it closes the session)."""
        self._requests.put(None)
        self._reader.join(timeout)


class RawEngine:
    """One engine session on namespace `namespace`, with `num_pages` shm device pages. The
    last device page is a sentinel the daemon is never given: `sentinel_intact()` tells
    whether its bytes survived."""

    def __init__(self, target: str, namespace: str, num_pages: int = 64, host_pool_pages: int = 256,
                 write_policy: str = "write_back"):
        self.device = EngineDouble(LAYOUT, num_pages)
        self.pool = self.device.pool
        pages = self.pool.allocate(num_pages)
        self.sentinel = pages.pop()  # stays in use: never given to the daemon
        self.pool.free(reversed(pages), "start")
        for b in range(LAYOUT.num_buffers):
            self.device.page_view(b)[self.sentinel].fill_(0xA5)
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.RadixKVStub(self.channel)
        reply = self.stub.Register(pb.RegisterRequest(
            namespace=namespace, backend="shm", num_device_pages=num_pages,
            layout=pb.KvLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                               head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, page_size=PAGE_SIZE),
            buffers=[pb.DeviceBuffer(handle=s.handle, offset=s.offset, size=s.size)
                     for s in self.device.buffers.specs],
            write_policy=write_policy, host_pool_pages=host_pool_pages, engine="tests/ops rawengine"),
            timeout=RPC_TIMEOUT_S)
        self.session = reply.session
        self.acks = AckStream(self.stub, self.session)

    def _take(self, n: int) -> list[int]:
        """`n` device pages, evicting when short (the double's `allocate`, with raw Evict)."""
        if n > self.pool.num_free:
            self.evict(n - self.pool.num_free)
        if not self.pool.can_allocate(n):
            raise RuntimeError(f"engine needs {n} free device pages, has {self.pool.num_free}")
        return self.pool.allocate(n)

    # -- operations -------------------------------------------------------------------

    def insert(self, tokens: list[int]) -> int:
        """Insert whole pages of `tokens` (writing their pattern KV first); returns the
        tokens that were already cached."""
        packed = pack(tokens)
        pages = self._take(len(tokens) // PAGE_SIZE)
        self.device.kv.write(pages, page_keys(packed, PAGE_SIZE)[:len(pages)])
        reply = self.stub.Insert(pb.InsertRequest(session=self.session, tokens=packed,
                                                  device_pages=pack(pages)), timeout=RPC_TIMEOUT_S)
        redundant = set(unpack(reply.redundant_pages))
        self.pool.free(redundant, "Insert redundant")
        self.pool.to_cache([p for p in pages if p not in redundant], "Insert")
        return reply.cached_tokens

    def match(self, tokens: list[int]) -> pb.MatchResult:
        return self.stub.Match(pb.MatchRequest(session=self.session, prompts=[pb.Prompt(tokens=pack(tokens))]),
                               timeout=RPC_TIMEOUT_S).results[0]

    def evict(self, num_pages: int) -> int:
        reply = self.stub.Evict(pb.EvictRequest(session=self.session, num_pages=num_pages),
                                timeout=RPC_TIMEOUT_S)
        self.pool.from_cache(unpack(reply.freed_pages), "Evict")
        return len(reply.freed_pages) // 4

    def load_back(self, tokens: list[int]) -> int:
        """Match `tokens`, load their host-only part into fresh pages and acknowledge the
        transfer; returns the tokens loaded (0 when nothing sat on host only)."""
        m = self.match(tokens)
        if not m.host_tokens:
            return 0
        pages = self._take(m.host_tokens // PAGE_SIZE)
        reply = self.stub.LoadBack(pb.LoadBackRequest(session=self.session, node=m.host_node,
                                                      device_pages=pack(pages)), timeout=RPC_TIMEOUT_S)
        unused = set(unpack(reply.unused_pages))
        self.pool.free(unused, "LoadBack unused")
        self.pool.to_cache([p for p in pages if p not in unused], "LoadBack used")
        if reply.transfer:
            answer = self.acks.ack(reply.transfer)
            if answer.code != 0 or answer.load_failed:
                self.pool.from_cache(unpack(answer.failed_pages), "failed load")
                raise RuntimeError(f"ack {reply.transfer}: code {answer.code} {answer.message}")
        return reply.loaded_tokens

    def cycle(self, num_tokens: int) -> int:
        """Insert `num_tokens` fresh tokens, evict everything the cache holds on device,
        load the tokens back and acknowledge. Returns the tokens loaded back."""
        tokens = fresh_tokens(num_tokens)
        self.insert(tokens)
        self.evict(self.pool.num_pages)  # more than the cache holds: all of it
        return self.load_back(tokens)

    def sentinel_intact(self) -> bool:
        return all(bool((self.device.page_view(b)[self.sentinel] == 0xA5).all())
                   for b in range(LAYOUT.num_buffers))

    def close(self) -> None:
        """End the ack stream (closing the session) and the channel; keep the shm segment."""
        self.acks.close()
        self.channel.close()

    def release_memory(self) -> None:
        self.device.buffers.close()
