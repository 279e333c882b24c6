"""vLLM's ZMQ framing end to end on real sockets: live PUB frames, ROUTER replay after a
disconnect without gap or duplicate, and a stalled subscriber that costs the loop nothing."""

import os
import threading

import pytest
import zmq

from radixkv.routing.blockhash import block_hashes
from radixkv.routing.wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from radixkv_server.core.tree import RadixTree
from radixkv_server.events import EventHub, EventsConfig

from .helpers import PAGE, StuckJob, chain, ipc_endpoints, wait_for


class RawSubscriber:
    """A router's side written from the protocol alone (no radixkv client code)."""

    def __init__(self, ctx, pub, replay):
        self.ctx, self.pub_addr = ctx, pub
        self.sub = self._connect_sub()
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.applied: list[int] = []
        self.payloads: dict[int, bytes] = {}
        self.duplicates_seen = 0

    def _connect_sub(self):
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.pub_addr)
        return sub

    def reconnect(self):
        self.sub.close(0)
        self.sub = self._connect_sub()

    @property
    def last(self) -> int:
        return self.applied[-1] if self.applied else -1

    def _apply(self, seq, payload):
        assert seq == self.last + 1, f"gap or duplicate: applying {seq} after {self.last}"
        self.applied.append(seq)
        self.payloads[seq] = payload

    def replay(self, from_seq):
        self.dealer.send_multipart((b"", from_seq.to_bytes(8, "big")))
        while True:
            assert self.dealer.poll(10_000), "no replay answer"
            empty, topic, seq, payload = self.dealer.recv_multipart()
            if seq == END_SEQ:
                return
            seq = int.from_bytes(seq, "big")
            if seq <= self.last:
                self.duplicates_seen += 1
                continue
            self._apply(seq, payload)

    def follow(self, until: int):
        while self.last < until:
            if not self.sub.poll(200):
                self.replay(self.last + 1)  # quiet: maybe the slow joiner missed the tail
                continue
            topic, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq <= self.last:
                self.duplicates_seen += 1
            elif seq == self.last + 1:
                self._apply(seq, payload)
            else:
                self.replay(self.last + 1)
                if seq == self.last + 1:
                    self._apply(seq, payload)

    def close(self):
        self.sub.close(0)
        self.dealer.close(0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def publish_nodes(hub, listen, tree, start, count):
    for i in range(start, start + count):
        (node,) = chain(tree, range(i * 1000, i * 1000 + 2 * PAGE))
        listen("device", "stored", node)
        hub.flush()


def test_disconnect_mid_run_then_replay_has_no_gap_and_no_duplicate(ctx):
    pub, rep = ipc_endpoints("replay")
    hub = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep, topic="kv@{namespace}"))
    sub = RawSubscriber(ctx, pub, rep)
    try:
        tree = RadixTree(PAGE)
        listen = hub.attach("m", PAGE)
        publish_nodes(hub, listen, tree, 0, 60)
        sub.follow(61)                      # seq 0 is the restart announcement, 1 the namespace's clear
        sub.sub.close(0)                    # the router goes away mid-run ...
        publish_nodes(hub, listen, tree, 60, 120)
        wait_for(lambda: hub.next_seq == 182, what="the batches it missed sent")
        sub.reconnect()                     # ... comes back, and live batches overlap replay
        publish_nodes(hub, listen, tree, 180, 20)
        sub.follow(201)
        assert sub.applied == list(range(202))
        ring = {b.seq: b.payload for b in hub._publisher.broadcast.since(0)}
        assert sub.payloads == ring
        stored = [decode_batch(sub.payloads[s]).events[0] for s in (2, 101, 201)]
        assert [e.token_ids[0] for e in stored] == [0, 99_000, 199_000]
        assert hub.stats()["replays"] >= 1
    finally:
        sub.close()
        hub.close()


def test_topic_and_seq_frames_are_vllm_framing(ctx):
    pub, rep = ipc_endpoints("frames")
    hub = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep, topic="kv@node-1@{namespace}",
                                data_parallel_rank=2))
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(rep)
    try:
        tree = RadixTree(PAGE)
        listen = hub.attach("qwen", PAGE)
        (node,) = chain(tree, range(PAGE))
        listen("host", "stored", node)
        hub.flush()
        wait_for(lambda: hub.next_seq == 3, what="three batches published")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        frames = [dealer.recv_multipart() for _ in range(4)]
        assert [f[1] for f in frames] == [b"kv@node-1@", b"kv@node-1@qwen", b"kv@node-1@qwen", b""]
        assert [f[2] for f in frames] == [(0).to_bytes(8, "big"), (1).to_bytes(8, "big"), (2).to_bytes(8, "big"),
                                          END_SEQ]
        assert decode_batch(frames[1][3]).events == [AllBlocksCleared()]  # the namespace's first batch
        event = decode_batch(frames[2][3]).events[0]
        assert event.medium == "CPU" and event.block_hashes == block_hashes(list(range(PAGE)), PAGE)
        assert {decode_batch(f[3]).data_parallel_rank for f in frames[:3]} == {2}  # --kv-events-data-parallel-rank
    finally:
        dealer.close(0)
        hub.close()


def rebuild(state, batch):
    for e in batch.events:
        if isinstance(e, AllBlocksCleared):
            for s in state.values():
                s.clear()
        elif isinstance(e, BlockStored):
            state[e.medium].update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            state[e.medium].difference_update(e.block_hashes)


QUEUE = 8  # publisher queue of the stall test, in batches


def test_stalled_subscriber_costs_the_loop_nothing_and_drops_resync(ctx):
    """Two stalls, each shown by what completes rather than by how long it took: a ZMQ
    peer that never reads does not hold the publisher thread (every batch is published
    and a healthy router gets them all), and a publisher thread that is itself stuck
    does not hold the loop (every residency call and flush returns; what does not fit
    in the queue is dropped, counted, then resynchronised)."""
    pub, rep = ipc_endpoints("stall")
    hub = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep, hwm=4, queue_size=QUEUE))
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(pub)               # never read
    healthy = RawSubscriber(ctx, pub, rep)
    tree = RadixTree(PAGE)
    resident: dict[str, dict[int, object]] = {"device": {}, "host": {}}
    listen = hub.attach("m", PAGE, snapshot=lambda: [(t, n) for t, nodes in resident.items()
                                                      for n in nodes.values()])
    gate = StuckJob()
    wait_for(lambda: hub.drained, what="the start's batches published")

    def step(i: int) -> None:
        """One loop turn's residency changes of a fresh node, and the turn's flush."""
        (node,) = chain(tree, range(i * 100, i * 100 + 16 * PAGE))
        listen("device", "stored", node)
        resident["device"][node.id] = node
        if i % 3 == 0:
            listen("device", "removed", node)
            del resident["device"][node.id]
            listen("host", "stored", node)
            resident["host"][node.id] = node
        hub.flush()

    try:
        # 1. The stalled peer: 600 batches, never more queued than fit. The publisher
        # sends past the peer's high-water mark without waiting, so it drains every round.
        for i in range(600):
            step(i)
            if i % (QUEUE - 1) == QUEUE - 2:
                wait_for(lambda: hub.drained, what="the publisher to drain past a stalled peer")
        wait_for(lambda: hub.drained, what="the publisher to drain past a stalled peer")
        assert hub.next_seq == 602 and hub.stats()["dropped"] == 0  # seq 0 and 1: the start's clears
        # 2. The publisher thread stuck inside a job (as in a send that blocks) until
        # `gate` opens; meanwhile the loop goes on.
        assert hub._publisher.submit(gate.job())
        wait_for(gate.entered.is_set, what="the publisher thread to be stuck")
        done = []

        def loop_side():  # what the event loop calls: must return with the thread stuck
            for i in range(600, 2100):
                step(i)
            done.append(hub.stats())

        caller = threading.Thread(target=loop_side, daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "a residency call or flush waited for the stuck publisher"
        # QUEUE batches fit; the next is dropped and counted, once: the namespace then
        # records nothing until its resync is queued.
        [stats] = done
        assert (stats["queue_depth"], stats["dropped"], stats["published"]) == (QUEUE, 1, 602)
        assert hub.resync_pending
        gate.release.set()
        # The thread runs again: the stuck job and the queued batches go out, then the
        # resync (AllBlocksCleared + snapshot) once there is room.
        wait_for(lambda: hub.flush() >= 0 and hub.drained and not hub.resync_pending, what="resync published")
        assert hub.next_seq > 602 + 1 + QUEUE
        healthy.follow(hub.next_seq - 1)
        state = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        for seq in healthy.applied:
            rebuild(state, decode_batch(healthy.payloads[seq]))
        want = {"GPU": set(), "CPU": set()}
        for tier, medium in (("device", "GPU"), ("host", "CPU")):
            for n in resident[tier].values():
                want[medium].update(block_hashes(n.key, PAGE))
        assert state["GPU"] == want["GPU"] and state["CPU"] == want["CPU"]
    finally:
        gate.release.set()
        stalled.close(0)
        healthy.close()
        hub.close()


def test_closing_removes_its_ipc_socket_files_but_not_a_successors(ctx):
    pub, rep = ipc_endpoints("files")
    pub_path, rep_path = pub[len("ipc://"):], rep[len("ipc://"):]
    hub = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep))
    assert os.path.exists(pub_path) and os.path.exists(rep_path)
    hub.close()
    assert not os.path.exists(pub_path) and not os.path.exists(rep_path)   # libzmq leaves them

    # A daemon started on the same endpoints while an old one still runs takes the paths
    # over (libzmq unlinks and binds anew): the old one's close must not remove the new files.
    old = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep))
    new = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep))
    try:
        old.close()
        assert os.path.exists(pub_path) and os.path.exists(rep_path)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        sub.close(0)
    finally:
        new.close()
    assert not os.path.exists(pub_path) and not os.path.exists(rep_path)


def test_a_replay_of_thousands_of_batches_arrives_whole_with_its_end(ctx):
    """A router joining a busy daemon replays its whole ring: every batch and END_SEQ
    arrive (libzmq's default send limit of 1000 messages dropped the rest silently)."""
    pub, rep = ipc_endpoints("big-replay")
    hub = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep))
    sub = RawSubscriber(ctx, pub, rep)
    try:
        tree = RadixTree(PAGE)
        listen = hub.attach("m", PAGE)
        publish_nodes(hub, listen, tree, 0, 3000)
        wait_for(lambda: hub.next_seq == 3002 and hub.drained, what="3000 batches published")
        sub.dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        wait_for(lambda: hub.stats()["replays"] == 1, what="the replay taken")
        # A second requester's answer comes once the first answer was sent whole: the
        # router serves requests in turn. Only then does the first one start reading.
        other = ctx.socket(zmq.DEALER)
        other.connect(rep)
        other.send_multipart((b"", (10**9).to_bytes(8, "big")))  # past the ring: END_SEQ alone
        assert other.poll(10_000) and other.recv_multipart()[2] == END_SEQ
        other.close(0)
        got = []
        while True:
            assert sub.dealer.poll(10_000), f"no END_SEQ after {len(got)} batches"
            _, _, seq, _ = sub.dealer.recv_multipart()
            if seq == END_SEQ:
                break
            got.append(int.from_bytes(seq, "big"))
        assert got == list(range(3002))
        assert hub.stats()["send_errors"] == 0
    finally:
        sub.close()
        hub.close()
