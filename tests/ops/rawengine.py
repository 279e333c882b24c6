"""A minimal engine for the operability tests, on the generated stubs alone.

It registers shared-memory KV buffers (the engine side's `ShmKvBuffers`), keeps its own
free list of device pages, and runs one long-lived Acks stream. `cycle()` is the known
workload the metrics tests count on: insert N tokens, evict them to host, match them
(host hit), load them back into fresh device pages and acknowledge the transfer.
"""

import itertools
import queue
import threading
import time
from array import array

import grpc
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

PAGE_SIZE = 4
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=PAGE_SIZE)
RPC_TIMEOUT_S = 10.0
_bases = itertools.count(1)


def pack(values) -> bytes:
    return array("i", values).tobytes()


def unpack(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return list(out)


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
        self.buffers = ShmKvBuffers.create(LAYOUT, num_pages)
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.RadixKVStub(self.channel)
        self.free = list(range(num_pages - 1))
        self.sentinel = num_pages - 1
        for b in range(LAYOUT.num_buffers):
            self.buffers.page_view(b)[self.sentinel].fill_(0xA5)
        reply = self.stub.Register(pb.RegisterRequest(
            namespace=namespace, backend="shm", num_device_pages=num_pages,
            layout=pb.KvLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                               head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, page_size=PAGE_SIZE),
            buffers=[pb.DeviceBuffer(handle=s.handle, offset=s.offset, size=s.size)
                     for s in self.buffers.specs()],
            write_policy=write_policy, host_pool_pages=host_pool_pages, engine="tests/ops rawengine"),
            timeout=RPC_TIMEOUT_S)
        self.session = reply.session
        self.acks = AckStream(self.stub, self.session)

    # -- pages ------------------------------------------------------------------------

    def _take(self, n: int) -> list[int]:
        if n > len(self.free):
            self.evict(n - len(self.free))
        if n > len(self.free):
            raise RuntimeError(f"engine needs {n} free device pages, has {len(self.free)}")
        pages, self.free = self.free[:n], self.free[n:]
        return pages

    def _give(self, data: bytes) -> None:
        self.free += unpack(data)

    # -- operations -------------------------------------------------------------------

    def insert(self, tokens: list[int]) -> int:
        """Insert whole pages of `tokens` (filling their device pages first); returns
        the tokens that were already cached."""
        pages = self._take(len(tokens) // PAGE_SIZE)
        for b in range(LAYOUT.num_buffers):
            view = self.buffers.page_view(b)
            for p in pages:
                view[p].fill_(p % 251)
        reply = self.stub.Insert(pb.InsertRequest(session=self.session, tokens=pack(tokens),
                                                  device_pages=pack(pages)), timeout=RPC_TIMEOUT_S)
        self._give(reply.redundant_pages)
        return reply.cached_tokens

    def match(self, tokens: list[int]) -> pb.MatchResult:
        return self.stub.Match(pb.MatchRequest(session=self.session, prompts=[pb.Prompt(tokens=pack(tokens))]),
                               timeout=RPC_TIMEOUT_S).results[0]

    def evict(self, num_pages: int) -> int:
        reply = self.stub.Evict(pb.EvictRequest(session=self.session, num_pages=num_pages),
                                timeout=RPC_TIMEOUT_S)
        self._give(reply.freed_pages)
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
        self._give(reply.unused_pages)
        if reply.transfer:
            answer = self.acks.ack(reply.transfer)
            if answer.code != 0 or answer.load_failed:
                self._give(answer.failed_pages)
                raise RuntimeError(f"ack {reply.transfer}: code {answer.code} {answer.message}")
        return reply.loaded_tokens

    def cycle(self, num_tokens: int) -> int:
        """Insert `num_tokens` fresh tokens, evict everything the cache holds on device,
        load the tokens back and acknowledge. Returns the tokens loaded back."""
        tokens = fresh_tokens(num_tokens)
        self.insert(tokens)
        self.evict(len(self.free) + num_tokens // PAGE_SIZE + 64)
        return self.load_back(tokens)

    def sentinel_intact(self) -> bool:
        return all(bool((self.buffers.page_view(b)[self.sentinel] == 0xA5).all())
                   for b in range(LAYOUT.num_buffers))

    def close(self) -> None:
        """End the ack stream (closing the session) and the channel; keep the shm segment."""
        self.acks.close()
        self.channel.close()

    def release_memory(self) -> None:
        self.buffers.close()
