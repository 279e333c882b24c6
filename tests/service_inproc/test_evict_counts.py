"""Evict frees exactly the pages asked for when enough are evictable: counted over many
small leaves (one page each), where an off-by-one per leaf adds up, and over one leaf
larger than the request (a node leaves whole: its pages, not fewer)."""

from radixkv.types import unpack

from tests.service_inproc.inproc import Engine, prompt, run, running_daemon


def test_evict_frees_exactly_the_pages_asked_for():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/evict-count", write_policy="write_through")
            for i in range(6):                                   # six one-page prompts, no shared prefix
                await e.insert(prompt(1000 * (i + 1), 1), [i])
            await e.ns.copies.drain()                            # backups done: host copies exist
            first = await e.evict(4)
            assert len(unpack(first.freed_pages)) == 4 and first.written_back_pages == 0
            rest = await e.evict(100)
            assert sorted(unpack(first.freed_pages) + unpack(rest.freed_pages)) == list(range(6))
            await e.insert(prompt(50_000, 3), [10, 11, 12])      # one node of three pages
            await e.ns.copies.drain()
            whole = await e.evict(1)
            assert sorted(unpack(whole.freed_pages)) == [10, 11, 12]
            assert e.ns.check_invariants() == []
            await e.close()
    run(scenario())


def test_evict_waits_for_backups_in_flight_instead_of_coming_up_short():
    """Under write-through a node whose backup is still copying cannot leave the device.
    An engine that inserted and at once needs the pages (a GPU's copies are asynchronous)
    gets them once the backups completed, not an Evict that frees nothing (the CUDA
    simulator stalled on exactly that, with every page held by an in-flight backup)."""
    async def scenario():
        async with running_daemon(fault_copy_delay=0.2) as daemon:  # every copy waits 0.2 s
            e = await Engine.register(daemon, "t/evict-backing-up", write_policy="write_through")
            for i in range(3):
                await e.insert(prompt(1000 * (i + 1), 1), [i])
            assert sum(e.ns.copies.in_flight(t) for t in e.ns.cache.transfers) == 3  # backups still copy
            got = await e.evict(3)
            assert sorted(unpack(got.freed_pages)) == [0, 1, 2] and got.written_back_pages == 0
            assert e.ns.check_invariants() == []
            await e.close()
    run(scenario())
