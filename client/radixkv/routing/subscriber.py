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

from .index import TIERS, RoutingIndex
from .wire import decode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)


class WorkerFeed:
    """One daemon's stream. Every batch is classified against what was applied: the next
    seq is applied; an older seq whose payload matches the one applied under that seq is
    a duplicate (replay and live overlap); an older seq with another payload means the
    publisher restarted (reset, replay its ring from 0); a newer seq is a gap, repaired by
    a replay from the last applied seq, whose first answer must match what was applied
    (else the publisher restarted in between)."""

    MAX_BUFFERED = 100_000  # live batches held while a replay is in flight
    RECENT = 1 << 14        # payload fingerprints kept to tell duplicates from a restart
    HOLE_REPLAYS = 3        # replays asked in a row for holes right after one, before a reset

    def __init__(self, name: str, index: RoutingIndex, topic: str = "kv@{namespace}",
                 namespace: str | None = None, media: tuple[str, ...] | None = None):
        """`namespace`: file every batch under it whatever the topic (a vLLM engine's
        stream has no namespace). `media`: the tiers this stream speaks for; a reset or an
        AllBlocksCleared forgets only those (None: all)."""
        self.name = name
        self.key = name  # the fleet's handle for this stream (Daemon.key)
        self.index = index
        self.namespace = namespace
        self.media = media
        head, _, tail = topic.partition("{namespace}")
        self._head, self._tail = head.encode(), tail.encode()
        self._named = "{namespace}" in topic
        self.last_seq: int | None = None     # last seq applied
        self.replay_from: int | None = None  # set while a replay is in flight
        self._buffer: list[tuple[bytes, int, bytes]] = []
        self._recent: dict[int, int] = {}    # seq -> hash(payload) of applied batches
        self._restarted = False              # seen during this replay: replay again from 0
        self._num_answers = 0                # batches this replay has answered
        self._hole_replays = 0               # replays in a row asked for a hole found after one
        self.num_applied = self.num_gaps = self.num_resets = self.num_duplicates = 0
        self.num_restarts = self.num_bad = 0
        index.add_worker(name)

    @property
    def subscribe_prefix(self) -> bytes:
        return self._head

    def namespace_of(self, topic: bytes) -> str:
        if self.namespace is not None:
            return self.namespace
        if not self._named:
            return ""
        end = len(topic) - len(self._tail) if self._tail else len(topic)
        return topic[len(self._head):end].decode(errors="replace")

    def _classify(self, seq: int, payload: bytes) -> str:
        if self.last_seq is None:
            return "apply" if seq == 0 else "gap"
        if seq == self.last_seq + 1:
            return "apply"
        if seq > self.last_seq:
            return "gap"
        return "duplicate" if self._recent.get(seq) == hash(payload) else "restart"

    # -- live stream ---------------------------------------------------------------------

    def on_live(self, topic: bytes, seq: int, payload: bytes, can_replay: bool) -> int | None:
        """One live batch. Returns a seq to replay from when a replay should be requested."""
        if self.replay_from is not None:
            if len(self._buffer) < self.MAX_BUFFERED:
                self._buffer.append((topic, seq, payload))
            return None
        kind = self._classify(seq, payload)
        if kind == "duplicate":
            self.num_duplicates += 1
            return None
        if kind == "restart":
            self._forget_publisher()
            kind = "apply" if seq == 0 or not can_replay else "gap"
        if kind == "gap":
            self.num_gaps += 1
            if can_replay:
                start = self.check_from()
                self.start_replay(start)
                self._buffer.append((topic, seq, payload))
                return start
            self.reset()
        self._apply(topic, seq, payload)
        return None

    # -- replay ----------------------------------------------------------------------------

    def check_from(self) -> int:
        """Where a replay starts: the batch before the last applied one (0 before any). Its
        answer is a duplicate of a batch applied from the same run; another payload there
        is a restart, also when the new run's first batch seen came as the next seq."""
        return max(self.last_seq - 1, 0) if self.last_seq is not None else 0

    def start_replay(self, from_seq: int) -> None:
        self.replay_from = from_seq
        self._restarted = False
        self._num_answers = 0

    def on_replay(self, topic: bytes, seq: int, payload: bytes) -> None:
        """One replayed batch (seq >= 0)."""
        if self.replay_from is None or self._restarted:
            return  # an answer given up on, or one to be asked again from 0
        self._num_answers += 1
        kind = self._classify(seq, payload)
        if kind == "duplicate":
            self.num_duplicates += 1
        elif kind == "restart":
            self._forget_publisher()
            self._restarted = True
        else:
            if kind == "gap" and self.last_seq is not None:
                self.num_gaps += 1
                self.reset()  # the ring no longer holds what was missed
            self._apply(topic, seq, payload)

    def on_replay_end(self, gave_up: bool = False) -> int | None:
        """The replay is complete (END_SEQ), or given up on: apply what arrived live
        meanwhile. Returns a seq to replay from when another replay is needed.

        A replay is always asked from a seq already applied (or 0), which a publisher that
        kept running still holds or has moved past: an empty answer means it restarted
        with fewer batches than were applied, as does a buffered batch older than the last
        applied with another payload. Either forgets the publisher and replays from 0."""
        if not gave_up and not self._restarted and self._num_answers == 0 and self.last_seq is not None:
            self._forget_publisher()
            self._restarted = True
        if self._restarted and not gave_up:
            self.start_replay(0)
            return 0
        self.replay_from = None
        self._restarted = False
        buffered, self._buffer = self._buffer, []
        for i, (topic, seq, payload) in enumerate(buffered):
            kind = self._classify(seq, payload)
            if kind == "duplicate":
                self.num_duplicates += 1
                continue
            if kind == "restart":
                self._forget_publisher()
                if seq != 0 and not gave_up:
                    self.start_replay(0)
                    self._buffer = buffered[i:]
                    return 0
            elif kind != "apply":
                self.num_gaps += 1
                if not gave_up and self._hole_replays < self.HOLE_REPLAYS:
                    # A batch lost after the replay was answered: the ring most likely
                    # still holds it. Ask again (a few times in a row at most).
                    self._hole_replays += 1
                    start = self.check_from()
                    self.start_replay(start)
                    self._buffer = buffered[i:]
                    return start
                self.reset()  # holes replay after replay: do not loop on replays
            self._apply(topic, seq, payload)
        self._hole_replays = 0
        return None

    # -- applying ---------------------------------------------------------------------------

    def _forget_publisher(self) -> None:
        self.num_restarts += 1
        self.reset()
        self.last_seq = None
        self._recent.clear()

    def reset(self) -> None:
        """Forget what this stream told of its worker (every namespace, its media)."""
        self.num_resets += 1
        self.index.clear_worker(self.name, self.namespace, self.media)

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._recent[seq] = hash(payload)
        self._recent.pop(seq - self.RECENT, None)
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.num_bad += 1
            log.warning("worker %s: undecodable batch %d (%s); resetting it", self.name, seq, e)
            self.reset()
            return
        self.index.apply(self.name, self.namespace_of(topic), batch, self.media)
        self.num_applied += 1


@dataclass(frozen=True)
class Daemon:
    """One event stream as a router sees it (connect addresses). A worker may have two:
    its radixkv daemon's, and its vLLM engine's own (`stream="engine"`, `topic=""`,
    `namespace=` the daemon's namespace, `media=("GPU",)`), merged by block hash."""

    name: str                   # the worker
    endpoint: str               # e.g. tcp://10.0.0.5:5557
    replay_endpoint: str = ""   # e.g. tcp://10.0.0.5:5558 ("": no replay)
    stream: str = ""            # tells a worker's streams apart
    topic: str | None = None    # topic template (None: the fleet's)
    namespace: str | None = None        # see WorkerFeed
    media: tuple[str, ...] | None = None  # see WorkerFeed (None: the tiers no sibling claims)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.stream}" if self.stream else self.name


class ZmqFleet:
    """SUB + DEALER sockets of N daemons feeding one RoutingIndex. Not thread-safe: call
    `poll` (or `run`) from one thread; query the index from any."""

    def __init__(self, index: RoutingIndex, daemons: Iterable[Daemon], topic: str = "kv@{namespace}",
                 replay_timeout: float = 2.0, check_interval: float = 1.0,
                 context: zmq.Context | None = None, replay_attempts: int = 3):
        """`check_interval`: how often (seconds) each daemon with replay is asked to replay
        from the last applied seq, which finds batches lost at the tail of a quiet stream
        and a daemon that restarted between two batches (0: never). A replay unanswered
        within `replay_timeout` is asked again on a fresh socket, `replay_attempts` times
        in all, before the feed goes on without it: a request sent to a daemon that died
        or restarted just then is lost, and going on without it would leave what it was
        to repair missing from the index for good."""
        if replay_attempts < 1:
            raise ValueError(f"replay_attempts must be >= 1, got {replay_attempts}")
        self.index = index
        self.replay_timeout = replay_timeout
        self.replay_attempts = replay_attempts
        self._attempts: dict[str, int] = {}  # daemon key -> tries of the replay in flight so far
        self.check_interval = check_interval
        self._checked: dict[str, float] = {}
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket, tuple[WorkerFeed, bool]] = {}
        self._workers: dict[str, tuple[WorkerFeed, zmq.Socket, zmq.Socket | None]] = {}
        self._daemons: dict[str, Daemon] = {}
        self._deadline: dict[str, float] = {}
        for d in daemons:
            self.add(d, topic)

    @property
    def feeds(self) -> dict[str, WorkerFeed]:
        """Feeds by `Daemon.key` (the worker's name unless it has several streams)."""
        return {key: w[0] for key, w in self._workers.items()}

    def add(self, daemon: Daemon, topic: str = "kv@{namespace}") -> WorkerFeed:
        """Follow one more stream; asks it to replay its ring from 0 when it has replay."""
        if daemon.key in self._workers:
            raise ValueError(f"stream {daemon.key!r} is followed already")
        feed = WorkerFeed(daemon.name, self.index, daemon.topic if daemon.topic is not None else topic,
                          namespace=daemon.namespace, media=daemon.media)
        feed.key = daemon.key
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, feed.subscribe_prefix)
        sub.connect(daemon.endpoint)
        self._poller.register(sub, zmq.POLLIN)
        self._by_socket[sub] = (feed, False)
        self._daemons[daemon.key] = daemon
        self._workers[daemon.key] = (feed, sub, self._open_dealer(daemon, feed))
        self._share_media(daemon.name)
        if daemon.replay_endpoint:
            feed.start_replay(0)
            self._request(daemon.key, 0)
        return feed

    def _share_media(self, worker: str) -> None:
        """A stream of `worker` without `media` speaks for the tiers none of its sibling
        streams claims: a radixkv daemon's restart announcement (AllBlocksCleared) or
        reset must not forget the GPU blocks its vLLM engine's own stream reported, or
        they stay lost until the engine stores them again (which of the two replays
        arrives first is a race)."""
        keys = [k for k, d in self._daemons.items() if d.name == worker]
        claimed = {m for k in keys for m in (self._daemons[k].media or ())}
        rest = tuple(m for m in TIERS if m not in claimed)
        for k in keys:
            if self._daemons[k].media is None:
                self._workers[k][0].media = None if not claimed else rest

    def _open_dealer(self, daemon: Daemon, feed: WorkerFeed) -> zmq.Socket | None:
        if not daemon.replay_endpoint:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(daemon.replay_endpoint)
        self._poller.register(dealer, zmq.POLLIN)
        self._by_socket[dealer] = (feed, True)
        return dealer

    def _renew_dealer(self, name: str) -> None:
        """A fresh replay socket: answers to requests given up on never reach the next."""
        feed, sub, dealer = self._workers[name]
        self._poller.unregister(dealer)
        del self._by_socket[dealer]
        dealer.close(0)
        self._workers[name] = (feed, sub, self._open_dealer(self._daemons[name], feed))

    def _request(self, name: str, from_seq: int) -> None:
        _, _, dealer = self._workers[name]
        dealer.send_multipart((b"", seq_bytes(from_seq)))
        now = time.monotonic()
        self._deadline[name] = now + self.replay_timeout
        self._checked[name] = now

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
        self._check_continuity()
        return handled

    def _check_continuity(self) -> None:
        if not self.check_interval:
            return
        now = time.monotonic()
        for name, (feed, _, dealer) in self._workers.items():
            if (dealer is not None and feed.replay_from is None
                    and now - self._checked.get(name, 0.0) > self.check_interval):
                start = feed.check_from()
                feed.start_replay(start)
                self._request(name, start)

    def _on_live_frames(self, feed: WorkerFeed, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            feed.num_bad += 1
            return
        can_replay = self._workers[feed.key][2] is not None
        ask = feed.on_live(frames[0], seq_of(frames[1]), frames[2], can_replay)
        if ask is not None:
            self._request(feed.key, ask)

    def _on_replay_frames(self, feed: WorkerFeed, frames: list[bytes]) -> None:
        if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
            feed.num_bad += 1
            return
        _, topic, seq, payload = frames
        if seq_of(seq) >= 0:
            feed.on_replay(topic, seq_of(seq), payload)
            return
        self._deadline.pop(feed.key, None)
        self._attempts.pop(feed.key, None)
        ask = feed.on_replay_end()
        if ask is not None:
            self._request(feed.key, ask)

    def _expire_replays(self) -> None:
        now = time.monotonic()
        for name, deadline in list(self._deadline.items()):
            if now > deadline:
                del self._deadline[name]
                feed = self._workers[name][0]
                self._renew_dealer(name)
                tries = self._attempts.get(name, 1)
                if tries < self.replay_attempts:
                    log.info("worker %s: no replay answer in %.1fs; asking again", name, self.replay_timeout)
                    self._attempts[name] = tries + 1
                    self._request(name, feed.replay_from)  # the feed goes on buffering meanwhile
                    continue
                self._attempts.pop(name, None)
                log.warning("worker %s: no replay answer in %d tries of %.1fs; continuing without", name,
                            tries, self.replay_timeout)
                feed.on_replay_end(gave_up=True)  # a hole left in what is buffered resets it

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
