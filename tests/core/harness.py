"""Test harness for the pure core: a copier over two simulated memories.

Each device or host page "holds" the identity of the prefix page written into it: the
bytes `extra_key + tokens[:end of that page]`. Copies move identities only when a test
completes them, so a page read too early, or freed while a copy still reads it, shows
up as a wrong identity. Pages handed back to the engine and host pages freed are
overwritten with poison (`Engine.give`, `poison_freed_host_pages`), so a page read after
it was freed shows wrong bytes even when nothing reused it. Given a `random.Random`, the
copier reads the source of about half its copies when they start (a snapshot, as a real
copy may), and half its fetches read storage ahead, before a loss can empty it. This is the seam the core is designed around (the `Copier`);
the real data path is tested against the same core in tests/service.
"""

import random

from radixkv_server.core import CacheConfig, HierarchicalCache
from radixkv_server.core.host_allocator import HostAllocator
from radixkv_server.core.pages import pack, unpack

GARBAGE = b"<garbage>"
ENGINE_POISON = b"<given back to the engine>"
HOST_POISON = b"<freed host page>"


def tokens(*values) -> bytes:
    return pack(values)


def identity(prompt: bytes, extra_key: bytes, page: int, page_size: int) -> bytes:
    return extra_key + b"|" + prompt[: (page + 1) * page_size * 4]


def read_run(storage: dict, keys) -> list:
    """What a storage read of `keys` gets: the values of the leading keys it holds."""
    out = []
    for key in keys:
        if key not in storage:
            break
        out.append(storage[key])
    return out


class MemoryCopier:
    def __init__(self, rnd: random.Random | None = None):
        self.rnd = rnd  # None: every copy reads its source when it completes
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.storage: dict[bytes, bytes] = {}
        self.pending: dict[int, tuple[str, list, list]] = {}
        self.read_at_start: dict[int, list] = {}  # transfer -> what it read when it started

    def load(self, transfer, host_pages, device_pages):
        self._start(transfer, "load", list(unpack(host_pages)), list(unpack(device_pages)))

    def backup(self, transfer, device_pages, host_pages):
        self._start(transfer, "backup", list(unpack(device_pages)), list(unpack(host_pages)))

    def store(self, transfer, host_pages, keys):
        self._start(transfer, "store", list(unpack(host_pages)), list(keys))

    def fetch(self, transfer, keys, host_pages, ahead=None):
        self._start(transfer, "fetch", list(keys), list(unpack(host_pages)))

    def read_host(self, page: int):
        return self.host.get(page, GARBAGE)

    def write_host(self, page: int, value) -> None:
        self.host[page] = value

    def _read(self, kind: str, src: list) -> list:
        """What the copy reads from its source now."""
        if kind == "fetch":
            return read_run(self.storage, src)
        if kind == "backup":
            return [self.device.get(p, GARBAGE) for p in src]
        return [self.read_host(p) for p in src]

    def _start(self, transfer: int, kind: str, src: list, dst: list) -> None:
        self.pending[transfer] = (kind, src, dst)
        if self.rnd is not None and self.rnd.random() < 0.5:
            self.read_at_start[transfer] = self._read(kind, src)

    def complete(self, cache: HierarchicalCache, transfer: int, fail: bool = False, short: int | None = None):
        """Finish the copy: it reads its source now unless it read it at start. A store
        writes storage only now; a fetch that fails reads nothing, and one cut `short`
        reports at most that many pages."""
        kind, src, dst = self.pending.pop(transfer)
        got = self.read_at_start.pop(transfer, None)
        if got is None:
            got = self._read(kind, src)
        error = "injected failure" if fail else None
        if kind == "fetch":
            n = 0 if fail else len(got) if short is None else min(len(got), short)
            for page, value in zip(dst[:n], got):
                self.write_host(page, value)
            return cache.on_fetch_done(transfer, n, error)
        for value, d in zip(got, dst):
            if kind == "store":
                if not fail:
                    self.storage[d] = value
            elif kind == "load":
                self.device[d] = GARBAGE if fail else value
            else:
                self.write_host(d, GARBAGE if fail else value)
        return cache.on_copy_done(transfer, error)

    def complete_all(self, cache: HierarchicalCache):
        outcomes = {}
        while self.pending:
            tid = min(self.pending)
            outcomes[tid] = self.complete(cache, tid)
        return outcomes


def poison_freed_host_pages(host: HostAllocator, poison) -> None:
    """Have the allocator call `poison(page)` for each host page freed, before it is
    free: a copy or node still reading it afterwards gets wrong bytes."""
    free = host.free

    def freeing(pages: bytes) -> None:
        for page in unpack(pages):
            poison(page)
        free(pages)
    host.free = freeing


def make_cache(policy="write_through", page_size=2, device_pages=64, host_pages=64,
               eviction="lru", threshold=2, storage="off", rnd: random.Random | None = None):
    """A cache over a `MemoryCopier` (given `rnd`: copies read at start or at completion
    at random, and freed host pages are poisoned)."""
    copier = MemoryCopier(rnd)
    cache = HierarchicalCache(
        CacheConfig(page_size=page_size, write_policy=policy, eviction_policy=eviction,
                    write_through_threshold=threshold, storage=storage, storage_salt=b"test-salt"),
        copier, num_device_pages=device_pages, host_pages=host_pages)
    if rnd is not None:
        poison_freed_host_pages(cache.host, lambda page: copier.host.__setitem__(page, HOST_POISON))
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
        """Take pages back; they hold poison until written again."""
        for p in unpack(pages):
            self.copier.device[p] = ENGINE_POISON
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
