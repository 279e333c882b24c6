"""An Evict under write-back when the host is full and storage is freeing room.

Making host room under storage write-back starts stores of host-only KV, which leaves
the host when they end. The node the Evict wanted to write back used to be dropped from
the cache at once (its KV on no tier, counted `dropped_write_back_tokens`), although the
room came a moment later. Now the Evict waits for that room up to
`storage_lookup_timeout`; past it (a store that does not end), the node is dropped as
before, and the store is not waited for again (in-process daemon, a real Redis as the
store).
"""

import asyncio

import redis

from radixkv.types import unpack
from radixkv_server.core.transfers import TransferKind
from radixkv_server.storage.open import open_storage

from tests.service_inproc.inproc import LAYOUT, Engine, prompt, run, running_daemon, until

HOST = 8  # host pages: one 8-page prompt fills them


async def host_full_of_a(daemon) -> Engine:
    """A session whose 8-page prompt A was written back to a host it fills, and whose
    4-page prompt B is on the device only."""
    e = await Engine.register(daemon, "t/room", write_policy="write_back")
    await e.insert(prompt(0, 8), list(range(8)))
    assert len(unpack((await e.evict(8)).freed_pages)) == 8
    assert (await e.match(prompt(0, 8))).result.host_tokens == 32
    await e.insert(prompt(100, 4), [8, 9, 10, 11])
    return e


def with_store(private_redis, scenario, query: str = "", **config) -> None:
    """Run `scenario(daemon)` on an in-process daemon whose store is this Redis."""
    storage = open_storage(private_redis.url + query)

    async def main():
        async with running_daemon(storage_policy="write_back", host_pool_size=HOST * LAYOUT.page_bytes,
                                  **config) as daemon:
            daemon.storage = storage
            await scenario(daemon)

    try:
        run(main())
    finally:
        storage.close()


def test_an_evict_waits_for_the_store_freeing_host_room_and_writes_back(private_redis):
    async def scenario(daemon):
        e = await host_full_of_a(daemon)
        answer = await e.evict(4)
        assert sorted(unpack(answer.freed_pages)) == [8, 9, 10, 11] and answer.written_back_pages == 4
        counters = e.ns.counters()
        assert counters["dropped_write_back_tokens"] == 0 and counters["stored_tokens"] == 32
        assert (await e.match(prompt(100, 4))).result.host_tokens == 16
        assert e.ns.check_invariants() == []
        await e.close()

    with_store(private_redis, scenario, storage_lookup_timeout=10.0)


def test_a_store_that_does_not_end_holds_one_evict_once(private_redis):
    """A store stuck on a paused server: the first Evict waits for it up to
    storage_lookup_timeout, then drops the node it could not write back (as when no room
    is coming: the engine is not held); the next Evict does not wait for it again."""
    admin = redis.Redis(unix_socket_path=private_redis.socket)

    async def scenario(daemon):
        e = await host_full_of_a(daemon)
        stores = lambda: [t for t in e.ns.cache.transfers.values() if t.kind is TransferKind.STORE]  # noqa: E731
        admin.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
        try:
            answer = await asyncio.wait_for(e.evict(4), 10)
            assert sorted(unpack(answer.freed_pages)) == [8, 9, 10, 11] and stores()
            assert e.ns.counters()["dropped_write_back_tokens"] == 16
            await e.insert(prompt(200, 4), [8, 9, 10, 11])
            # The stuck store is waited for once: this Evict ends well inside storage_lookup_timeout.
            answer = await asyncio.wait_for(e.evict(4), 1.5)
            assert sorted(unpack(answer.freed_pages)) == [8, 9, 10, 11]
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        await until(lambda: not stores(), "the stores to end once the server answers")
        assert e.ns.check_invariants() == []
        await e.close()

    try:
        with_store(private_redis, scenario, "?socket_timeout=60", storage_lookup_timeout=4.0)
    finally:
        admin.close()
