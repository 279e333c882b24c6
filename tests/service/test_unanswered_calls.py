"""A call that moves pages or leases and gets no answer: its outcome is unknown.

The daemon may still carry it out (a daemon frozen past the client's timeout runs the
Insert once it resumes; a cancelled unary call may have been applied already). An engine
told "failed" that reuses the pages at once would leave the cache serving them as another
prompt's KV. So such a call ends the session: the next call closes it (the daemon answers
once its copies are over), registers again and raises SessionLost, and from then on the
pages are the engine's again. Whatever the cache serves afterwards is the right KV.
"""

import asyncio
import os
import signal

import pytest

from radixkv import errors
from radixkv.aio import AsyncClient
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.reconnect import Backoff
from radixkv.sim.kv import KvPattern, page_keys
from radixkv.types import pack
from tests.support.engine import LAYOUT as ENGINE_LAYOUT
from tests.support.engine import EngineDouble, prompt

from faultkit import LAYOUT, NUM_PAGES, tokens

FAST = Backoff(initial=0.05, maximum=0.2)
PROMPT, OTHER = tokens(0, 2), tokens(500, 2)


class Engine:
    """Shared-memory device pages with pattern KV, and what a match serves from them."""

    def __init__(self):
        self.buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
        self.kv = KvPattern(LAYOUT, [self.buffers.buffer(i) for i in range(LAYOUT.num_buffers)], NUM_PAGES)

    def served_right(self, m, load) -> bool:
        """Every page of `m` (a match of PROMPT) holds PROMPT's KV once in device pages:
        its device pages as they are, its host part loaded into pages 20.. by `load`."""
        device = list(m.device_pages)
        keys = page_keys(PROMPT, 4)
        right = self.kv.mismatches(device, keys[:len(device)]) == (0, 0)
        if m.host_tokens > m.device_tokens:
            pages = list(range(20, 20 + (m.host_tokens - m.device_tokens) // 4))
            load(pages)
            right = right and self.kv.mismatches(pages, keys[len(device):len(device) + len(pages)]) == (0, 0)
        return right

    def close(self):
        self.buffers.close()


def register_kwargs() -> dict:
    return dict(write_policy="write_through", host_pool_pages=64)


def test_an_insert_left_unanswered_ends_the_session_before_its_pages_are_the_engines(daemon_factory):
    d = daemon_factory()
    eng = Engine()
    c = Client(d.target, timeout=1.0, stream=True, reconnect=FAST)
    try:
        c.register("unanswered/stream", LAYOUT, eng.buffers.specs(), NUM_PAGES, **register_kwargs())
        eng.kv.write([1, 2], page_keys(PROMPT, 4))
        os.kill(d.pid, signal.SIGSTOP)  # the Insert waits in the daemon's socket
        try:
            with pytest.raises(errors.DeadlineExceeded):
                c.insert(PROMPT, [1, 2])
        finally:
            os.kill(d.pid, signal.SIGCONT)
        c.timeout = 10  # the resumed daemon may take a while on a loaded machine
        with pytest.raises(errors.SessionLost, match="outcome is unknown"):
            c.match([PROMPT])
        eng.kv.write([1, 2], page_keys(OTHER, 4))  # now the engine's again: reused
        [m] = c.match([PROMPT])
        assert m.device_tokens == 0, "pages of the ended session are served as a device hit"

        def load(pages):
            lb = c.load_back(m.host_node, pages)
            assert c.wait([lb.transfer], timeout=10)[lb.transfer].ok
        assert eng.served_right(m, load), "another prompt's KV served as this one's"
        assert c.check_invariants() == []
        sessions = c.stats("unanswered/stream")
        assert sessions.sessions == 1, "the ended session is closed"
    finally:
        c.close()
        eng.close()


def test_a_cancelled_unary_insert_ends_the_session_too(daemon_factory):
    d = daemon_factory()
    eng = Engine()

    async def scenario():
        c = AsyncClient(d.target, timeout=5, reconnect=FAST)
        try:
            await c.register("unanswered/aio", LAYOUT, eng.buffers.specs(), NUM_PAGES, **register_kwargs())
            eng.kv.write([1, 2], page_keys(PROMPT, 4))
            with pytest.raises(asyncio.TimeoutError):  # the engine stops waiting at once
                await asyncio.wait_for(c.insert(PROMPT, [1, 2]), 0.0001)
            with pytest.raises(errors.SessionLost, match="outcome is unknown"):
                await c.match([PROMPT])
            eng.kv.write([1, 2], page_keys(OTHER, 4))
            [m] = await c.match([PROMPT])
            assert m.device_tokens == 0
            assert m.host_tokens == 0 or await served_right_async(c, eng, m)
            assert await c.check_invariants() == []
        finally:
            await c.close()

    try:
        asyncio.run(scenario())
    finally:
        eng.close()


async def served_right_async(c: AsyncClient, eng: Engine, m) -> bool:
    pages = list(range(20, 20 + m.host_tokens // 4))
    lb = await c.load_back(m.host_node, pages)
    assert (await c.wait([lb.transfer], timeout=10))[lb.transfer].ok
    return eng.kv.mismatches(pages, page_keys(PROMPT, 4)[:len(pages)]) == (0, 0)


def test_a_unary_call_past_its_deadline_names_the_call_and_the_timeout(daemon_factory):
    d = daemon_factory()
    eng = Engine()
    c = Client(d.target, timeout=1.0, reconnect=FAST)
    try:
        c.register("unanswered/named", LAYOUT, eng.buffers.specs(), NUM_PAGES, **register_kwargs())
        os.kill(d.pid, signal.SIGSTOP)
        try:
            with pytest.raises(errors.DeadlineExceeded, match=r"Match: no answer within 1s"):
                c.match([PROMPT])
        finally:
            os.kill(d.pid, signal.SIGCONT)
    finally:
        c.close()
        eng.close()


def test_blocking_deadline_ends_the_session_only_for_a_call_that_moves_pages(daemon_factory):
    """On the blocking client's stream a call past its deadline raises DeadlineExceeded.
    A Match that leases nothing leaves the stream going (its late answer dropped); an
    Evict's outcome is unknown (the daemon goes on with it), so it ends the session: the
    next call raises SessionLost once the daemon closed it, its copies over, and the
    engine's pages are its own again."""
    d = daemon_factory("--fault-copy-delay", "2")
    e = EngineDouble(ENGINE_LAYOUT, 32)
    e.register(Client(d.target, timeout=10, stream=True, reconnect=Backoff(initial=0.05, maximum=0.2)),
               "late/b", write_policy="write_back")
    try:
        e.prefill(prompt(1, 2))
        os.kill(d.pid, signal.SIGSTOP)
        e.client.timeout = 0.5
        try:
            with pytest.raises(errors.DeadlineExceeded, match="no answer on the session stream within 0.5s"):
                e.client.match([pack(prompt(1, 2))])
        finally:
            os.kill(d.pid, signal.SIGCONT)
        e.client.timeout = 10
        [m] = e.client.match([pack(prompt(1, 2))])  # the stream went on
        assert (m.device_tokens, e.client.session) == (8, e.client.registration.session)
        e.client.timeout = 0.5
        with pytest.raises(errors.DeadlineExceeded, match="no answer on the session stream within 0.5s"):
            e.client.evict(2)  # write_back: copies both pages to host first, slowed
        e.client.timeout = 10
        with pytest.raises(errors.SessionLost, match="Evict went unanswered within 0.5s"):
            e.client.match([pack(prompt(1, 2))])
        [m] = e.client.match([pack(prompt(1, 2))])
        assert m.device_tokens == 0 and m.host_tokens == 8, "the evict's write-back finished before the close"
        assert e.client.check_invariants() == []
    finally:
        e.close()
