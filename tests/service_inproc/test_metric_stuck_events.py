"""Metrics no healthy daemon process can be driven to, read from a real daemon in this
process: KV-event batches dropped and a publisher queue that stays full (the publisher
thread stuck inside a job, as in a send that never returns), and invariant violations
(the daemon's state broken on purpose, as a core bug would leave it).

As in test_metric_failed_loads.py, values are read as an operator reads them: the
/metrics text of a real `Metrics` registry watching the daemon, parsed with
prometheus-client's parser. Residency changes are flushed by calling the hub's flush,
which the daemon's loop otherwise schedules once per loop turn.
"""

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from radixkv_server.config import DaemonConfig
from radixkv_server.events import EventHub, EventsConfig
from radixkv_server.metrics import Metrics
from radixkv_server.service.daemon import Daemon

from tests.events.helpers import StuckJob
from tests.service_inproc.inproc import HOST_PAGES, LAYOUT, Engine, exposition, prompt, run

QUEUE = 4  # --kv-events-queue-size of these daemons


def samples(text: str) -> dict:
    """{(name, labels, namespace included): value} of an exposition's text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def watched_daemon() -> tuple[Daemon, Metrics]:
    """An in-process daemon and a real Metrics registry watching it (call on its loop)."""
    metrics = Metrics()
    daemon = Daemon(DaemonConfig(host_pool_size=HOST_PAGES * LAYOUT.page_bytes), metrics)
    metrics.watch(daemon, asyncio.get_running_loop())
    return daemon, metrics


async def scrape(metrics: Metrics) -> dict:
    """`samples` of one exposition."""
    return samples(await exposition(metrics))


def event_values(got: dict) -> tuple:
    """(published, dropped, queue_depth) as exported."""
    return (got[("radixkv_kv_event_batches_published_total", ())],
            got[("radixkv_kv_event_batches_dropped_total", ())],
            got[("radixkv_kv_event_queue_depth", ())])


async def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    """Poll `condition()` on the loop's behalf (each look yields to the loop)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_stuck_publisher_fills_the_queue_and_drops_are_counted():
    async def scenario():
        config = DaemonConfig(host_pool_size=HOST_PAGES * LAYOUT.page_bytes, kv_events_watch=True,
                              kv_events_queue_size=QUEUE)
        hub = EventHub(EventsConfig.from_daemon(config))  # flushed by hand below
        metrics = Metrics()
        daemon = Daemon(config, metrics, events=hub)
        metrics.watch(daemon, asyncio.get_running_loop())
        gate = StuckJob()
        try:
            e = await Engine.register(daemon, "t/events")
            await wait_until(lambda: hub.drained, "the start's batches published")
            # seq 0: the daemon's AllBlocksCleared, 1: the namespace's on its own topic
            assert event_values(await scrape(metrics)) == (2, 0, 0)
            assert hub._publisher.submit((gate, "", b"kv@stuck", 0.0, []))
            await asyncio.to_thread(gate.entered.wait, 20)
            assert gate.entered.is_set(), "the publisher thread never took the stuck job"
            # One Insert, one batch: QUEUE of them fit behind the stuck job, the next is
            # dropped (a resync is due: the namespace records nothing more until then).
            for i in range(QUEUE + 3):
                await e.insert(prompt(1000 * i, 2), [2 * i, 2 * i + 1])
                hub.flush()
            assert event_values(await scrape(metrics)) == (2, 1, QUEUE)
            gate.release.set()
            # The stuck job and the QUEUE batches go out; then the resync is one batch.
            await wait_until(lambda: hub.flush() >= 0 and hub.drained and not hub.resync_pending,
                             "queued batches and the resync published")
            assert event_values(await scrape(metrics)) == (2 + 1 + QUEUE + 1, 1, 0)
            await e.close()
        finally:
            gate.release.set()
            await daemon.close()
            hub.close()
    run(scenario())


def test_invariant_violations_are_counted_per_check_and_namespace():
    async def scenario():
        daemon, metrics = watched_daemon()
        try:
            e = await Engine.register(daemon, "t/broken", write_policy="write_through")
            other = await Engine.register(daemon, "t/sound")
            p = prompt(0, 2)
            await e.insert(p, [0, 1])
            await wait_until(lambda: not e.ns.cache.transfers, "the write-through backup")
            # A clean workload: no violation; each namespace's series is exported from 0.
            assert daemon.check_invariants("") == []
            got = await scrape(metrics)
            assert {labels: v for (name, labels), v in got.items() if name == "radixkv_invariant_violations_total"} \
                == {(("namespace", "t/broken"),): 0, (("namespace", "t/sound"),): 0}
            # Break the state as a core bug would: a settled duplicate no longer tracked.
            cache = e.ns.cache
            node = cache.tree.get(cache.match(p).device_node)
            assert node in cache.duplicates
            cache.duplicates.discard(node)
            found = daemon.check_invariants("")
            [v] = found
            assert v.namespace == "t/broken" and "Duplicate missing" in v.message
            assert daemon.check_invariants("t/broken") == found          # each check counts again
            got = await scrape(metrics)
            assert got[("radixkv_invariant_violations_total", (("namespace", "t/broken"),))] == 2
            assert got[("radixkv_invariant_violations_total", (("namespace", "t/sound"),))] == 0
            cache.state.refresh(node)                                     # repaired: no new count
            assert daemon.check_invariants("") == []
            got = await scrape(metrics)
            assert got[("radixkv_invariant_violations_total", (("namespace", "t/broken"),))] == 2
            await e.close()
            await other.close()
        finally:
            await daemon.close()
    run(scenario())


def test_a_scrape_while_the_loop_is_stuck_shows_the_last_state_and_its_age(monkeypatch):
    """A scrape whose state read the daemon's loop cannot answer in time (stuck in a long
    synchronous call here) exports the last state read, and `radixkv_state_age_seconds`
    says how old it is (the scrape had no radixkv state series at all: panels emptied
    and alerts on them went quiet while the daemon was in trouble)."""
    import threading

    from prometheus_client import generate_latest
    from radixkv_server import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "SNAPSHOT_TIMEOUT_S", 1.0)  # a busy machine answers well within it

    async def scenario():
        daemon, metrics = watched_daemon()
        try:
            e = await Engine.register(daemon, "t/stuck")
            fresh = await scrape(metrics)
            assert fresh[("radixkv_sessions", ())] == 1 and fresh[("radixkv_state_age_seconds", ())] < 1.0
            done = threading.Event()

            def scrape_and_tell() -> bytes:
                try:
                    return generate_latest(metrics.registry)
                finally:
                    done.set()

            scraping = asyncio.get_running_loop().run_in_executor(None, scrape_and_tell)
            # The loop stuck (a long synchronous call) until the scrape has answered: its
            # read of the state could only time out.
            assert done.wait(30), "the scrape did not answer while the loop was stuck"
            stale = samples((await scraping).decode())
            assert stale[("radixkv_sessions", ())] == 1
            assert stale[("radixkv_state_age_seconds", ())] >= 1.0
            assert (await scrape(metrics))[("radixkv_state_age_seconds", ())] < 1.0  # read again once it answers
            await e.close()
        finally:
            await daemon.close()
    run(scenario())
