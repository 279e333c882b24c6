"""Following N daemons' KV-event streams: sequence tracking, gap repair by replay, resets.

`WorkerFeed` (radixkv.routing.feed) is the per-daemon state machine, free of sockets.
`ZmqFleet` wires feeds to ZMQ: a SUB socket per daemon (vLLM's PUB framing) and a DEALER
per daemon for replay, all polled from the caller's thread (`poll`, or `run` in a thread).
"""

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import zmq

from .feed import WorkerFeed
from .index import TIERS, RoutingIndex
from .wire import seq_bytes, seq_of

log = logging.getLogger(__name__)


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
