"""KV events from a real daemon process: routers following it over ZMQ and over
WatchEvents rebuild exactly what the daemon holds per tier, through device and host
evictions, storage stores and a daemon restart; a stalled reader costs engines nothing.
"""

import contextlib
import itertools
import random
import time

import grpc
import pytest

from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc
from tests.support.daemon import DaemonProcess, stop_all, wait_for
from tests.support.engine import LAYOUT, PS, EngineDouble

from .followers import WORKER, WatchFollower, ZmqFollower, daemon_blocks, prefix_blocks
from .helpers import ipc_endpoints

NS = "model/tp0"
HOST_PAGES = 48  # fewer than the engine's 128 device pages: host evictions happen
SETTLE_S = 30.0
SHUTDOWN_GRACE_S = 10.0  # the daemon's default --shutdown-grace


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported:\n{text[-2000:]}")


def workload(engine: EngineDouble, rnd: random.Random, prompts: list, steps: int) -> None:
    """Prefills sharing prefixes (evicting device pages when short, writing back to a
    host pool too small to keep them all), explicit evictions and load-backs."""
    for _ in range(steps):
        r = rnd.random()
        if r < 0.6 or not prompts:
            group = rnd.randrange(4)
            head = [100_000 * group + t for t in range(rnd.randint(1, 4) * PS)]
            tail = [rnd.randrange(1, 50_000) for _ in range(rnd.randint(1, 4) * PS)]
            prompts.append(head + tail)
            engine.prefill(prompts[-1])
        elif r < 0.8:
            engine.evict(rnd.randint(1, 16))
        else:
            n, mismatches = engine.load(rnd.choice(prompts))
            assert mismatches == (0, 0)


def converged(follower, client, prompts) -> bool:
    """The follower's index equals the daemon's state: block counts per tier (Inspect)
    and, for every prompt, its device and device+host prefixes (Match)."""
    if follower.last_seq is None:
        return False
    try:
        return _equal(follower, client, prompts)
    except RuntimeError:  # the follower's thread changed the index meanwhile: look again
        return False


def _equal(follower, client, prompts) -> bool:
    inspect = client.inspect(NS, max_nodes=100_000)
    gpu, cpu, _ = follower.index.num_blocks(WORKER, NS)
    if (gpu, cpu) != daemon_blocks(inspect, PS):
        return False
    for tokens, m in zip(prompts, client.match([pack(p) for p in prompts])):
        if prefix_blocks(follower.index, NS, tokens, ("GPU",)) != m.device_tokens // PS:
            return False
        if prefix_blocks(follower.index, NS, tokens, ("GPU", "CPU")) != (m.device_tokens + m.host_tokens) // PS:
            return False
    return True


@pytest.fixture
def events_daemon(tmp_path):
    pub, replay = ipc_endpoints("d")
    d = DaemonProcess("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay,
                      "--kv-events-watch", "true", "--write-policy", "write_back",
                      "--host-pool-size", str(HOST_PAGES * LAYOUT.page_bytes),
                      "--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through",
                      metrics=True)
    d.start()
    d.endpoints = (pub, replay)
    yield d
    stop_all([d])


def test_routers_rebuild_the_daemons_tiers_over_zmq_and_watch_events(events_daemon):
    d = events_daemon
    zmq_router = ZmqFollower(PS, *d.endpoints)
    watch_router = WatchFollower(PS, d.target)
    rnd = random.Random(13)
    prompts: list = []
    engine = EngineDouble.connect(d.target, NS)
    try:
        workload(engine, rnd, prompts, 120)
        stats = engine.counters()
        assert stats["device_evicted_tokens"] and stats["host_evicted_tokens"] and stats["stored_tokens"], stats
        for router in (zmq_router, watch_router):
            wait_for(lambda: converged(router, engine.client, prompts), SETTLE_S,
                     f"{type(router).__name__} to match the daemon")
            assert router.index.num_blocks(WORKER, NS)[2] > 0  # storage stores were announced
        engine.close()
        d.restart()  # SIGKILL and start: no goodbye, only the new run's AllBlocksCleared at seq 0
        prompts.clear()
        engine = EngineDouble.connect(d.target, NS)
        workload(engine, rnd, prompts, 80)
        for router in (zmq_router, watch_router):
            wait_for(lambda: converged(router, engine.client, prompts), SETTLE_S,
                     f"{type(router).__name__} to match the restarted daemon")
        assert zmq_router.fleet.feeds[WORKER].num_restarts >= 1
        assert watch_router.codes and grpc.StatusCode.UNAVAILABLE in watch_router.codes
    finally:
        engine.close()
        zmq_router.close()
        watch_router.close()


def test_a_router_blind_to_medium_follows_presence_events_to_what_the_daemon_holds(tmp_path):
    """A router that ignores `medium` (Dynamo's) read a host copy's removal as the block
    gone while the device still held it. With --kv-events-presence a block is stored
    once it is on the device or host, removed once on neither, with no medium and no
    storage blocks: such a router (a RoutingIndex, to which no medium is the GPU and a
    removal without one is from every tier) holds exactly the blocks the daemon has."""
    pub, replay = ipc_endpoints("p")
    d = DaemonProcess("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay, "--kv-events-watch", "true",
                      "--kv-events-presence", "true", "--write-policy", "write_through",
                      "--host-pool-size", str(HOST_PAGES * LAYOUT.page_bytes),
                      "--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through").start()
    routers = [ZmqFollower(PS, pub, replay), WatchFollower(PS, d.target)]
    rnd = random.Random(17)
    prompts: list = []
    engine = EngineDouble.connect(d.target, NS)

    def held_as_present(router) -> bool:
        gpu, cpu, storage = router.index.num_blocks(WORKER, NS)
        if router.last_seq is None or cpu or storage:
            return False
        matches = engine.client.match([pack(p) for p in prompts])
        return all(prefix_blocks(router.index, NS, tokens, ("GPU",)) == (m.device_tokens + m.host_tokens) // PS
                   for tokens, m in zip(prompts, matches))

    try:
        workload(engine, rnd, prompts, 120)
        stats = engine.counters()
        assert stats["device_evicted_tokens"] and stats["host_evicted_tokens"] and stats["stored_tokens"], stats
        for router in routers:
            wait_for(lambda: held_as_present(router), SETTLE_S, f"{type(router).__name__} to hold what the daemon has")
            assert router.index.num_unknown_medium == 0
    finally:
        engine.close()
        for router in routers:
            router.close()
        stop_all([d])


def test_a_stalled_watcher_is_cut_off_and_counted_while_engines_go_on(tmp_path):
    """A WatchEvents reader that reads nothing: engine calls all complete, the reader
    is cut off (ABORTED with the seq to resume from) and the drop metric counts."""
    d = DaemonProcess("--kv-events-watch", "true", "--kv-events-subscriber-buffer", "4", metrics=True)
    d.start()
    engine = EngineDouble.connect(d.target, NS)
    # A small flow-control window, so the daemon's writes block once the reader stops reading.
    channel = grpc.insecure_channel(d.target, options=[("grpc.http2.lookahead_bytes", 1024),
                                                       ("grpc.http2.bdp_probe", 0)])
    reader = grpc.insecure_channel(d.target)
    try:
        stalled = pb_grpc.RadixKVStub(channel).WatchEvents(pb.WatchEventsRequest())
        wait_for(lambda: metric(d.scrape(), "radixkv_kv_event_watchers") == 1, 10, "the watcher")
        rnd = random.Random(1)
        workload(engine, rnd, [], 60)  # every call returns (a timeout would raise)
        # Counted on the publisher's thread, which may still be behind the last calls.
        wait_for(lambda: metric(d.scrape(), "radixkv_kv_event_subscribers_lagged_total") == 1, 10,
                 "the stalled watcher cut off")
        # What it had buffered (in the daemon and in gRPC's windows) stays readable, in
        # order, then the status names the first batch it missed.
        seqs = []
        with pytest.raises(grpc.RpcError) as e:
            for msg in stalled:
                seqs.append(msg.seq)
        assert e.value.code() == grpc.StatusCode.ABORTED
        resume = int(e.value.details().split("from_seq=")[1].split()[0])
        assert seqs == list(range(seqs[0], resume))
        again = pb_grpc.RadixKVStub(channel).WatchEvents(pb.WatchEventsRequest(from_seq=resume))
        assert next(again).seq == resume  # resumed with no gap: the ring still holds it
        again.cancel()
        with pytest.raises(grpc.RpcError) as e:
            next(pb_grpc.RadixKVStub(channel).WatchEvents(pb.WatchEventsRequest(from_seq=10**9)))
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "cannot replay from seq 1000000000: the replay buffer holds [0, " in e.value.details()
        # A watcher open at shutdown does not hold it: its stream ends (OK) and the daemon
        # exits cleanly well within --shutdown-grace. (One that stopped reading would,
        # like any call in progress: its writes wait on flow control.)
        live = pb_grpc.RadixKVStub(reader).WatchEvents(pb.WatchEventsRequest())
        wait_for(lambda: metric(d.scrape(), "radixkv_kv_event_watchers") == 1, 10, "the live watcher")
        engine.close()
        t0 = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - t0 < SHUTDOWN_GRACE_S
        list(live)  # ended with OK (an error status would raise)
    finally:
        engine.close()
        channel.close()
        reader.close()
        stop_all([d])


def test_a_router_that_joins_late_catches_up_from_a_snapshot(tmp_path):
    """A WatchEvents reader that starts after the replay ring has moved on asks for a
    snapshot: it holds what the daemon holds at once, and live batches keep it so."""
    d = DaemonProcess("--kv-events-watch", "true", "--kv-events-replay-size", "4", "--write-policy", "write_back",
                      "--host-pool-size", str(HOST_PAGES * LAYOUT.page_bytes),
                      "--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    d.start()
    engine = EngineDouble.connect(d.target, NS)
    rnd = random.Random(17)
    prompts: list = []
    late = None
    try:
        workload(engine, rnd, prompts, 80)
        with grpc.insecure_channel(d.target) as channel:
            stub = pb_grpc.RadixKVStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                next(stub.WatchEvents(pb.WatchEventsRequest(from_seq=0)))
            assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE  # what a late router had before
            with pytest.raises(grpc.RpcError) as e:
                next(stub.WatchEvents(pb.WatchEventsRequest(from_seq=0, snapshot=True)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as e:
                next(stub.WatchEvents(pb.WatchEventsRequest(namespace="nope", snapshot=True)))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as e:  # a name no namespace can have: not waited for
                next(stub.WatchEvents(pb.WatchEventsRequest(namespace="bad name!" + "x" * 500)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "(509 characters)" in e.value.details() and len(e.value.details()) < 300
        late = WatchFollower(PS, d.target, namespace=NS, snapshot=True)
        wait_for(lambda: converged(late, engine.client, prompts), SETTLE_S, "the snapshot to match the daemon")
        assert late.index.num_blocks(WORKER, NS)[2] > 0  # storage too
        workload(engine, rnd, prompts, 60)
        wait_for(lambda: converged(late, engine.client, prompts), SETTLE_S, "live batches after the snapshot")
    finally:
        engine.close()
        if late is not None:
            late.close()
        stop_all([d])


@contextlib.contextmanager
def snapshot_in_progress(*flags: str):
    """(daemon, engine, WatchEvents call, its first batch): a namespace of 3300 one-page
    prompts (a snapshot of four batches) read over a channel with a small flow-control
    window, so the daemon's next snapshot batches wait while the reader does not read."""
    d = DaemonProcess("--kv-events-watch", "true", *flags, metrics=True)
    d.start()
    engine = EngineDouble.connect(d.target, NS, num_pages=3500)
    try:
        for i in range(3300):
            engine.prefill([50_000 + i] * PS)
        with grpc.insecure_channel(d.target, options=[("grpc.http2.lookahead_bytes", 1024),
                                                      ("grpc.http2.bdp_probe", 0)]) as channel:
            call = pb_grpc.RadixKVStub(channel).WatchEvents(pb.WatchEventsRequest(namespace=NS, snapshot=True),
                                                             timeout=60)
            first = next(call)
            assert first.snapshot and first.events[0].kind == pb.KvEvent.ALL_BLOCKS_CLEARED
            assert len(first.events) == 1024  # three more follow
            try:
                yield d, engine, call, first
            finally:
                call.cancel()
    finally:
        engine.close()
        stop_all([d])


def test_a_reader_that_leaves_during_its_snapshot_leaves_nothing_behind():
    """A snapshot larger than one batch, its reader gone after the first: the daemon
    drops the subscription (else it would collect batches for nobody until cut off)."""
    with snapshot_in_progress() as (d, _, call, _):
        assert metric(d.scrape(), "radixkv_kv_event_watchers") == 1
        call.cancel()
        wait_for(lambda: metric(d.scrape(), "radixkv_kv_event_watchers") == 0, 10, "the subscription dropped")


def test_batches_published_while_a_snapshot_is_sent_wait_for_the_reader_past_its_buffer():
    """A reader whose snapshot takes a while on a busy daemon: the batches published
    meanwhile (more than --kv-events-subscriber-buffer of them) wait for it as a replay's
    backlog would, and follow the snapshot in order, none missing; without that the
    stream ended ABORTED, and its reader took a snapshot again."""
    with snapshot_in_progress("--kv-events-subscriber-buffer", "4") as (d, engine, call, first):
        published = metric(d.scrape(), "radixkv_kv_event_batches_published_total")
        for i in range(40):  # a batch each, while the snapshot is still being sent
            engine.prefill([90_000 + i] * PS)
        wait_for(lambda: metric(d.scrape(), "radixkv_kv_event_batches_published_total") >= published + 40, 10,
                 "the new prompts' batches published")
        snapshot_events, live, stored, wanted = len(first.events), [], set(), {90_000 + i for i in range(40)}
        for batch in call:  # an ABORTED stream raises here
            if batch.snapshot:
                snapshot_events += len(batch.events)
                continue
            live.append(batch)
            stored |= {e.token_ids[0] for e in batch.events if e.kind == pb.KvEvent.BLOCK_STORED}
            if stored >= wanted:
                break
    assert snapshot_events >= 3301  # AllBlocksCleared and every prompt's block
    assert [b.seq for b in live] == list(range(first.seq, first.seq + len(live)))
    assert len(live) > 4, "the new prompts came in no more batches than the buffer holds: not exercised"
    assert stored >= wanted


def test_negative_token_ids_reach_watchers_as_they_were_inserted():
    """Engines' placeholder ids may be negative (the vLLM connector's multimodal ones
    are): WatchEvents once answered INTERNAL to every watcher of the namespace, its
    token_ids field being unsigned."""
    d = DaemonProcess("--kv-events-watch", "true")
    d.start()
    engine = EngineDouble.connect(d.target, NS)
    channel = grpc.insecure_channel(d.target)
    try:
        prompt = [-5 - t if t % 3 == 0 else t for t in range(2 * PS)]
        engine.prefill(prompt)
        stored = []
        for batch in pb_grpc.RadixKVStub(channel).WatchEvents(pb.WatchEventsRequest(from_seq=0), timeout=30):
            stored += [list(e.token_ids) for e in batch.events if e.kind == pb.KvEvent.BLOCK_STORED]
            if stored:
                break
        assert stored == [prompt]
    finally:
        engine.close()
        channel.close()
        stop_all([d])


def test_a_snapshot_of_long_prompts_comes_in_batches_a_default_grpc_client_takes():
    """Snapshot batches end at about 1 MiB, as live ones do: 1024 stored long prompts
    once made one message of several MiB, which a router's default 4 MiB channel refused
    at every retry."""
    from radixkv.layout import KvLayout
    from radixkv_server.events.publisher import MAX_BATCH_BYTES

    layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=64)
    d = DaemonProcess("--kv-events-watch", "true", "--page-size", "64")
    d.start()
    engine = EngineDouble.connect(d.target, NS, num_pages=24 * 256, layout=layout)
    channel = grpc.insecure_channel(d.target)
    try:
        prompts = [[1_000_000 * (i + 1) + t for t in range(16384)] for i in range(24)]
        for p in prompts:
            engine.prefill(p)
        call = pb_grpc.RadixKVStub(channel).WatchEvents(pb.WatchEventsRequest(namespace=NS, snapshot=True),
                                                         timeout=60)
        first = next(call)
        engine.prefill([7] * 64)  # a live batch, sent once the snapshot is: its end
        batches, firsts = [], set()
        for batch in itertools.chain([first], call):
            if not batch.snapshot:
                break
            batches.append(batch.ByteSize())
            firsts |= {e.token_ids[0] for e in batch.events if e.kind == pb.KvEvent.BLOCK_STORED}
        call.cancel()
        assert firsts == {p[0] for p in prompts} and len(batches) > 1
        assert max(batches) < MAX_BATCH_BYTES + 128 << 10, batches  # one event past the bound at most
    finally:
        engine.close()
        channel.close()
        stop_all([d])
