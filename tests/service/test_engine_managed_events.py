"""KV events of an engine-managed namespace (the vLLM connector's mode, issue 13), from a
real daemon process over WatchEvents: a rank's saved pages are announced as CPU blocks
once on host, and removed when the daemon evicts them from its host pool for room."""

import grpc
from radixkv import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
NS = "vllm-model"
HOST_PAGES = 4
STREAM_DEADLINE_S = 30  # a bound on the whole stream, not a synchronisation: reads block until events come


def tokens(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * LAYOUT.page_size))


class CpuBlocks:
    """A WatchEvents reader keeping which CPU blocks were stored (hash -> token ids) and removed."""

    def __init__(self, target: str):
        self._channel = grpc.insecure_channel(target)
        self._call = pb_grpc.RadixKVStub(self._channel).WatchEvents(
            pb.WatchEventsRequest(namespace=NS, from_seq=0), timeout=STREAM_DEADLINE_S)
        self.stored: dict[int, list[int]] = {}
        self.removed: set[int] = set()

    def read_until(self, done) -> None:
        """Apply batches until `done(self)` holds; fails saying what arrived if it never does."""
        while not done(self):
            try:
                batch = next(self._call)
            except grpc.RpcError as e:
                raise AssertionError(f"the events never showed it ({e.code().name}); CPU blocks stored "
                                     f"{len(self.stored)}, removed {len(self.removed)}") from None
            for e in batch.events:
                if e.medium != "CPU":
                    continue
                if e.kind == pb.KvEvent.BLOCK_STORED:
                    per = len(e.token_ids) // len(e.block_hashes)
                    for i, h in enumerate(e.block_hashes):
                        self.stored[h] = list(e.token_ids[i * per:(i + 1) * per])
                elif e.kind == pb.KvEvent.BLOCK_REMOVED:
                    self.removed.update(e.block_hashes)

    def hashes_of(self, prompt: list[int]) -> set[int]:
        ps = LAYOUT.page_size
        pages = [prompt[i:i + ps] for i in range(0, len(prompt), ps)]
        return {h for h, t in self.stored.items() if t in pages}

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def test_an_engine_managed_save_and_its_host_eviction_arrive_as_cpu_events(daemon_factory):
    d = daemon_factory("--kv-events-watch", "true")
    buffers = ShmKvBuffers.create(LAYOUT, 16)
    engine = Client(d.target, timeout=10)
    events = CpuBlocks(d.target)
    try:
        engine.register(NS, LAYOUT, buffers.specs(), 16, device_tier="engine_managed", role="engine",
                        host_pool_pages=HOST_PAGES)
        first, second = tokens(0, 2), tokens(1000, 3)
        saved = engine.insert(pack(first), [0, 1], async_=True)
        assert engine.wait([saved.transfer], timeout=10)[saved.transfer].ok
        events.read_until(lambda e: len(e.hashes_of(first)) == 2)
        assert sorted(sum((events.stored[h] for h in events.hashes_of(first)), [])) == first
        [hit] = engine.match([pack(first)])
        assert hit.host_tokens == len(first)
        # 3 more pages into a 4-page pool: the daemon evicts the first prompt's (unleased) pages
        saved = engine.insert(pack(second), [2, 3, 4], async_=True)
        assert engine.wait([saved.transfer], timeout=10)[saved.transfer].ok
        events.read_until(lambda e: len(e.hashes_of(second)) == 3 and e.hashes_of(first) <= e.removed)
        assert not events.hashes_of(second) & events.removed
        [gone] = engine.match([pack(first)])
        assert gone.host_tokens == 0, "what the events removed is gone from the daemon's host tier too"
    finally:
        events.close()
        engine.close()
        buffers.close()
