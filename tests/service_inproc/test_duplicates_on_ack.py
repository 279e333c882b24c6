"""A load-back's ACK makes each loaded node a settled device+host duplicate at once, node
by node, even while a lease keeps the path locked (so no unlock refreshes it later):
their host copies are then reclaimable under host pressure, which frees host room
without touching the device copies the engine reads.

The load covers a path of two nodes (a split node and its lower half), so an ACK that
refreshes only the transfer's anchor leaves the upper node untracked and fails here.
Without this, only randomized walks noticed an ACK that skipped the per-node refresh.
"""

from radixkv.types import pack

from tests.service_inproc.inproc import LAYOUT, Engine, prompt, run, running_daemon

PS = LAYOUT.page_size


def test_an_acked_load_under_a_lease_makes_every_node_of_its_path_a_duplicate():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/dup-ack")
            cache = e.ns.cache
            p = prompt(0, 4)                                    # pages 0-3 of one prompt
            await e.insert(p, [0, 1, 2, 3])
            # A branch sharing p's first 2 pages splits p's node: upper (2 pages), lower
            # (p's last 2) and the branch's own tail. Its shared pages 4, 5 are redundant.
            branch = p[:2 * PS * 4] + prompt(1000, 2)
            done = await e.insert(branch, [4, 5, 6, 7])
            assert done.result.redundant_pages == pack([4, 5])
            await e.evict(6)                                    # written back: all host only
            m = await e.match(p, lease=True)                    # the lease outlives the ACK
            lower = cache.tree.get(m.result.host_node)
            upper = lower.parent
            assert m.result.host_tokens == 4 * PS and upper.parent is not None, "p is not a 2-node path"
            tail = next(n for n in cache.tree.nodes.values() if n.parent is upper and n is not lower)
            lb = await e.ns.load_back(e.session, m.result.host_node, pack([8, 9, 10, 11]))
            assert lb.result.loaded_tokens == 4 * PS             # both nodes in one transfer
            assert not (await e.ns.ack(e.session, lb.result.transfer)).error
            # Every node of the loaded path is tracked, each on its own; the branch's tail
            # (host only) is not.
            assert upper in cache.duplicates and lower in cache.duplicates
            assert tail not in cache.duplicates and len(cache.duplicates) == 2
            assert e.ns.check_invariants() == []
            # Host pressure reclaims exactly those two host copies (4 pages), not the tail's.
            used = cache.host.num_used
            assert cache.evict_host(4) == 4
            assert cache.host.num_used == used - 4
            assert upper.full.host_pages is None and lower.full.host_pages is None
            assert tail.full.host_pages is not None
            after = await e.match(p)                            # the device copies stay
            assert after.result.device_tokens == 4 * PS
            e.release([m.lease])
            assert e.ns.check_invariants() == []
            await e.close()
    run(scenario())
