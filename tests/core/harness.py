"""Test harness for the pure core: a copier over two simulated memories.

Each device or host page "holds" the identity of the prefix page written into it: the
bytes `extra_key + tokens[:end of that page]`. Copies move identities only when a test
completes them, so a page read too early, or freed while a copy still reads it, shows
up as a wrong identity. This is the seam the core is designed around (the `Copier`);
the real data path is tested against the same core in tests/service.
"""

from radixkv_server.core import CacheConfig, HierarchicalCache
from radixkv_server.core.pages import pack, unpack

GARBAGE = b"<garbage>"


def tokens(*values) -> bytes:
    return pack(values)


def identity(prompt: bytes, extra_key: bytes, page: int, page_size: int) -> bytes:
    return extra_key + b"|" + prompt[: (page + 1) * page_size * 4]


class MemoryCopier:
    def __init__(self):
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.storage: dict[bytes, bytes] = {}
        self.pending: dict[int, tuple[str, list, list]] = {}

    def load(self, transfer, host_pages, device_pages):
        self.pending[transfer] = ("load", list(unpack(host_pages)), list(unpack(device_pages)))

    def backup(self, transfer, device_pages, host_pages):
        self.pending[transfer] = ("backup", list(unpack(device_pages)), list(unpack(host_pages)))

    def store(self, transfer, host_pages, keys):
        self.pending[transfer] = ("store", list(unpack(host_pages)), list(keys))

    def fetch(self, transfer, keys, host_pages, ahead=None):
        self.pending[transfer] = ("fetch", list(keys), list(unpack(host_pages)))

    def complete(self, cache: HierarchicalCache, transfer: int, fail: bool = False):
        kind, src, dst = self.pending.pop(transfer)
        if kind == "fetch":
            n = 0
            while not fail and n < len(src) and src[n] in self.storage:
                self.host[dst[n]] = self.storage[src[n]]
                n += 1
            return cache.on_fetch_done(transfer, n, "injected failure" if fail else None)
        source, target = {"load": (self.host, self.device), "backup": (self.device, self.host),
                          "store": (self.host, self.storage)}[kind]
        for s, d in zip(src, dst):
            if not fail:
                target[d] = source.get(s, GARBAGE)
            elif kind != "store":
                target[d] = GARBAGE
        return cache.on_copy_done(transfer, "injected failure" if fail else None)

    def complete_all(self, cache: HierarchicalCache):
        outcomes = {}
        while self.pending:
            tid = min(self.pending)
            outcomes[tid] = self.complete(cache, tid)
        return outcomes


def make_cache(policy="write_through", page_size=2, device_pages=64, host_pages=64,
               eviction="lru", threshold=2, storage="off"):
    copier = MemoryCopier()
    cache = HierarchicalCache(
        CacheConfig(page_size=page_size, write_policy=policy, eviction_policy=eviction,
                    write_through_threshold=threshold, storage=storage, storage_salt=b"test-salt"),
        copier, num_device_pages=device_pages, host_pages=host_pages)
    return cache, copier


class Engine:
    """Owns device pages and writes identities into them, like an engine's prefill."""

    def __init__(self, cache: HierarchicalCache, copier: MemoryCopier):
        self.cache = cache
        self.copier = copier
        self.free = list(range(cache.device.num_pages - 1, -1, -1))

    def alloc(self, n: int) -> list[int]:
        if len(self.free) < n:
            raise RuntimeError(f"test engine out of device pages ({len(self.free)} < {n})")
        return [self.free.pop() for _ in range(n)]

    def give(self, pages: bytes) -> None:
        self.free.extend(unpack(pages))

    def compute(self, prompt: bytes, extra_key: bytes, first_page: int, pages: list[int]) -> None:
        ps = self.cache.config.page_size
        for i, p in enumerate(pages):
            self.copier.device[p] = identity(prompt, extra_key, first_page + i, ps)

    def insert(self, prompt: bytes, extra_key: bytes = b""):
        """Match, compute everything past the device prefix, insert; returns the result."""
        ps = self.cache.config.page_size
        m = self.cache.match(prompt, extra_key)
        n_pages = len(prompt) // 4 // ps
        have = m.device_tokens // ps
        new = self.alloc(n_pages - have)
        self.compute(prompt, extra_key, have, new)
        result = self.cache.insert(prompt[: n_pages * ps * 4], m.device_pages + pack(new), extra_key)
        self.give(result.redundant_pages)
        return result

    def verify(self, prompt: bytes, extra_key: bytes, device_pages: bytes) -> list[int]:
        """Positions whose device page does not hold that prefix page."""
        ps = self.cache.config.page_size
        return [i for i, p in enumerate(unpack(device_pages))
                if self.copier.device.get(p) != identity(prompt, extra_key, i, ps)]
