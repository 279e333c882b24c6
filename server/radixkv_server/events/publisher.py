"""The publisher thread: builds events from queued records, encodes vLLM batches, numbers
them, keeps them for replay, sends them on ZMQ and hands them to in-process subscribers.

ZMQ framing is vLLM 0.32's (`radixkv.routing.wire`): PUB multipart (topic, 8-byte
big-endian seq, payload); a ROUTER answers `(b"", seq)` with every ring batch from seq on
as `(b"", topic, seq, payload)`, then `(b"", b"", END_SEQ, b"")`. Like vLLM, an endpoint
with `*`, `::`, `ipc://` or `inproc://` is bound and any other is connected to; the replay
endpoint is always bound. A PUB socket never blocks: a subscriber past its high-water mark
loses batches (it sees a gap in seq and replays).

The thread owns the sockets and the builders; `Broadcast` (its own lock) is shared with
the readers. The event loop only puts jobs on the bounded queue.
"""

import logging
import os
import queue
import threading
from collections import deque

import zmq

from radixkv.routing.wire import END_SEQ, KVEventBatch, encode_batch, seq_bytes

from .config import EventsConfig
from .fanout import Broadcast

log = logging.getLogger("radixkv.events")
_IDLE_POLL_S = 0.005  # how often an idle thread looks at the replay socket
MAX_EVENTS_PER_BATCH = 1024  # a larger job (a resync's snapshot) goes out as several batches
# ... and so does one whose batch would pass this (long prompts' BlockStored are 8 KiB per
# 2k tokens): a router's gRPC channel takes 4 MiB messages by default.
MAX_BATCH_BYTES = 1 << 20


def _bind_or_connect(sock: zmq.Socket, endpoint: str, bound_files: list) -> None:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        _bind(sock, endpoint, bound_files)
    else:
        sock.connect(endpoint)


def _bind(sock: zmq.Socket, endpoint: str, bound_files: list) -> None:
    """Bind; an `ipc://` path's socket file is noted as (path, inode) so that closing can
    remove it (libzmq leaves it behind). Abstract (`ipc://@name`) endpoints have none."""
    sock.bind(endpoint)
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else ""
    if path and not path.startswith("@"):
        try:
            bound_files.append((path, os.stat(path).st_ino))
        except OSError:
            pass


def _remove_socket_files(bound_files: list) -> None:
    """Remove the socket files this publisher bound, unless another process has bound the
    path since (a daemon started meanwhile on the same endpoint: its file has another inode)."""
    for path, inode in bound_files:
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass
    bound_files.clear()


class Publisher:
    """Job = (builder, namespace, topic, ts, records). `submit` never blocks."""

    def __init__(self, config: EventsConfig):
        self.config = config
        self.broadcast = Broadcast(config.ring_size, config.subscriber_buffer, config.ring_bytes)
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        self._bound_files: list[tuple[str, int]] = []
        try:
            if config.endpoint:
                self._pub = self._ctx.socket(zmq.PUB)
                self._pub.set_hwm(config.hwm)
                self._pub.setsockopt(zmq.LINGER, 0)
                _bind_or_connect(self._pub, config.endpoint, self._bound_files)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A whole ring fits one requester's pipe (libzmq's default of 1000 messages
                # dropped the rest, END_SEQ with it, silently); past that, sending fails
                # (ROUTER_MANDATORY) and is counted instead of vanishing.
                self._replay.setsockopt(zmq.SNDHWM, config.ring_size + 2)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                _bind(self._replay, config.replay_endpoint, self._bound_files)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot open {config.endpoint or config.replay_endpoint}: {e}") from e
        self.num_dropped = 0          # batches the queue had no room for (loop side)
        self.num_send_errors = 0      # batches the PUB socket refused (publisher side)
        self.num_replays = 0          # replay requests answered
        self.num_submitted = 0        # jobs queued (loop side)
        self.num_done = 0             # jobs published or failed (publisher side)
        self.num_build_errors = 0     # jobs that failed to build (publisher side)
        self.failed_builds: deque[str] = deque()  # their namespaces, for the loop to resync
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        self._thread.start()

    # -- loop side ---------------------------------------------------------------------

    def submit(self, job) -> bool:
        """Queue a job; False (and counted in num_dropped) when the queue is full."""
        try:
            self._queue.put_nowait(job)
            self.num_submitted += 1
            return True
        except queue.Full:
            self.num_dropped += 1
            return False

    def has_room(self, batches: int) -> bool:
        """At least `batches` more jobs fit in the queue now."""
        return self._queue.qsize() + batches <= self.config.queue_size

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued (up to `timeout`), stop the thread, close sockets. Idempotent."""
        if not self._stop.is_set():
            self._stop.set()
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._thread_alive():
            return  # the thread still owns them; it is a daemon thread and dies with us
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()
        _remove_socket_files(self._bound_files)

    def _thread_alive(self) -> bool:
        return getattr(self, "_thread", None) is not None and self._thread.is_alive()

    # -- publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        idle = _IDLE_POLL_S if self._replay is not None else None
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                job = self._queue.get(timeout=idle)
            except queue.Empty:
                continue
            if job is None:
                break
            try:
                self._publish(*job)
            except Exception:  # one bad job must not stop the stream; its namespace is resynced
                log.exception("kv events: dropping a batch of %r that failed to build", job[1])
                self.num_build_errors += 1
                self.failed_builds.append(job[1])
            self.num_done += 1
        if self._replay is not None:
            self._serve_replays()

    def _publish(self, builder, namespace: str, topic: bytes, ts: float, records) -> None:
        events, extra_keys = builder.build(records)
        for start in range(0, max(len(events), 1), MAX_EVENTS_PER_BATCH):
            end = start + MAX_EVENTS_PER_BATCH
            for payload, keys in self._encoded(ts, events[start:end], extra_keys[start:end]):
                self._send(namespace, topic, payload, keys)

    def _encoded(self, ts: float, events: list, extra_keys: list):
        """(payload, extra keys) of batches holding `events` in order, each at most
        MAX_BATCH_BYTES (with its extra keys) unless it is one event."""
        payload = encode_batch(KVEventBatch(ts=ts, events=events, data_parallel_rank=self.config.data_parallel_rank))
        size = len(payload) + sum(len(k) for k in extra_keys)  # WatchEvents carries each event's radixkv key too
        if size <= MAX_BATCH_BYTES or len(events) < 2:
            yield payload, tuple(extra_keys)
            return
        half = len(events) // 2
        yield from self._encoded(ts, events[:half], extra_keys[:half])
        yield from self._encoded(ts, events[half:], extra_keys[half:])

    def _send(self, namespace: str, topic: bytes, payload: bytes, extra_keys: tuple[bytes, ...]) -> None:
        """Publish one batch: into the ring and to WatchEvents, and on ZMQ."""
        item = self.broadcast.publish(namespace, topic, payload, extra_keys)
        if self._pub is not None:
            try:
                self._pub.send_multipart((topic, seq_bytes(item.seq), payload), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                self.num_send_errors += 1

    def _serve_replays(self) -> None:
        try:
            while self._replay.poll(0):
                self._serve_replay(self._replay.recv_multipart(zmq.NOBLOCK))
        except zmq.ZMQError:
            log.exception("kv events: replay socket error; replays resume with the next request")

    def _serve_replay(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        self.num_replays += 1
        for item in self.broadcast.since(int.from_bytes(start, "big")):
            if not self._send_replay((client, b"", item.topic, seq_bytes(item.seq), item.payload)):
                return
        self._send_replay((client, b"", b"", END_SEQ, b""))

    def _send_replay(self, frames) -> bool:
        """Send one replay message; False (counted) when the requester is gone or has a
        full pipe (it asked again without reading): the rest of this answer is not sent,
        and with no END_SEQ the requester asks again."""
        try:
            self._replay.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            self.num_send_errors += 1
            return False

