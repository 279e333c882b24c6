"""DropNamespace while a WatchEvents snapshot of that namespace is being made: the
snapshot stops where it was (the reader then gets the namespace's AllBlocksCleared live)
instead of failing the stream INTERNAL on the dropped tree."""

from radixkv_server.events import EventHub, EventsConfig
from radixkv_server.service.watch import snapshot_batches

from tests.service_inproc.inproc import Engine, prompt, run, running_daemon


def test_a_snapshot_in_progress_ends_cleanly_when_its_namespace_is_dropped():
    async def scenario():
        hub = EventHub(EventsConfig(subscriber_buffer=100_000))
        try:
            async with running_daemon() as daemon:
                daemon.events = hub
                e = await Engine.register(daemon, "t/snap")
                for i in range(6):  # 7 nodes on the host: a snapshot of several slices
                    await e.insert(prompt(0, 1) + prompt(1000 + 8 * i, 1), [2 * i, 2 * i + 1])
                await e.evict(12)
                await e.ns.core.copies.drain()
                await e.close()
                ns = daemon.namespace("t/snap")
                batches = snapshot_batches([ns], 0, daemon.instance)
                step = batches.__anext__()
                step.send(None)  # the first slices told, the snapshot paused between two
                step.send(None)
                await daemon.drop_namespace("t/snap")
                events = 0
                try:
                    while True:
                        step.send(None)
                except StopIteration as done:  # the last batch (what was told before the drop)
                    events = len(done.value.events)
                except StopAsyncIteration:
                    pass
                assert events < 14, "told the dropped namespace's nodes"
                assert [b async for b in batches] == []
        finally:
            hub.close()
    run(scenario())
