"""radixkv_load_back_failed_tokens_total counts the tokens of a load-back whose copy failed.

A copy fails only when the data path does (tests/ops cannot make a healthy daemon process
fail one), so this runs in process: a real Daemon with the copy-delay fault flag, whose
namespace's device mapping is closed while a load-back waits to start, so the real shm
copy raises. The value is read as an operator reads it: the exported /metrics text of a
real `Metrics` registry watching that daemon, parsed with prometheus-client's parser.
"""

import asyncio

from radixkv.types import pack
from radixkv_server.metrics import Metrics

from tests.ops.scrape import series
from tests.service_inproc.inproc import LAYOUT, Engine, exposition, prompt, run, running_daemon

COPY_DELAY_S = 0.3  # each copy waits this long before touching the buffers


async def scrape(metrics: Metrics, namespace: str) -> dict:
    """{(name, labels without namespace): value} of one exposition, as tests/ops reads it."""
    return series(await exposition(metrics), namespace)


def test_a_failed_load_back_is_counted_in_tokens_and_not_as_loaded_bytes():
    async def scenario():
        async with running_daemon(fault_copy_delay=COPY_DELAY_S) as daemon:
            metrics = Metrics()
            metrics.watch(daemon, asyncio.get_running_loop())
            e = await Engine.register(daemon, "t/failed-load")
            p = prompt(0, 3)                                   # 3 pages = 12 tokens
            await e.insert(p, [0, 1, 2])
            await e.evict(3)                                   # written back: host only
            m = await e.match(p)
            lb = await e.ns.load_back(e.session, m.result.host_node, pack([10, 11, 12]))
            assert lb.result.transfer and lb.result.loaded_tokens == 3 * LAYOUT.page_size
            e.ns.copies.device.close()                         # the copy, still waiting, will fail
            done = await e.ns.ack(e.session, lb.result.transfer)
            assert done.error and done.failed_pages == pack([10, 11, 12])
            got = await scrape(metrics, "t/failed-load")
            assert got[("radixkv_load_back_failed_tokens_total", ())] == 3 * LAYOUT.page_size
            assert got[("radixkv_load_back_tokens_total", ())] == 3 * LAYOUT.page_size  # started
            assert got[("radixkv_load_back_bytes_total", ())] == 0                      # none copied
            assert got[("radixkv_backup_bytes_total", ())] == 3 * LAYOUT.page_bytes
            await e.close()
    run(scenario())
