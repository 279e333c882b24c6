"""A tensor-parallel engine-managed namespace's host pages hold every rank's shard, so its
host pool is `tp_size` times a rank's page per page. The daemon's host memory budget, Stats
and the host pool gauges count those whole pages: before, all three used one rank's page,
so `--max-host-memory` admitted tp_size times the memory it names (a node of tp=8 engines
overcommitted 8x, and the kernel kills a daemon whose pinned pools pass the machine), and
Stats said `attached: false` for a namespace its vLLM sessions were using (found by a
review of the registration paths)."""

import asyncio

import grpc
import pytest
from radixkv_server.metrics import Metrics
from radixkv_server.service.namespace_config import host_layout
from radixkv_server.service.errors import ServiceError
from radixkv_server.service.inspection import namespace_stats

from tests.ops.scrape import series
from tests.service_inproc.engine_ranks import Rank
from tests.service_inproc.inproc import LAYOUT, exposition, run, running_daemon

TP = 4
WIDE_PAGE = host_layout(LAYOUT, TP).page_bytes  # one host page: TP shards
POOL_PAGES = 64


def test_the_host_memory_budget_counts_every_ranks_shard():
    async def scenario():
        pool = POOL_PAGES * WIDE_PAGE
        async with running_daemon(host_pool_size=pool, max_host_memory=pool * 3 // 2) as daemon:
            first = [await Rank.register(daemon, "t/tp-a", tp_rank=r, tp_size=TP) for r in range(TP)]
            assert daemon.namespaces["t/tp-a"].host_pool.nbytes == pool
            with pytest.raises(ServiceError) as refused:
                await Rank.register(daemon, "t/tp-b", tp_rank=0, tp_size=TP)  # 2 pools > 1.5 pools
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"t/tp-a: {pool}" in str(refused.value), "the message names what holds the memory"
            assert "t/tp-b" not in daemon.namespaces
            for rank in first:
                await rank.close()
    run(scenario())


def test_stats_and_gauges_give_a_sharded_namespaces_whole_host_pages():
    async def scenario():
        async with running_daemon(host_pool_size=POOL_PAGES * WIDE_PAGE) as daemon:
            metrics = daemon.metrics = Metrics()
            metrics.watch(daemon, asyncio.get_running_loop())
            scheduler = await Rank.register(daemon, "t/tp-stats", role="scheduler", tp_size=TP)
            ns = daemon.namespaces["t/tp-stats"]
            stats = namespace_stats(ns)
            assert stats.attached, "a scheduler session shares it"
            assert stats.host_page_bytes == WIDE_PAGE
            assert stats.host_page_bytes * stats.host_pages_capacity == ns.host_pool.nbytes
            got = series(await exposition(metrics), "t/tp-stats")
            assert got[("radixkv_host_pool_capacity_bytes", ())] == ns.host_pool.nbytes
            await scheduler.close()
    run(scenario())
