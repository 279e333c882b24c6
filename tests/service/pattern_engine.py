"""A minimal engine for service tests: shared-memory KV buffers filled with the
simulator's deterministic pattern, a client session, and byte checks on load-back."""

from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.sim.kv import KvPattern, page_keys
from radixkv.types import pack

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
PS = LAYOUT.page_size


def prompt(i: int, pages: int = 8) -> list[int]:
    return [1000 * i + t for t in range(pages * PS)]


class PatternEngine:
    def __init__(self, target: str, namespace: str = "model/tp0", num_pages: int = 128, **register):
        self.buffers = ShmKvBuffers.create(LAYOUT, num_pages)
        self.kv = KvPattern(LAYOUT, [self.buffers.buffer(i) for i in range(LAYOUT.num_buffers)], num_pages)
        self.client = Client(target, timeout=20)
        self.client.register(namespace, LAYOUT, self.buffers.specs(), num_pages, **register)
        self.free = list(range(num_pages - 1, -1, -1))

    def alloc(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def prefill(self, tokens: list[int]) -> None:
        """Compute every page of `tokens` and insert it."""
        packed = pack(tokens)
        pages = self.alloc(len(tokens) // PS)
        self.kv.write(pages, page_keys(packed, PS))
        r = self.client.insert(packed, pages)
        self.free.extend(r.redundant_pages)

    def load(self, tokens: list[int]) -> tuple[int, tuple[int, int]]:
        """Load back what the host holds of `tokens`; (tokens now on device, byte and
        chunk mismatches over them)."""
        packed = pack(tokens)
        [m] = self.client.match([packed])
        if m.host_tokens:
            lb = self.client.load_back(m.host_node, self.alloc(m.host_tokens // PS))
            self.free.extend(lb.unused_pages)
            outcomes = self.client.wait([lb.transfer, *lb.depends_on], timeout=20)
            assert all(o.ok for o in outcomes.values()), outcomes
            device_pages, n = list(lb.device_pages), lb.device_tokens
        else:
            device_pages, n = list(m.device_pages), m.device_tokens
        keys = page_keys(packed[: n * 4], PS)
        return n, self.kv.mismatches(device_pages, keys)

    def counters(self) -> dict:
        return dict(self.client.stats().namespaces[0].counters)

    def close(self) -> None:
        self.client.close()
        self.buffers.close()
