"""`WorkerFeed`: one daemon's KV-event stream as a state machine, free of sockets.

Feed it live batches (`on_live`) and replay answers (`on_replay`, `on_replay_end`); it
applies batches to a `RoutingIndex` exactly once and in order, asks for a replay (returns
the seq to replay from) when it sees a gap, and resets the worker (forgets what it held)
when a gap cannot be repaired or the publisher restarted. Resetting loses information but
never invents it: the index then underestimates that worker until new events arrive.
`radixkv.routing.subscriber.ZmqFleet` wires feeds to ZMQ sockets.
"""

import logging

import msgspec

from .index import RoutingIndex
from .wire import decode_batch

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


__all__ = ["WorkerFeed"]
