"""The randomized core test machine: an engine model driving the cache.

An engine model drives the cache the way a scheduler would (match, load back, compute,
insert, evict, lease) while copies complete, fail and get acknowledged in random order.
The copier reads some copies' sources when they start and the rest when they complete,
fetches read storage ahead or at completion and may come back short, and freed pages
hold poison (harness.py). After every step: `check_invariants()` is empty, the engine's
free pages plus the pages the cache holds are exactly the device pool, every device
page the cache hands out, every device page of the tree (but those a load is still
filling) and every valid host copy holds the identity of the prefix page it claims,
every node counted as stored is in storage with the right bytes, and leased prefixes
stay cached.
Used by test_core_stateful.py (shrinking examples and long seeded walks) and by
test_core_residency.py (the residency listener).
"""

import random

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from radixkv_server.core import NotReady
from radixkv_server.core.pages import pack, unpack
from radixkv_server.core.transfers import TransferKind

from harness import Engine, identity, make_cache

PAGE = 2
DEVICE_PAGES = 24
HOST_PAGES = 12

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=6)
extra_keys = st.sampled_from([b"", b"lora"])
shorts = st.none() | st.integers(0, 3)


def prompt_bytes(symbols) -> bytes:
    return pack([v for s in symbols for v in (s, s + 10)])


def node_identities(node, page_size: int) -> list[bytes]:
    """The identity each of the node's pages must hold, in order."""
    prompt = b"".join(n.key for n in reversed(node.path()))
    stride = page_size * 4
    first = (len(prompt) - len(node.key)) // stride
    return [identity(prompt, node.extra_key, i, page_size) for i in range(first, len(prompt) // stride)]


class CoreMachine(RuleBasedStateMachine):
    policy = "write_through"
    eviction = "lru"
    storage = "off"
    loses_storage = False  # whether `walk` has the store lose everything now and then

    def __init__(self):
        super().__init__()
        self.rnd = random.Random(0)  # the copier's timing and the restart's drain order
        self.cache, self.copier = make_cache(self.policy, page_size=PAGE, device_pages=DEVICE_PAGES,
                                             host_pages=HOST_PAGES, eviction=self.eviction,
                                             storage=self.storage, rnd=self.rnd)
        self.eng = Engine(self.cache, self.copier)
        self.loads: dict[int, tuple[bytes, bytes, bytes]] = {}  # transfer -> (prompt, extra, prefix pages)
        self.leases: list[tuple[int, bytes, bytes, int]] = []    # (node, prompt, extra, tokens)

    @initialize(rnd=st.randoms(use_true_random=False))
    def use_random(self, rnd: random.Random) -> None:
        self.rnd = self.copier.rnd = rnd

    # -- engine requests ---------------------------------------------------------------

    @rule(symbols=prompts, extra=extra_keys, lease=st.booleans())
    def insert(self, symbols, extra, lease):
        prompt = prompt_bytes(symbols)
        m = self.cache.match(prompt, extra)
        if not m.depends_on:
            assert self.eng.verify(prompt, extra, m.device_pages) == []
        have = m.device_tokens // PAGE
        need = len(symbols) - have
        if need > len(self.eng.free):
            return
        pages = self.eng.alloc(need)
        self.eng.compute(prompt, extra, have, pages)
        try:
            r = self.cache.insert(prompt, m.device_pages + pack(pages), extra)
        except NotReady:
            self.eng.give(pack(pages))
            return
        self.eng.give(r.redundant_pages)
        after = self.cache.match(prompt, extra)
        assert after.device_tokens == len(symbols) * PAGE
        assert self.eng.verify(prompt, extra, after.device_pages) == []
        if lease:
            self.cache.lock(r.node)
            self.leases.append((r.node, prompt, extra, len(symbols) * PAGE))

    @rule(symbols=prompts, extra=extra_keys, spare=st.integers(0, 2))
    def load_back(self, symbols, extra, spare):
        prompt = prompt_bytes(symbols)
        m = self.cache.match(prompt, extra)
        n = m.host_tokens // PAGE + spare
        if not m.host_tokens or n > len(self.eng.free):
            return
        lb = self.cache.load_back(m.host_node, pack(self.eng.alloc(n)))
        self.eng.give(lb.unused_pages)
        assert lb.device_tokens == m.device_tokens + lb.loaded_tokens
        if lb.transfer:
            self.loads[lb.transfer] = (prompt, extra, lb.device_pages)

    @rule(base=prompts, tails=st.lists(prompts, min_size=2, max_size=3), extra=extra_keys)
    def overlapping_loads(self, base, tails, extra):
        """Several requests sharing a host-only prefix load back in the same step."""
        for tail in tails:
            self.load_back(base + tail, extra, 0)

    @rule(pick=st.integers(0, 1000))
    def staged_load(self, pick):
        """Load a host-only parent, then its host-only child while the first copy runs:
        the second load depends on the first and pins the parent too."""
        nodes = sorted((n for n in self.cache.tree.iter_nodes()
                        if n.full.device_pages is None and n.parent.parent is not None
                        and n.parent.full.device_pages is None), key=lambda n: n.id)
        if not nodes:
            return
        node = nodes[pick % len(nodes)]
        prompt = b"".join(n.key for n in reversed(node.path()))
        for target in (node.parent, node):
            n = sum(len(x.key) for x in target.path() if x.full.device_pages is None) // 4 // PAGE
            if n > len(self.eng.free):
                return
            lb = self.cache.load_back(target.id, pack(self.eng.alloc(n)))
            self.eng.give(lb.unused_pages)
            if lb.transfer:
                self.loads[lb.transfer] = (prompt[: lb.device_tokens * 4], node.extra_key, lb.device_pages)

    @rule(symbols=prompts, extra=extra_keys, limit=st.integers(1, 6))
    def prefetch(self, symbols, extra, limit):
        """Ask storage how much of the prompt it holds past the cache, and fetch it."""
        if self.storage == "off":
            return
        prompt = prompt_bytes(symbols)
        keys = self.cache.storage_probe(prompt, extra).keys
        held = 0
        while held < len(keys) and keys[held] in self.copier.storage:
            held += 1
        start_prefetch(self.cache, prompt, extra, min(held, limit))

    @rule(symbols=prompts, extra=extra_keys, n=st.integers(1, HOST_PAGES))
    def evict_and_prefetch(self, symbols, extra, n):
        """Host pressure sends pages to storage and out, and a request fetches them back."""
        self.evict_host(n)
        for tid in [t for t, (kind, *_) in sorted(self.copier.pending.items()) if kind == "store"]:
            self.copier.complete(self.cache, tid)
        self.prefetch(symbols, extra, 6)

    # -- the data path and the engine's acks -----------------------------------------

    @precondition(lambda self: self.copier.pending)
    @rule(pick=st.integers(0, 1000), fail=st.integers(0, 9), short=shorts)
    def complete_copy(self, pick, fail, short=None):
        pending = sorted(self.copier.pending)
        outcome = self.copier.complete(self.cache, pending[pick % len(pending)], fail=fail == 0, short=short)
        self.eng.give(getattr(outcome, "freed_pages", b""))

    @precondition(lambda self: self.loads)
    @rule(pick=st.integers(0, 1000))
    def ack(self, pick):
        tid = sorted(self.loads)[pick % len(self.loads)]
        try:
            result = self.cache.finish_load_back(tid)
        except NotReady:
            return
        prompt, extra, prefix = self.loads.pop(tid)
        if result.error is None:
            assert not set(unpack(prefix)) & self.arriving(), "acknowledged before its prefix arrived"
            assert self.eng.verify(prompt, extra, prefix) == []
        else:
            self.eng.give(result.failed_pages)

    def arriving(self) -> set[int]:
        """Device pages that load-back copies still in flight will write."""
        return {p for kind, _, dst in self.copier.pending.values() if kind == "load" for p in dst}

    # -- pressure and leases -------------------------------------------------------------

    @rule(n=st.integers(0, 8))
    def evict_device(self, n):
        self.eng.give(self.cache.evict_device(n).freed_pages)

    @rule(n=st.integers(0, 8))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @precondition(lambda self: self.leases)
    @rule(pick=st.integers(0, 1000))
    def release(self, pick):
        node, *_ = self.leases.pop(pick % len(self.leases))
        self.cache.unlock(node)

    # -- the engine restarting -------------------------------------------------------------

    @rule()
    def engine_restarts(self):
        """The engine goes and a new one registers (the service's detach, then attach):
        leases released, then, until `drop_device` waits for nothing, copies complete in
        any order (some fail, and stores and fetches it does not wait for may land too)
        and copied loads are acknowledged; every device page is then forgotten, and the
        new engine has the whole pool."""
        for node, *_ in self.leases:
            self.cache.unlock(node)
        self.leases.clear()
        while self.cache.device_drop_waits_for():
            if self.loads and (not self.copier.pending or self.rnd.random() < 0.3):
                self.ack(self.rnd.randrange(1000))  # not ready while it, or a load it needs, copies
            else:
                assert self.copier.pending, "drop_device waits for copies no one runs"
                self.complete_copy(self.rnd.randrange(1000), self.rnd.randrange(10))
            self.check_all()
        self.cache.drop_device(DEVICE_PAGES)
        self.copier.device.clear()  # the old engine's memory: nothing in it is the new one's
        self.eng = Engine(self.cache, self.copier)

    @rule()
    def storage_lost(self):
        """The store restarted empty (a Redis server, a Mooncake master): what it held is
        gone, and the cache is told (`storage_lost`); stores in flight land after."""
        self.copier.storage.clear()
        self.cache.storage_lost()

    # -- checks --------------------------------------------------------------------------

    @invariant()
    def sound(self):
        assert self.cache.check_invariants() == []
        free = self.eng.free
        assert len(set(free)) == len(free)
        assert not set(free) & self.cache.device.held_pages()
        assert len(free) + self.cache.device.num_held == DEVICE_PAGES

    @invariant()
    def pages_hold_their_prefix(self):
        """Device pages of the tree (but those a load still fills) and valid host copies
        hold their page's identity: a page freed or handed back while the tree or a copy
        still used it holds poison."""
        filling = {n for t in self.cache.transfers.values()
                   if t.kind is TransferKind.LOAD and not t.copied for n in t.nodes}
        for node in self.cache.tree.iter_nodes():
            s = node.full
            want = None
            if s.device_pages is not None and node not in filling:
                want = node_identities(node, PAGE)
                got = [self.copier.device.get(p) for p in unpack(s.device_pages)]
                assert got == want, f"node {node.id}'s device pages hold {got}"
            if s.host_valid:
                want = want or node_identities(node, PAGE)
                got = [self.copier.host.get(p) for p in unpack(s.host_pages)]
                assert got == want, f"node {node.id}'s host copy holds {got}"

    @invariant()
    def stored_nodes_are_in_storage(self):
        """A node counted as stored has every page in the store, with the right bytes.
        The fake store writes when a store completes and never loses pages it was not
        told of (`storage_lost`), so nothing excuses a stored node the store lacks."""
        if self.storage == "off":
            return
        for node in self.cache.tree.iter_nodes():
            if node.full.stored:
                got = [self.copier.storage.get(k) for k in self.cache.storage_keys(node)]
                assert got == node_identities(node, PAGE), f"node {node.id} counts as stored; the store has {got}"

    @invariant()
    def leased_prefixes_stay_cached(self):
        for _, prompt, extra, n_tokens in self.leases:
            root = self.cache.tree.roots[extra]
            path, partial, _ = self.cache.tree.walk(root, prompt[: n_tokens * 4])
            assert partial is None and sum(len(n.key) for n in path) == n_tokens * 4

    def teardown(self):
        # Drain: every copy completes, every load is acknowledged, every lease released;
        # then the whole device pool can be evicted back to the engine.
        while self.copier.pending or self.loads:
            for outcome in self.copier.complete_all(self.cache).values():
                self.eng.give(getattr(outcome, "freed_pages", b""))
            for tid in sorted(self.loads):
                self.ack(sorted(self.loads).index(tid))
        for node, *_ in self.leases:
            self.cache.unlock(node)
        while self.cache.device.num_held:
            r = self.cache.evict_device(DEVICE_PAGES)
            self.eng.give(r.freed_pages)
            completed = self.copier.complete_all(self.cache)  # write-backs, and stores freeing host room
            for outcome in completed.values():
                self.eng.give(getattr(outcome, "freed_pages", b""))
            assert r.freed_pages or completed, "device pages stuck in the cache"
        assert sorted(self.eng.free) == list(range(DEVICE_PAGES))
        assert self.cache.check_invariants() == []

    def check_all(self) -> None:
        """Every @invariant, for walks that drive the machine without hypothesis."""
        self.sound()
        self.pages_hold_their_prefix()
        self.stored_nodes_are_in_storage()
        self.leased_prefixes_stay_cached()


def walk(m: CoreMachine, rnd: random.Random, steps: int) -> None:
    """Drive `m` through `steps` random operations, checking its invariants after each
    (`rnd` also times the copier's reads and orders the restart's drain)."""
    m.use_random(rnd)
    for _ in range(steps):
        op = rnd.randrange(14)
        syms = [rnd.randrange(4) for _ in range(rnd.randint(1, 6))]
        extra = rnd.choice([b"", b"lora"])
        if op == 0:
            m.insert(syms, extra, rnd.random() < 0.2)
        elif op == 1:
            m.load_back(syms, extra, rnd.randrange(3))
        elif op in (2, 3) and m.copier.pending:
            m.complete_copy(rnd.randrange(1000), rnd.randrange(10), rnd.randrange(4) if rnd.random() < 0.2 else None)
        elif op == 4 and m.loads:
            m.ack(rnd.randrange(1000))
        elif op == 5:
            m.evict_device(rnd.randrange(9))
        elif op == 6:
            m.evict_host(rnd.randrange(9))
        elif op == 7 and m.leases:
            m.release(rnd.randrange(1000))
        elif op == 9:
            m.staged_load(rnd.randrange(1000))
        elif op == 10:
            m.prefetch(syms, extra, rnd.randint(1, 6))
        elif op == 8:
            m.overlapping_loads(syms[:2], [[rnd.randrange(4)] * rnd.randint(1, 3) for _ in range(2)], extra)
        elif op == 11 and rnd.random() < 0.2:
            m.engine_restarts()
        elif op == 13 and m.storage != "off":
            m.evict_and_prefetch(syms, extra, rnd.randint(1, HOST_PAGES))
        elif op == 12 and m.loses_storage and m.storage != "off" and rnd.random() < 0.25:
            m.storage_lost()
        m.check_all()


def start_prefetch(cache, prompt: bytes, extra: bytes, pages: int) -> int:
    """As the service starts a waiting Prefetch (storage stays slow here): the whole run,
    or, where stores in flight must end first (NotReady names only stores), what fits."""
    try:
        return cache.start_prefetch(prompt, extra, pages)
    except NotReady as e:
        assert e.transfers and all(cache.transfers[t].kind is TransferKind.STORE for t in e.transfers)
        return cache.start_prefetch(prompt, extra, pages, partial=True)
