"""The randomized engine-managed test machine: tensor-parallel ranks saving and loading.

`tp` ranks of one engine (each with its own device memory) save prompts, one rank or
every rank in turn, a scheduler matches with leases, ranks load matched paths into
fresh pages from a random start page, copies complete (reading their source at start
or at completion), fail and get acknowledged in random order, host eviction runs, and
(with storage) prompts are prefetched, read ahead or at completion and sometimes short,
and the store loses everything now and then: storage keeps every rank's shard of a
page, so fetched pages may complete a node some rank's shard had not reached. Every
page "holds" an identity (the prefix page and the rank whose shard it is), and freed
host pages hold poison, so a load that reads a shard too early, a wrong rank's slice or
a freed page shows up as a wrong identity. After every step: `EngineTier.check_invariants()`
is empty, every rank's shard that arrived on host holds that rank's right identity,
every node counted as stored is in the store whole, and no device residency exists.
Used by test_core_engine_tier.py (for tp_size 1, 2 and 3).
"""

import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from radixkv_server.core import CacheConfig, HierarchicalCache, InvalidRequest, NotReady
from radixkv_server.core.engine_tier import EngineTier
from radixkv_server.core.pages import pack, unpack
from radixkv_server.core.transfers import TransferKind

from harness import GARBAGE, HOST_POISON, MemoryCopier, poison_freed_host_pages
from machine import start_prefetch

PAGE = 2
HOST_PAGES = 12
TP = 2

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=6)
extra_keys = st.sampled_from([b"", b"lora"])
ranks = st.integers(0, 5)  # taken modulo tp_size (1, 2 or 3)


def prompt_bytes(symbols) -> bytes:
    return pack([v for s in symbols for v in (s, s + 10)])


def shard(prefix: bytes, extra: bytes, rank: int) -> bytes:
    """What rank `rank`'s shard of the page ending `prefix` holds."""
    return b"%d|" % rank + extra + b"|" + prefix


class RankCopier:
    """The EngineCopier over simulated memories: host[(page, rank)], device[(rank, page)].
    Given a `random.Random`, about half the copies read their source when they start."""

    def __init__(self, rnd: random.Random | None = None):
        self.rnd = rnd
        self.host: dict[tuple[int, int], bytes] = {}
        self.device: dict[tuple[int, int], bytes] = {}
        self.pending: dict[int, tuple[str, int, list, list]] = {}
        self.read_at_start: dict[int, list] = {}

    def save(self, transfer, owner, device_pages, host_pages):
        self._start(transfer, ("save", owner, list(unpack(device_pages)), list(unpack(host_pages))))

    def load_into(self, transfer, owner, host_pages, device_pages):
        self._start(transfer, ("load", owner, list(unpack(host_pages)), list(unpack(device_pages))))

    def _read(self, kind: str, rank: int, src: list) -> list:
        if kind == "save":
            return [self.device.get((rank, s), GARBAGE) for s in src]
        return [self.host.get((s, rank), GARBAGE) for s in src]

    def _start(self, transfer: int, copy: tuple) -> None:
        self.pending[transfer] = copy
        if self.rnd is not None and self.rnd.random() < 0.5:
            self.read_at_start[transfer] = self._read(*copy[:3])

    def complete(self, tier: EngineTier, transfer: int, fail: bool) -> None:
        kind, rank, src, dst = self.pending.pop(transfer)
        got = self.read_at_start.pop(transfer, None)
        if got is None:
            got = self._read(kind, rank, src)
        for value, d in zip(got, dst):
            if kind == "save":
                self.host[(d, rank)] = GARBAGE if fail else value
            else:
                self.device[(rank, d)] = GARBAGE if fail else value
        tier.copied(transfer, "injected failure" if fail else None)


class ShardStore(MemoryCopier):
    """The storage tier of an engine-managed namespace: a stored page holds every rank's
    shard (read from, and fetched into, the ranks' host memory in `RankCopier`)."""

    def __init__(self, ranks: RankCopier, tp_size: int = TP, rnd: random.Random | None = None):
        super().__init__(rnd)
        self.ranks = ranks
        self.tp_size = tp_size

    def read_host(self, page: int) -> tuple:
        return tuple(self.ranks.host.get((page, r), GARBAGE) for r in range(self.tp_size))

    def write_host(self, page: int, shards: tuple) -> None:
        for r, got in enumerate(shards):
            self.ranks.host[(page, r)] = got


class EngineTierMachine(RuleBasedStateMachine):
    storage = "off"
    tp = TP

    def __init__(self):
        super().__init__()
        config = CacheConfig(page_size=PAGE, write_policy="write_back", storage=self.storage,
                             storage_salt=b"test-salt")
        self.rnd = random.Random(0)  # the copiers' timing, the order ranks save in
        self.copier = RankCopier(self.rnd)
        self.storage_copier = ShardStore(self.copier, self.tp, self.rnd)  # stores of complete nodes, prefetches
        self.cache = HierarchicalCache(config, self.storage_copier, num_device_pages=0, host_pages=HOST_PAGES)
        self.tier = EngineTier(self.cache.state, self.cache.host_space, self.copier, self.tp)
        poison_freed_host_pages(self.cache.host, self._poison_host_page)
        self.next_page = [0] * self.tp  # each rank allocates fresh device pages (never reused)
        self.loads: dict[int, tuple[int, list[bytes]]] = {}  # transfer -> (rank, expected shard per page)
        self.saves: set[int] = set()
        self.leases: list[int] = []

    def _poison_host_page(self, page: int) -> None:
        for rank in range(self.tp):
            self.copier.host[(page, rank)] = HOST_POISON

    @initialize(rnd=st.randoms(use_true_random=False))
    def use_random(self, rnd: random.Random) -> None:
        self.rnd = self.copier.rnd = self.storage_copier.rnd = rnd

    def _pages(self, rank: int, n: int) -> list[int]:
        first = self.next_page[rank]
        self.next_page[rank] += n
        return list(range(first, first + n))

    # -- engine requests ---------------------------------------------------------------

    @rule(symbols=prompts, extra=extra_keys, rank=ranks)
    def save(self, symbols, extra, rank):
        rank %= self.tp
        prompt = prompt_bytes(symbols)
        pages = self._pages(rank, len(symbols))
        for i, p in enumerate(pages):
            self.copier.device[(rank, p)] = shard(prompt[:(i + 1) * PAGE * 4], extra, rank)
        tid = self.tier.save(prompt, pack(pages), extra, owner=rank, rank=rank).transfer
        if tid:
            self.saves.add(tid)

    @rule(symbols=prompts, extra=extra_keys)
    def save_by_every_rank(self, symbols, extra):
        """Every rank saves the prompt, in any order, copies completing in between (the
        way a tensor-parallel engine's ranks report the same request)."""
        order = list(range(self.tp))
        self.rnd.shuffle(order)
        for rank in order:
            self.save(symbols, extra, rank)
            if self.copier.pending and self.rnd.random() < 0.3:
                self.complete_copy(self.rnd.randrange(1000), self.rnd.randrange(10))

    @rule(symbols=prompts, extra=extra_keys, rank=ranks, start=st.integers(0, 3), lease=st.booleans())
    def match_and_load(self, symbols, extra, rank, start, lease):
        rank %= self.tp
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
        if start > result.host_tokens // PAGE:  # past the node's path: refused, nothing changes
            with pytest.raises(InvalidRequest, match="is past node"):
                self.tier.load(result.host_node, pack(pages), start, owner=rank, rank=rank)
            return
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
        start_prefetch(self.cache, prompt_bytes(symbols), extra, pages)

    @rule(n=st.integers(0, 8))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @precondition(lambda self: self.storage_copier.pending)
    @rule(pick=st.integers(0, 1000), fail=st.booleans(), short=st.none() | st.integers(0, 3))
    def complete_store(self, pick, fail, short):
        """A store or a fetch completes (a fetch may read fewer pages than it asked for)."""
        tids = sorted(self.storage_copier.pending)
        self.storage_copier.complete(self.cache, tids[pick % len(tids)], fail, short)

    @precondition(lambda self: self.storage != "off")
    @rule(symbols=prompts, extra=extra_keys, n=st.integers(1, HOST_PAGES))
    def evict_and_prefetch(self, symbols, extra, n):
        """Host pressure sends complete nodes to storage and out, and a request fetches
        them back."""
        self.evict_host(n)
        for tid in [t for t, (kind, *_) in sorted(self.storage_copier.pending.items()) if kind == "store"]:
            self.storage_copier.complete(self.cache, tid)
        self.prefetch(symbols, extra, 6)

    @precondition(lambda self: self.storage != "off")
    @rule()
    def storage_lost(self):
        """The store restarted empty and the cache is told; fetches that read it before
        may land after."""
        self.storage_copier.storage.clear()
        self.cache.storage_lost()

    @precondition(lambda self: self.leases)
    @rule(pick=st.integers(0, 1000))
    def release(self, pick):
        self.cache.unlock(self.leases.pop(pick % len(self.leases)))

    # -- after every step --------------------------------------------------------------

    @invariant()
    def sound(self):
        assert self.tier.check_invariants() == []

    def _shards(self, node) -> list[list[bytes]]:
        """Per page of the node, the shard each rank must hold."""
        prefix = b"".join(n.key for n in reversed(node.path()))
        first = len(prefix) - len(node.key)
        ends = range(first + PAGE * 4, len(prefix) + 1, PAGE * 4)
        return [[shard(prefix[:end], node.extra_key, rank) for rank in range(self.tp)] for end in ends]

    @invariant()
    def arrived_shards_hold_their_rank(self):
        """Every rank's shard on host that is not missing, and that no save of that rank
        is still copying into, holds that rank's identity (a freed page holds poison)."""
        saving = {(n, self.tier.ranks[tid]) for tid, t in self.cache.transfers.items()
                  if t.kind is TransferKind.SAVE and tid in self.tier.ranks for n in t.nodes}
        for node in self.cache.tree.iter_nodes():
            s = node.full
            if s.host_pages is None:
                continue
            want = self._shards(node)
            for rank in range(self.tp):
                if s.shards_missing & (1 << rank) or (node, rank) in saving:
                    continue
                got = [self.copier.host.get((h, rank)) for h in unpack(s.host_pages)]
                assert got == [w[rank] for w in want], f"node {node.id}: rank {rank}'s shards are wrong"

    @invariant()
    def stored_nodes_are_in_storage(self):
        """A node counted as stored has every rank's shard of every page in the store (the
        fake store writes when a store completes and loses only what it tells of)."""
        for node in self.cache.tree.iter_nodes():
            if node.full.stored:
                got = [self.storage_copier.storage.get(k) for k in self.cache.storage_keys(node)]
                assert got == [tuple(w) for w in self._shards(node)], f"node {node.id} counts as stored; the store has {got}"

    def check_all(self) -> None:
        """Every @invariant, for walks that drive the machine without hypothesis."""
        self.sound()
        self.arrived_shards_hold_their_rank()
        self.stored_nodes_are_in_storage()

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


def walk(m: EngineTierMachine, rnd: random.Random, steps: int) -> None:
    """Drive `m` through `steps` random operations, checking its invariants after each
    (`rnd` also times the copiers' reads and orders the ranks' saves)."""
    m.use_random(rnd)
    storage = m.storage != "off"
    for _ in range(steps):
        op = rnd.randrange(11)
        syms = [rnd.randrange(4) for _ in range(rnd.randint(1, 6))]
        extra = rnd.choice([b"", b"lora"])
        if op == 0:
            m.save(syms, extra, rnd.randrange(m.tp))
        elif op == 1:
            m.save_by_every_rank(syms, extra)
        elif op == 2:
            m.match_and_load(syms, extra, rnd.randrange(m.tp), rnd.randrange(4), rnd.random() < 0.2)
        elif op in (3, 4) and m.copier.pending:
            m.complete_copy(rnd.randrange(1000), rnd.randrange(10))
        elif op == 5 and (m.loads or m.saves):
            m.ack(rnd.randrange(1000))
        elif op == 6:
            m.evict_host(rnd.randrange(9))
        elif op == 7 and m.leases:
            m.release(rnd.randrange(1000))
        elif op == 8 and m.storage_copier.pending:
            m.complete_store(rnd.randrange(1000), rnd.random() < 0.1, rnd.randrange(4) if rnd.random() < 0.2 else None)
        elif op == 9 and storage:
            m.evict_and_prefetch(syms, extra, rnd.randint(1, HOST_PAGES))
        elif op == 10 and storage and rnd.random() < 0.25:
            m.storage_lost()
        m.check_all()
