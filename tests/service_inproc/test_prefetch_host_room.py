"""A Prefetch whose run finds the host pool full of pages that stores in flight write.

Such pages become evictable the moment their stores end, but a Prefetch reserved its
host pages all or nothing and answered NOTHING at once: a vLLM lookup staging a prompt
from storage right after another prompt was written through got no hit at all (the
bench's storage case, about 1 request in 3). Now a Prefetch that waits for its fetch
also waits for those stores (bounded, as an Evict waits for room), then fetches the
whole run; where the room does not come in time, it fetches what fits (in-process
daemon, a real file store whose writes the test holds while its reads go on).
"""

import asyncio
import logging
import threading

from radixkv_server.core.transfers import TransferKind
from radixkv_server.service.calls import PrefetchPolicy, PrefetchRequest, PrefetchState
from radixkv_server.storage.file import FileStorage

from tests.service_inproc.inproc import LAYOUT, Engine, prompt, run, running_daemon, until

HOST = 8  # host pages: two 4-page prompts fill them
A, B, C = prompt(0, 4), prompt(100, 4), prompt(200, 4)


class HeldWrites(FileStorage):
    """A file store whose writes wait while `go` is clear (a slow or busy store; reads go on)."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self.go = threading.Event()
        self.go.set()

    def _put_pages(self, items):
        self.go.wait(30)
        return super()._put_pages(items)


def with_store(tmp_path, scenario, **config) -> None:
    """Run `scenario(daemon, store)` on an in-process daemon writing through to a HeldWrites."""
    storage = HeldWrites(str(tmp_path / "pages"))

    async def main():
        async with running_daemon(storage_policy="write_through", host_pool_size=HOST * LAYOUT.page_bytes,
                                  **config) as daemon:
            daemon.storage = storage
            await scenario(daemon, storage)

    try:
        run(main())
    finally:
        storage.go.set()
        storage.close()


async def a_stored_and_on_host_only(e: Engine):
    """A inserted, stored, and evicted from the device (its host copy stays, stored).
    Returns a function listing the stores in flight."""
    stores = lambda: [t for t, x in e.ns.cache.transfers.items() if x.kind is TransferKind.STORE]  # noqa: E731
    await e.insert(A, [0, 1, 2, 3])
    await until(lambda: e.ns.counters()["stored_tokens"] == 16, "A stored")
    await e.evict(4)  # write-through: A's host copy stays, stored
    return stores


async def prefetch(e: Engine, tokens: bytes) -> list:
    steps = e.ns.prefetch(e.session, PrefetchRequest(tokens, policy=PrefetchPolicy.WAIT_COMPLETE))
    return [step async for step in steps]


def test_a_waiting_prefetch_waits_for_the_stores_holding_the_host_then_fetches_the_whole_run(tmp_path):
    async def scenario(daemon, store):
        e = await Engine.register(daemon, "t/fetch-room", write_policy="write_through")
        stores = await a_stored_and_on_host_only(e)
        store.go.clear()
        await e.insert(B, [4, 5, 6, 7])
        await e.insert(C, [8, 9, 10, 11])  # A's stored host copy leaves for C's backup
        await until(lambda: len(stores()) == 2, "B's and C's stores in flight")
        assert (await e.match(A)).result.host_tokens == 0
        fetching = asyncio.ensure_future(prefetch(e, A))
        # The Prefetch read A's records (reads go on) and waits for the stores' room.
        await until(lambda: any(t in e.ns.core.copies._waiters for t in stores()), "the Prefetch waiting for room")
        store.go.set()
        steps = await asyncio.wait_for(fetching, 10)
        assert [s.state for s in steps] == [PrefetchState.STARTED, PrefetchState.DONE]
        assert steps[0].storage_tokens == 16 and steps[-1].host_tokens_added == 16
        assert (await e.match(A)).result.host_tokens == 16
        assert e.ns.check_invariants() == []
        await e.close()

    with_store(tmp_path, scenario, storage_lookup_timeout=10.0)


def test_a_waiting_prefetch_whose_room_does_not_come_in_time_fetches_what_fits(tmp_path, caplog):
    async def scenario(daemon, store):
        e = await Engine.register(daemon, "t/fetch-part", write_policy="write_through")
        stores = await a_stored_and_on_host_only(e)
        store.go.clear()
        await e.insert(B, [4, 5, 6, 7])
        await until(lambda: len(stores()) == 1, "B's store in flight")
        await e.insert(C[:2 * LAYOUT.page_size * 4], [8, 9])  # C's first 2 pages: 2 host pages stay free
        await until(lambda: len(stores()) == 2, "C's store in flight")
        with caplog.at_level(logging.DEBUG, logger="radixkv.namespace"):
            steps = await asyncio.wait_for(prefetch(e, A), 10)
        assert [s.state for s in steps] == [PrefetchState.STARTED, PrefetchState.DONE]
        assert steps[0].storage_tokens == 8 and steps[-1].host_tokens_added == 8  # A's first 2 pages
        assert (await e.match(A)).result.host_tokens == 8
        assert [r.fields["namespace"] for r in caplog.records if r.msg == "prefetch.store_wait_ended"] == ["t/fetch-part"]
        assert e.ns.check_invariants() == []
        store.go.set()
        await until(lambda: not stores(), "the stores to end once let go")
        await e.close()

    with_store(tmp_path, scenario, storage_lookup_timeout=0.3)
