"""The daemon's host and storage tiers in vLLM's own KV event stream (`take_events`).

A KV-aware router that follows each vLLM engine's event stream (Dynamo's, llm-d's, vLLM's
own router) learns the engine's GPU blocks there. With this, the same stream also names
the blocks the engine can load from radixkv: the scheduler side follows the daemon's
`WatchEvents` for its namespace, from a snapshot (an engine started late announces what
the daemon already holds), and hands vLLM `CPU` and `STORAGE` events, which vLLM
publishes beside its own. Engines sharing a namespace each announce it: each can load it.

What a router is told:
- blocks as the daemon publishes them (its hashes equal vLLM's when vLLM runs
  `--prefix-caching-hash-algo sha256_cbor` with the namespace's page size as block size);
- never AllBlocksCleared (that would clear the engine's GPU blocks too): where the daemon
  clears, or the stream breaks (the daemon went away or restarted), everything announced
  is withdrawn with BlockRemoved, and the next stream's snapshot announces it again;
- storage blocks are hints the daemon never withdraws (storage evicts unseen); at most
  `max_storage_blocks` are kept announced, the oldest withdrawn first.
While vLLM takes nothing (it takes once per step), at most `max_pending` events wait beyond
a snapshot's; past that they are dropped, what the router was told is withdrawn, and the stream starts over
from a snapshot once vLLM takes again. Runs one thread; `take` and `close` are for vLLM's.
"""

import logging
import threading
from collections.abc import Iterable

import grpc
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from radixkv.channel import Tls, open_channel
from radixkv.messages import channel_options
from radixkv.routing.wire import watch_event_fields
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

log = logging.getLogger("vllm.radixkv")

MEDIA = ("CPU", "STORAGE")  # the tiers announced (the engine's own stream tells GPU)
REMOVED_PER_EVENT = 1024    # block hashes per withdrawal event
RETRY_S = 1.0               # wait before following the daemon again after a broken stream


class TierEvents:
    """Follows the daemon's events of `namespace` at `target` on a thread of its own."""

    def __init__(self, target: str, namespace: str, *, tls: Tls | None = None, token: str | None = None,
                 max_pending: int = 100_000, max_storage_blocks: int = 1 << 20, retry_s: float = RETRY_S):
        self.namespace = namespace
        self.max_pending, self.max_storage_blocks, self.retry_s = max_pending, max_storage_blocks, retry_s
        # The connector's TLS and token, as its other channels: a daemon that asks for
        # them refused the events for good otherwise.
        self._channel = open_channel(target, channel_options(64 << 20), tls, token)
        self._stub = pb_grpc.RadixKVStub(self._channel)
        self._lock = threading.Lock()
        self._pending: list = []                                 # vLLM events not taken yet
        self._room = max_pending  # events that may wait: max_pending, plus the snapshot's
        self._held: dict[str, dict[int, None]] = {m: {} for m in MEDIA}  # after every pending event
        self._told: dict[str, set[int]] = {m: set() for m in MEDIA}      # after the events taken
        self._taken = threading.Event()  # vLLM took since the last overflow
        self._taken.set()
        self._stop = threading.Event()
        self._call = None
        self.num_streams = 0   # streams followed (a new one after each break)
        self.num_overflows = 0
        self._thread = threading.Thread(target=self._run, name="radixkv-tier-events", daemon=True)
        self._thread.start()

    @classmethod
    def for_connector(cls, config) -> "TierEvents":
        """The relay of a connector's `ConnectorConfig`: its daemon, namespace, TLS and token."""
        return cls(config.target, config.namespace, **config.channel())

    # -- vLLM's side -------------------------------------------------------------------

    def take(self) -> list:
        """The events since the last call, in order (vLLM's `take_events`)."""
        with self._lock:
            out, self._pending, self._room = self._pending, [], self.max_pending
            for event in out:
                told = self._told[event.medium]
                if isinstance(event, BlockStored):
                    told.update(event.block_hashes)
                else:
                    told.difference_update(event.block_hashes)
        self._taken.set()
        return out

    def close(self) -> None:
        self._stop.set()
        self._taken.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(5)
        self._channel.close()

    # -- the daemon's side -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._taken.wait()
            if self._stop.is_set():
                break
            try:
                self._call = self._stub.WatchEvents(
                    pb.WatchEventsRequest(namespace=self.namespace, snapshot=True), wait_for_ready=True)
                self.num_streams += 1
                if self._stop.is_set():  # closed while the call was being made
                    self._call.cancel()
                for batch in self._call:
                    if not self._apply(batch.events, batch.snapshot):
                        self._call.cancel()
                        break
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                    log.warning("radixkv: the daemon publishes no KV events (%s); vLLM's KV events "
                                "will not show radixkv's host and storage tiers", e.details())
                    return
                if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED):
                    log.warning("radixkv: following the daemon's KV events: %s: %s", e.code().name, e.details())
            with self._lock:
                self._withdraw_held()
            self._stop.wait(self.retry_s)

    def _apply(self, events: Iterable[pb.KvEvent], snapshot: bool = False) -> bool:
        """Queue one batch's events for vLLM; False when the queue overflowed (the
        stream must start over once vLLM takes again). A snapshot's events always fit."""
        with self._lock:
            before = len(self._pending)
            for e in events:
                kind, fields = watch_event_fields(e)
                if kind == "AllBlocksCleared":
                    self._withdraw_held()
                elif fields["medium"] not in MEDIA:
                    continue
                elif kind == "BlockStored":
                    self._stored(BlockStored(**fields))
                else:
                    held = self._held[fields["medium"]]
                    for h in fields["block_hashes"]:
                        held.pop(h, None)
                    self._pending.append(BlockRemoved(**fields))
            if snapshot:
                self._room += len(self._pending) - before
            if len(self._pending) <= self._room:
                return True
            self._overflow()
            return False

    def _stored(self, event: BlockStored) -> None:
        self._pending.append(event)
        held = self._held[event.medium]
        held.update(dict.fromkeys(event.block_hashes))
        if event.medium == "STORAGE" and len(held) > self.max_storage_blocks:
            oldest = [h for h, _ in zip(held, range(len(held) - self.max_storage_blocks))]
            for h in oldest:
                del held[h]
            self._remove("STORAGE", oldest)

    def _withdraw_held(self) -> None:
        """Tell the router to forget every block it will believe once the queue is taken."""
        for medium in MEDIA:
            self._remove(medium, list(self._held[medium]))
            self._held[medium].clear()

    def _overflow(self) -> None:
        """vLLM took nothing for too long: drop the queue, withdraw what vLLM did hand on."""
        self.num_overflows += 1
        self._pending = []
        for medium in MEDIA:
            self._held[medium].clear()
            self._remove(medium, list(self._told[medium]))
        self._taken.clear()
        log.warning("radixkv: %d KV events waited for vLLM to take them; dropped, announced again "
                    "from a snapshot once vLLM steps", self.max_pending)

    def _remove(self, medium: str, hashes: list[int]) -> None:
        for i in range(0, len(hashes), REMOVED_PER_EVENT):
            self._pending.append(BlockRemoved(block_hashes=hashes[i:i + REMOVED_PER_EVENT], medium=medium,
                                              group_idx=0))


__all__ = ["TierEvents"]
