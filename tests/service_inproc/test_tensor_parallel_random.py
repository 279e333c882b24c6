"""A tensor-parallel engine on one managed-device namespace, driven at random: rank 0
inserts, evicts and loads back (a fifth of the loads fail, injected), while its ranks
leave and register again; the invariants are checked after every step, and every page
a rank reads holds that rank's own KV of its tokens."""

import random

import pytest

from radixkv.types import pack
from radixkv_server.core.pages import unpack
from tests.service_inproc.inproc import LAYOUT, NUM_PAGES, Engine, prompt, run, running_daemon

TP = 3
PROMPTS = 6


def seed(prompt_index: int, position: int, rank: int) -> int:
    """The KV of page `position` of prompt `prompt_index`, as rank `rank` computes it."""
    return (prompt_index * 17 + position * 5 + rank * 101) % 251


class Group:
    """The engine: its ranks' sessions and one page table (the pages it owns)."""

    def __init__(self, daemon, rng: random.Random, policy: str):
        self.daemon, self.rng, self.policy = daemon, rng, policy
        self.ranks: list[Engine | None] = [None] * TP
        self.free: set[int] = set()
        self.seen = {"verified": 0, "failed": 0, "left": 0}  # what the run exercised

    async def start(self) -> None:
        for r in self.rng.sample(range(TP), TP):
            self.ranks[r] = await Engine.register(self.daemon, "tp", tp_rank=r, tp_size=TP, write_policy=self.policy,
                                                  instance=f"start {self.seen['left']}")
        self.free = set(range(NUM_PAGES))  # a new engine: every page its own

    @property
    def driver(self) -> Engine:
        return self.ranks[0]

    def write(self, i: int, pages: list[int], first: int) -> None:
        for r, rank in enumerate(self.ranks):
            for k, page in enumerate(pages):
                rank.fill([page], seed(i, first + k, r))

    async def insert(self, i: int, n: int) -> None:
        if len(self.free) < n:
            freed = unpack((await self.driver.evict(n - len(self.free))).freed_pages)
            self.free.update(freed)
        if len(self.free) < n:
            return
        pages = self.rng.sample(sorted(self.free), n)
        self.write(i, pages, 0)
        answer = await self.driver.insert(prompt(1000 * i, n), pages)
        self.free -= set(pages) - set(unpack(answer.result.redundant_pages))

    async def load(self, i: int, n: int) -> None:
        m = await self.driver.match(prompt(1000 * i, n))
        result = m.result
        if not result.host_tokens:
            return
        need = result.host_tokens // 4
        if len(self.free) < need:
            return
        given = self.rng.sample(sorted(self.free), need)
        lb = (await self.driver.ns.load_back(self.driver.session, result.host_node, pack(given))).result
        self.free -= set(given) - set(unpack(lb.unused_pages))
        ok = True
        for tid in (lb.transfer, *lb.depends_on):
            if tid:
                done = await self.driver.ns.ack(self.driver.session, tid) if tid == lb.transfer else \
                    await self.driver.ns.finish(tid, missing_ok=True)
                ok = ok and (done is None or done.error is None)
                if done is not None and done.error is not None and tid == lb.transfer:
                    self.free.update(unpack(done.failed_pages))
        self.seen["verified" if ok else "failed"] += 1
        if ok:
            pages = list(unpack(lb.device_pages))
            for r, rank in enumerate(self.ranks):
                want = [b for k in range(len(pages)) for b in _bytes(seed(i, k, r))]
                assert rank.page_bytes(pages) == want, f"rank {r} holds other KV than its own of prompt {i}"

    async def leave(self) -> None:
        """A random rank's process goes: the daemon ends every rank's session."""
        gone = self.rng.randrange(TP)
        self.seen["left"] += 1
        await self.daemon.close_session(self.ranks[gone].session, "the test's rank left")
        for rank in self.ranks:
            await self.daemon.closed(rank.session)
            rank.buffers.close()
        assert not self.driver.ns.attached
        await self.start()


def _bytes(value: int) -> list[bytes]:
    """Each buffer's part of a page `Engine.fill` filled with `value`."""
    return [bytes([(value + 7 * b) % 251]) * LAYOUT.chunk_bytes for b in range(LAYOUT.num_buffers)]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_random_steps_keep_every_rank_in_step(policy):
    async def scenario():
        rng = random.Random(f"tp-{policy}")
        async with running_daemon(fault_fail_loads=0.2) as daemon:
            group = Group(daemon, rng, policy)
            await group.start()
            for step in range(400):
                action = rng.random()
                i, n = rng.randrange(PROMPTS), rng.randint(1, 4)
                if action < 0.45:
                    await group.insert(i, n)
                elif action < 0.65:
                    group.free.update(unpack((await group.driver.evict(rng.randint(1, 8))).freed_pages))
                elif action < 0.97:
                    await group.load(i, n)
                else:
                    await group.leave()
                assert daemon.check_invariants("") == [], f"after step {step}"
            for rank in group.ranks:
                await rank.close()
            assert min(group.seen.values()) > 0, group.seen
            print(group.seen)
    run(scenario())
