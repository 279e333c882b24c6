"""Following N daemons' KV-event streams: sequence tracking, gap repair by replay, resets.

`WorkerFeed` is the per-daemon state machine, free of sockets: feed it live batches
(`on_live`) and replay answers (`on_replay`, `on_replay_end`); it applies batches to a
`RoutingIndex` exactly once and in order, asks for a replay (returns the seq to replay
from) when it sees a gap, and resets the worker (forgets what it held) when a gap cannot
be repaired or the publisher restarted. Resetting loses information but never invents
it: the index then underestimates that worker until new events arrive.

`ZmqFleet` wires feeds to ZMQ: a SUB socket per daemon (vLLM's PUB framing) and a DEALER
per daemon for replay, all polled from the caller's thread (`poll`, or `run` in a thread).
"""

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import zmq

from .index import RoutingIndex
from .wire import decode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)


class WorkerFeed:
    MAX_BUFFERED = 100_000  # live batches held while a replay is in flight

    def __init__(self, name: str, index: RoutingIndex, topic: str = "kv@{namespace}"):
        self.name = name
        self.index = index
        head, _, tail = topic.partition("{namespace}")
        self._head, self._tail = head.encode(), tail.encode()
        self._named = "{namespace}" in topic
        self.last_seq: int | None = None  # last seq applied
        self.replay_from: int | None = None  # set while a replay is in flight
        self._buffer: list[tuple[bytes, int, bytes]] = []
        self._dups: tuple[int, int] | None = None  # live seqs already applied by a replay
        self.num_applied = self.num_gaps = self.num_resets = self.num_duplicates = 0
        self.num_bad = 0
        index.add_worker(name)

    @property
    def subscribe_prefix(self) -> bytes:
        return self._head

    def namespace_of(self, topic: bytes) -> str:
        if not self._named:
            return ""
        end = len(topic) - len(self._tail) if self._tail else len(topic)
        return topic[len(self._head):end].decode(errors="replace")

    # -- live stream ---------------------------------------------------------------------

    def on_live(self, topic: bytes, seq: int, payload: bytes, can_replay: bool) -> int | None:
        """One live batch. Returns a seq to replay from when a replay should be requested."""
        if self.replay_from is not None:
            if len(self._buffer) < self.MAX_BUFFERED:
                self._buffer.append((topic, seq, payload))
            return None
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq == expected or self.last_seq is None and not can_replay:
            self._apply(topic, seq, payload)
            return None
        if seq > expected:
            self.num_gaps += 1
            if can_replay:
                self.start_replay(expected)
                self._buffer.append((topic, seq, payload))
                return expected
            self.reset()
            self._apply(topic, seq, payload)
            return None
        if self._dups is not None and self._dups[0] <= seq <= self._dups[1]:
            self.num_duplicates += 1
            return None
        self.reset()  # seq went back outside any replay: the publisher restarted
        self._apply(topic, seq, payload)
        return None

    # -- replay ----------------------------------------------------------------------------

    def start_replay(self, from_seq: int) -> None:
        self.replay_from = from_seq
        self._buffer = []

    def on_replay(self, topic: bytes, seq: int, payload: bytes) -> None:
        """One replayed batch (seq >= 0)."""
        if self.replay_from is None:
            return  # a late answer to a replay given up on
        if seq == 0 and self.replay_from > 0 and self.last_seq is not None:
            self.reset()  # the ring starts again at 0: a new publisher
            self.last_seq = None
        if self.last_seq is None:
            if seq > self.replay_from:
                self.num_gaps += 1  # joined late: what came before the ring is unknown
        elif seq <= self.last_seq:
            self.num_duplicates += 1
            return
        elif seq != self.last_seq + 1:
            self.num_gaps += 1
            self.reset()  # the ring no longer holds what was missed
        self._apply(topic, seq, payload)

    def on_replay_end(self) -> None:
        """The replay is complete (END_SEQ) or given up on: apply what arrived live meanwhile."""
        start = self.replay_from
        self.replay_from = None
        if start is not None and self.last_seq is not None:
            self._dups = (start, self.last_seq)
        for topic, seq, payload in self._buffer:
            if self.last_seq is not None and seq <= self.last_seq:
                self.num_duplicates += 1
                continue
            if self.last_seq is not None and seq != self.last_seq + 1:
                self.num_gaps += 1
                self.reset()  # still a hole right after a replay: do not loop on replays
            self._apply(topic, seq, payload)
        self._buffer = []

    # -- applying ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything this worker held (all namespaces)."""
        self.num_resets += 1
        self.index.clear_worker(self.name)

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        if self._dups is not None and seq > self._dups[1]:
            self._dups = None
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.num_bad += 1
            log.warning("worker %s: undecodable batch %d (%s); resetting it", self.name, seq, e)
            self.reset()
            return
        self.index.apply(self.name, self.namespace_of(topic), batch)
        self.num_applied += 1


@dataclass(frozen=True)
class Daemon:
    """One daemon's event endpoints as a router sees them (connect addresses)."""

    name: str
    endpoint: str               # e.g. tcp://10.0.0.5:5557
    replay_endpoint: str = ""   # e.g. tcp://10.0.0.5:5558 ("": no replay)


class ZmqFleet:
    """SUB + DEALER sockets of N daemons feeding one RoutingIndex. Not thread-safe: call
    `poll` (or `run`) from one thread; query the index from any."""

    def __init__(self, index: RoutingIndex, daemons: Iterable[Daemon], topic: str = "kv@{namespace}",
                 replay_timeout: float = 2.0, context: zmq.Context | None = None):
        self.index = index
        self.replay_timeout = replay_timeout
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket, tuple[WorkerFeed, bool]] = {}
        self._workers: dict[str, tuple[WorkerFeed, zmq.Socket, zmq.Socket | None]] = {}
        self._deadline: dict[str, float] = {}
        for d in daemons:
            self.add(d, topic)

    @property
    def feeds(self) -> dict[str, WorkerFeed]:
        return {name: w[0] for name, w in self._workers.items()}

    def add(self, daemon: Daemon, topic: str = "kv@{namespace}") -> WorkerFeed:
        """Follow one more daemon; asks it to replay its ring from 0 when it has replay."""
        feed = WorkerFeed(daemon.name, self.index, topic)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, feed.subscribe_prefix)
        sub.connect(daemon.endpoint)
        dealer = None
        if daemon.replay_endpoint:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(daemon.replay_endpoint)
            self._poller.register(dealer, zmq.POLLIN)
            self._by_socket[dealer] = (feed, True)
        self._poller.register(sub, zmq.POLLIN)
        self._by_socket[sub] = (feed, False)
        self._workers[daemon.name] = (feed, sub, dealer)
        if dealer is not None:
            feed.start_replay(0)
            self._request(daemon.name, 0)
        return feed

    def _request(self, name: str, from_seq: int) -> None:
        _, _, dealer = self._workers[name]
        dealer.send_multipart((b"", seq_bytes(from_seq)))
        self._deadline[name] = time.monotonic() + self.replay_timeout

    def poll(self, timeout: float = 0.1) -> int:
        """Handle whatever arrives within `timeout` seconds; returns frames handled."""
        handled = 0
        for sock, _ in self._poller.poll(int(timeout * 1000)):
            feed, is_replay = self._by_socket[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handled += 1
                if is_replay:
                    self._on_replay_frames(feed, frames)
                else:
                    self._on_live_frames(feed, frames)
        self._expire_replays()
        return handled

    def _on_live_frames(self, feed: WorkerFeed, frames: list[bytes]) -> None:
        if len(frames) != 3:
            feed.num_bad += 1
            return
        can_replay = self._workers[feed.name][2] is not None
        ask = feed.on_live(frames[0], seq_of(frames[1]), frames[2], can_replay)
        if ask is not None:
            self._request(feed.name, ask)

    def _on_replay_frames(self, feed: WorkerFeed, frames: list[bytes]) -> None:
        if len(frames) != 4 or frames[0] != b"":
            feed.num_bad += 1
            return
        _, topic, seq, payload = frames
        if seq_of(seq) < 0:
            self._deadline.pop(feed.name, None)
            feed.on_replay_end()
        else:
            feed.on_replay(topic, seq_of(seq), payload)

    def _expire_replays(self) -> None:
        now = time.monotonic()
        for name, deadline in list(self._deadline.items()):
            if now > deadline:
                del self._deadline[name]
                feed = self._workers[name][0]
                log.warning("worker %s: no replay answer in %.1fs; continuing without", name,
                            self.replay_timeout)
                feed.on_replay_end()  # a hole left in the buffered batches resets the worker

    def run(self, stop) -> None:
        """Poll until `stop` (a threading.Event) is set."""
        while not stop.is_set():
            self.poll(0.05)

    def close(self) -> None:
        """Close every socket (idempotent)."""
        for _, sub, dealer in self._workers.values():
            sub.close(0)
            if dealer is not None:
                dealer.close(0)
        self._workers.clear()
        self._by_socket.clear()
