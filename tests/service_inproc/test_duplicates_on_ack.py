"""A load-back's ACK makes each loaded node a settled device+host duplicate at once, node
by node, even while a lease keeps the path locked (so no unlock refreshes it later):
its host copy is then reclaimable under host pressure, and that frees host room
without touching the device copy the engine reads.

Without this, only randomized walks noticed an ACK that skipped the per-node refresh.
"""

from radixkv.types import pack

from tests.service_inproc.inproc import LAYOUT, Engine, prompt, run, running_daemon


def test_an_acked_load_under_a_lease_is_a_reclaimable_duplicate_at_once():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/dup-ack")
            p = prompt(0, 4)
            await e.insert(p, [0, 1, 2, 3])
            await e.evict(4)                                    # written back: host only
            m = await e.match(p, lease=True)                    # the lease outlives the ACK
            lb = await e.ns.load_back(e.session, m.result.host_node, pack([8, 9, 10, 11]))
            assert not (await e.ns.ack(e.session, lb.result.transfer)).error
            cache = e.ns.cache
            assert len(cache.duplicates) == 1                   # the one node: device + host
            used = cache.host.num_used
            assert cache.evict_host(4) == 4                     # its host copy is reclaimable
            assert cache.host.num_used == used - 4
            after = await e.match(p)                            # the device copy stays
            assert after.result.device_tokens == 4 * LAYOUT.page_size
            e.release([m.lease])
            assert e.ns.check_invariants() == []
            await e.close()
    run(scenario())
