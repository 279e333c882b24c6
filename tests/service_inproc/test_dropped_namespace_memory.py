"""A dropped namespace gives its memory back at once: its host pool and its tree are freed
when DropNamespace answers, not whenever Python's cyclic garbage collector next runs a
full collection (which on a quiet daemon, where operators drop namespaces, may be long).
A Register admitted right after a drop counts only live namespaces against
--max-host-memory: memory the dropped one still held would push the daemon past it.
The garbage collector is off while each check runs, so only reference counting frees."""

import contextlib
import gc
import tempfile

from radixkv_server.core.node import Node
from radixkv_server.storage.open import open_storage

from tests.service_inproc.inproc import LAYOUT, Engine, prompt, run, running_daemon

POOL_PAGES = 65536  # 1 KiB pages of LAYOUT: a 64 MiB host pool


@contextlib.contextmanager
def no_garbage_collection():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def nodes_alive() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is Node)


def test_a_dropped_namespaces_tree_is_freed_when_the_drop_answers():
    async def scenario():
        async with running_daemon(host_pool_size=1024 * LAYOUT.page_bytes) as daemon:
            with no_garbage_collection():
                before = nodes_alive()
                e = await Engine.register(daemon, "t/tree")
                for i in range(200):  # 200 prompts sharing a first page: 201 nodes, on the host
                    await e.insert(prompt(0, 1) + prompt(1000 + 8 * i, 1), [0, 1])
                    await e.evict(2)
                assert nodes_alive() - before > 200
                await e.close()
                await daemon.drop_namespace("t/tree")
                assert nodes_alive() == before, "the dropped tree waits for a full garbage collection"
    run(scenario())


def test_a_dropped_namespaces_host_pool_is_freed_when_the_drop_answers_with_storage_on():
    async def scenario():
        with tempfile.TemporaryDirectory() as pages:
            storage = open_storage(f"file://{pages}")
            try:
                async with running_daemon(host_pool_size=POOL_PAGES * LAYOUT.page_bytes, host_pool_prefault=True,
                                          storage_policy="write_through") as daemon:
                    daemon.storage = storage
                    with no_garbage_collection():
                        for i in range(3):
                            e = await Engine.register(daemon, f"t/pool{i}")
                            await e.insert(prompt(0, 4), [0, 1, 2, 3])
                            await e.evict(4)  # backed up to the host, then stored: storage reads the pool
                            await e.ns.core.copies.drain()
                            await e.close()
                            held = rss_bytes()
                            await daemon.drop_namespace(f"t/pool{i}")
                            freed = held - rss_bytes()
                            assert freed > POOL_PAGES * LAYOUT.page_bytes // 2, \
                                f"drop {i}: {freed >> 20} MiB of a {POOL_PAGES * LAYOUT.page_bytes >> 20} MiB pool freed"
            finally:
                storage.close()
    run(scenario())
