"""An engine-managed namespace (vLLM's) reports its copies as a managed one does: the
tokens its saves backed up (`radixkv_backup_tokens_total`, once every rank's shard is in)
and the time of each save and load (`radixkv_copy_duration_seconds`, directions `backup`
and `load`). Both read 0 before: a vLLM fleet's dashboard showed no save traffic and no
copy latency (found by an operator's walkthrough). Its loads wait for the engine's ack
like a managed one's, and count in the gauges the stuck-engine alert reads."""

import asyncio
import time

from radixkv_server.metrics import Metrics

from tests.ops.scrape import series
from tests.service_inproc.engine_ranks import Rank
from tests.service_inproc.inproc import LAYOUT, exposition, prompt, run, running_daemon


def test_saves_and_loads_of_an_engine_managed_namespace_are_measured():
    async def scenario():
        async with running_daemon() as daemon:
            metrics = daemon.metrics = Metrics()
            metrics.watch(daemon, asyncio.get_running_loop())
            ranks = [await Rank.register(daemon, "t/em", tp_rank=r, tp_size=2) for r in (0, 1)]
            tokens = prompt(0, 2)
            for rank in ranks:
                await rank.ack((await rank.save(tokens, [0, 1])).transfer)
            hit = await ranks[0].match(tokens)
            for rank in ranks:
                await rank.ack((await rank.load(hit.result.host_node, [5, 6], lease=hit.lease)).transfer)
            got = series(await exposition(metrics), "t/em")
            assert got[("radixkv_backup_tokens_total", ())] == 2 * LAYOUT.page_size, "once, when both shards are in"
            assert got[("radixkv_copy_duration_seconds_count", (("direction", "backup"),))] == 2  # a save per rank
            assert got[("radixkv_copy_duration_seconds_count", (("direction", "load"),))] == 2
    run(scenario())


def test_an_unacknowledged_engine_managed_load_shows_in_the_unacked_gauges():
    """vLLM's loads (engine-managed) are not load-back pins: the alert on unacknowledged
    load-backs reads `radixkv_load_backs_unacked` and the oldest one's age, which count
    them until the rank acknowledges."""
    async def scenario():
        async with running_daemon() as daemon:
            metrics = daemon.metrics = Metrics()
            metrics.watch(daemon, asyncio.get_running_loop())
            rank = await Rank.register(daemon, "t/em-unacked")
            tokens = prompt(0, 2)
            await rank.ack((await rank.save(tokens, [0, 1])).transfer)
            hit = await rank.match(tokens)
            before = time.monotonic()
            load = await rank.load(hit.result.host_node, [5, 6], lease=hit.lease)
            got = series(await exposition(metrics), "t/em-unacked")
            age = got[("radixkv_oldest_unacked_load_back_seconds", ())]
            assert got[("radixkv_load_backs_unacked", ())] == 1
            assert 0 < age <= time.monotonic() - before
            await rank.ack(load.transfer)
            got = series(await exposition(metrics), "t/em-unacked")
            assert (got[("radixkv_load_backs_unacked", ())], got[("radixkv_oldest_unacked_load_back_seconds", ())]) \
                == (0, 0)
    run(scenario())
