"""The randomized engine-managed test machine: tensor-parallel ranks saving and loading.

`TP` ranks of one engine (each with its own device memory) save prompts, a scheduler
matches with leases, ranks load matched paths into fresh pages from a random start
page, copies complete, fail and get acknowledged in random order, host eviction runs,
and (with storage) prompts are prefetched: storage keeps every rank's shard of a page,
so fetched pages may complete a node some rank's shard had not reached. Every page "holds" an identity (the prefix page and the rank whose shard it
is), so a load that reads a shard too early, a wrong rank's slice or a freed page
shows up as a wrong identity. After every step: `EngineTier.check_invariants()` is
empty, every complete node holds every rank's right identity on host, and no device
residency exists. Used by test_core_engine_tier.py.
"""

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from radixkv_server.core import CacheConfig, HierarchicalCache, NotReady
from radixkv_server.core.engine_tier import EngineTier
from radixkv_server.core.pages import pack, unpack
from radixkv_server.core.transfers import TransferKind

from harness import GARBAGE, MemoryCopier

PAGE = 2
HOST_PAGES = 12
TP = 2

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=6)
extra_keys = st.sampled_from([b"", b"lora"])
ranks = st.integers(0, TP - 1)


def prompt_bytes(symbols) -> bytes:
    return pack([v for s in symbols for v in (s, s + 10)])


def shard(prefix: bytes, extra: bytes, rank: int) -> bytes:
    """What rank `rank`'s shard of the page ending `prefix` holds."""
    return b"%d|" % rank + extra + b"|" + prefix


class RankCopier:
    """The EngineCopier over simulated memories: host[(page, rank)], device[(rank, page)]."""

    def __init__(self):
        self.host: dict[tuple[int, int], bytes] = {}
        self.device: dict[tuple[int, int], bytes] = {}
        self.pending: dict[int, tuple[str, int, list, list]] = {}

    def save(self, transfer, owner, device_pages, host_pages):
        self.pending[transfer] = ("save", owner, list(unpack(device_pages)), list(unpack(host_pages)))

    def load_into(self, transfer, owner, host_pages, device_pages):
        self.pending[transfer] = ("load", owner, list(unpack(host_pages)), list(unpack(device_pages)))

    def complete(self, tier: EngineTier, transfer: int, fail: bool) -> None:
        kind, rank, src, dst = self.pending.pop(transfer)
        for s, d in zip(src, dst):
            if kind == "save":
                self.host[(d, rank)] = GARBAGE if fail else self.device.get((rank, s), GARBAGE)
            else:
                self.device[(rank, d)] = GARBAGE if fail else self.host.get((s, rank), GARBAGE)
        tier.copied(transfer, "injected failure" if fail else None)


class ShardStore(MemoryCopier):
    """The storage tier of an engine-managed namespace: a stored page holds every rank's
    shard (read from, and fetched into, the ranks' host memory in `RankCopier`)."""

    def __init__(self, ranks: RankCopier):
        super().__init__()
        self.ranks = ranks

    def complete(self, cache, transfer: int, fail: bool = False):
        kind, src, dst = self.pending[transfer]
        error = "injected failure" if fail else None
        if kind == "store":
            del self.pending[transfer]
            for host_page, key in zip(src if not fail else (), dst):
                self.storage[key] = tuple(self.ranks.host.get((host_page, r), GARBAGE) for r in range(TP))
            return cache.on_copy_done(transfer, error)
        if kind == "fetch":
            del self.pending[transfer]
            n = 0
            while not fail and n < len(src) and src[n] in self.storage:
                for r, got in enumerate(self.storage[src[n]]):
                    self.ranks.host[(dst[n], r)] = got
                n += 1
            return cache.on_fetch_done(transfer, n, error)
        return super().complete(cache, transfer, fail)


class EngineTierMachine(RuleBasedStateMachine):
    storage = "off"

    def __init__(self):
        super().__init__()
        config = CacheConfig(page_size=PAGE, write_policy="write_back", storage=self.storage,
                             storage_salt=b"test-salt")
        self.copier = RankCopier()
        self.storage_copier = ShardStore(self.copier)  # stores of complete nodes, prefetches
        self.cache = HierarchicalCache(config, self.storage_copier, num_device_pages=0, host_pages=HOST_PAGES)
        self.tier = EngineTier(self.cache.state, self.cache.host_space, self.copier, TP)
        self.next_page = [0] * TP  # each rank allocates fresh device pages (never reused)
        self.loads: dict[int, tuple[int, list[bytes]]] = {}  # transfer -> (rank, expected shard per page)
        self.saves: set[int] = set()
        self.leases: list[int] = []

    def _pages(self, rank: int, n: int) -> list[int]:
        first = self.next_page[rank]
        self.next_page[rank] += n
        return list(range(first, first + n))

    # -- engine requests ---------------------------------------------------------------

    @rule(symbols=prompts, extra=extra_keys, rank=ranks)
    def save(self, symbols, extra, rank):
        prompt = prompt_bytes(symbols)
        pages = self._pages(rank, len(symbols))
        for i, p in enumerate(pages):
            self.copier.device[(rank, p)] = shard(prompt[:(i + 1) * PAGE * 4], extra, rank)
        tid = self.tier.save(prompt, pack(pages), extra, owner=rank, rank=rank).transfer
        if tid:
            self.saves.add(tid)

    @rule(symbols=prompts, extra=extra_keys, rank=ranks, start=st.integers(0, 3), lease=st.booleans())
    def match_and_load(self, symbols, extra, rank, start, lease):
        prompt = prompt_bytes(symbols)
        result = self.cache.match(prompt, extra)
        complete = self.tier.complete_tokens(result.host_node)
        assert result.device_tokens == 0 and complete <= result.host_tokens
        if lease and result.host_tokens:
            self.cache.lock(result.host_node)
            self.leases.append(result.host_node)
        if not result.host_tokens:
            return
        want = max(complete // PAGE - start, 0)
        pages = self._pages(rank, want + 1)
        r = self.tier.load(result.host_node, pack(pages), start, owner=rank, rank=rank)
        loaded = r.loaded_tokens // PAGE
        assert loaded == want, "a load copies every complete page asked for"
        if r.transfer:
            expected = [shard(prompt[:(start + i + 1) * PAGE * 4], extra, rank) for i in range(loaded)]
            self.loads[r.transfer] = (rank, expected)

    @precondition(lambda self: self.copier.pending)
    @rule(pick=st.integers(0, 1000), fail=st.integers(0, 9))
    def complete_copy(self, pick, fail):
        tids = sorted(self.copier.pending)
        self.copier.complete(self.tier, tids[pick % len(tids)], fail == 0)

    @precondition(lambda self: self.loads or self.saves)
    @rule(pick=st.integers(0, 1000))
    def ack(self, pick):
        tids = sorted(self.loads.keys() | self.saves)
        tid = tids[pick % len(tids)]
        t = self.cache.transfers[tid]
        try:
            result = self.tier.finish(tid, owner=t.owner)
        except NotReady:
            return
        self.saves.discard(tid)
        if tid in self.loads:
            rank, expected = self.loads.pop(tid)
            got = [self.copier.device.get((rank, p)) for p in unpack(t.device_pages)]
            if result.error is None:
                assert got == expected, f"load {tid} of rank {rank} delivered the wrong shards"
            else:
                assert result.failed_pages == t.device_pages

    @precondition(lambda self: self.storage != "off")
    @rule(symbols=prompts, extra=extra_keys, pages=st.integers(1, 6))
    def prefetch(self, symbols, extra, pages):
        self.cache.start_prefetch(prompt_bytes(symbols), extra, pages)

    @rule(n=st.integers(0, 8))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @precondition(lambda self: self.storage_copier.pending)
    @rule(fail=st.booleans())
    def complete_store(self, fail):
        self.storage_copier.complete(self.cache, min(self.storage_copier.pending), fail)

    @precondition(lambda self: self.leases)
    @rule(pick=st.integers(0, 1000))
    def release(self, pick):
        self.cache.unlock(self.leases.pop(pick % len(self.leases)))

    # -- after every step --------------------------------------------------------------

    @invariant()
    def sound(self):
        assert self.tier.check_invariants() == []

    @invariant()
    def complete_nodes_hold_every_shard(self):
        for node in self.cache.tree.iter_nodes():
            s = node.full
            if s.shards_missing or any(self.cache.transfers[t].kind is TransferKind.SAVE for t in s.pins):
                continue
            prefix = b"".join(n.key for n in reversed(node.path()))
            first = len(prefix) - len(node.key)
            for i, h in enumerate(unpack(s.host_pages)):
                end = first + (i + 1) * PAGE * 4
                for rank in range(TP):
                    assert self.copier.host.get((h, rank)) == shard(prefix[:end], node.extra_key, rank), (
                        f"complete node {node.id} page {i}: rank {rank}'s shard is wrong")

    def teardown(self):
        while self.copier.pending:
            self.copier.complete(self.tier, min(self.copier.pending), False)
        for tid in sorted(self.loads.keys() | self.saves):
            self.tier.finish(tid)
        for node in self.leases:
            self.cache.unlock(node)
        self.cache.evict_host(HOST_PAGES)
        while self.storage_copier.pending:
            self.storage_copier.complete_all(self.cache)
            self.cache.evict_host(HOST_PAGES)
        assert not self.cache.transfers
        assert self.tier.check_invariants() == []
        assert self.cache.host.num_free == HOST_PAGES, "every host page comes back once nothing holds it"
