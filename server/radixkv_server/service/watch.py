"""WatchEvents: one reader of the daemon's KV events over gRPC (docs/events.md).

The stream reads an in-process subscription of the event hub (`events.fanout`): the same
numbered batches the ZMQ publisher sends, converted to `KvEventBatch` messages, after the
current state when the reader asks for a snapshot. Its buffer
is bounded (`--kv-events-subscriber-buffer`): a reader that falls that far behind is cut
off with ABORTED naming the from_seq to resume with, so it never slows the publisher or
an engine. The stream ends (OK) when the daemon begins shutting down; one whose reader
stopped reading (its writes wait on gRPC flow control) holds the server's stop for up to
--shutdown-grace, as any call in progress does.
"""

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

import grpc
from radixkv.v1 import radixkv_pb2 as pb

from ..events import AsyncSubscription, PublishedBatch, ReplayUnavailable, SubscriberLagged, Subscription
from ..events.builder import TIER_MEDIUM
from ..events.hub import NamespaceEvents
from ..events.publisher import MAX_BATCH_BYTES, MAX_EVENTS_PER_BATCH
from . import reasons
from .errors import ServiceError, precondition, unavailable
from .registration import check_namespace_name

_TIER_OF = {medium: tier for tier, medium in TIER_MEDIUM.items()}
SNAPSHOT_SLICE = 2  # (tier, node) pairs recorded and hashed per loop turn while a snapshot is made
_KIND = {"BlockStored": pb.KvEvent.BLOCK_STORED, "BlockRemoved": pb.KvEvent.BLOCK_REMOVED,
         "AllBlocksCleared": pb.KvEvent.ALL_BLOCKS_CLEARED}


async def watch(daemon, request: pb.WatchEventsRequest) -> AsyncIterator[pb.KvEventBatch]:
    """The batches of `request.namespace` ("" every one; daemon-wide batches always come),
    from `request.from_seq` when set, or after a snapshot of the current state when asked
    (`snapshot_batches`). FAILED_PRECONDITION when events are off, OUT_OF_RANGE when the
    replay buffer no longer (or not yet) holds from_seq, ABORTED when the reader fell
    behind, UNAVAILABLE once shutdown has begun, INVALID_ARGUMENT for a snapshot with
    from_seq or a namespace name that cannot exist, NOT_FOUND for a snapshot of an unknown
    namespace."""
    hub = daemon.events
    if hub is None:
        raise precondition(reason=reasons.EVENTS_OFF, message="KV events are off: start the daemon with --kv-events-watch true "
                           "(or a --kv-events-endpoint)")
    if not daemon.accepting:
        raise unavailable("the daemon is shutting down", reasons.SHUTTING_DOWN)
    if request.namespace:  # one that does not exist yet may come: wait for it; one that cannot, refuse
        check_namespace_name(request.namespace)
    from_seq = request.from_seq if request.HasField("from_seq") else None
    if request.snapshot and from_seq is not None:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           "snapshot and from_seq exclude each other: a snapshot is followed by live batches")
    namespaces = daemon.selected(request.namespace) if request.snapshot else []
    try:
        # What is published while a snapshot is sent waits for the reader, as a replay's backlog.
        sub = hub.subscribe(from_seq, hold=request.snapshot)
    except ReplayUnavailable as e:
        raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, str(e)) from None
    try:
        if request.snapshot:
            async for message in snapshot_batches(namespaces, sub.start_seq, daemon.instance):
                yield message
            sub.resume()
        async for item in _until_stopping(sub, daemon.stopping):
            if not request.namespace or item.namespace in (request.namespace, ""):
                yield daemon.watch_messages.get(item)
    except SubscriberLagged as e:
        if e.while_held:
            raise ServiceError(grpc.StatusCode.ABORTED,
                               f"more than {hub.config.ring_size} batches (or {hub.config.ring_bytes} bytes) were "
                               f"published while this stream's snapshot was sent: raise --kv-events-replay-size "
                               f"(or -bytes), or take the snapshot when the daemon is less busy") from None
        raise ServiceError(grpc.StatusCode.ABORTED,
                           f"this stream fell more than {hub.config.subscriber_buffer} batches (or "
                           f"{hub.config.ring_bytes} bytes) behind; "
                           f"resubscribe with from_seq={e.missed_from} (OUT_OF_RANGE if the replay buffer "
                           f"no longer holds it: then start over with a snapshot)") from None
    finally:
        sub.close()  # also when the reader left during the snapshot


async def snapshot_batches(namespaces, seq: int, instance: str) -> AsyncIterator[pb.KvEventBatch]:
    """Per namespace with events, AllBlocksCleared then a BlockStored for every node held
    on each tier, as `snapshot` batches numbered `seq` (the first live batch's). The walk
    begins after the live subscription did, so the live batches that follow (from `seq`)
    bring the state on from there. A batch ends at MAX_EVENTS_PER_BATCH events or about
    MAX_BATCH_BYTES, as live ones do. Each batch is made when the reader is ready for it, on
    the loop in slices of SNAPSHOT_SLICE (tier, node) pairs (`NamespaceEvents.snapshot_slices`,
    whatever the tree's size), its events written into the batch in place, with the
    loop's other work between slices. An engine's call waits a slice per loop turn it
    needs: measured with 10k nodes (`make bench`, events section), a Match meanwhile took
    0.63 ms at p50 and 1.7 ms at p99 (the snapshot 0.51 s), against 0.48 and 0.67 ms with
    no reader; slices of 8 pairs, before short nodes hashed faster, gave 1.9 and 3.8 ms.
    Hashing on a thread instead made calls wait for the GIL (p50 2-24 ms, max 0.2 s)."""
    ts = time.time()
    for ns in namespaces:
        listener = ns.cache.residency_listener
        if not isinstance(listener, NamespaceEvents) or listener.closed:
            continue
        batch, size = _snapshot_batch(seq, ns.name, ts, instance), 0
        for built, keys in listener.snapshot_slices(SNAPSHOT_SLICE):
            for event, key in zip(built, keys):
                added = batch.events.add()
                _fill(added, event, key)  # in place: a batch is never copied whole
                size += added.ByteSize()
                if len(batch.events) == MAX_EVENTS_PER_BATCH or size >= MAX_BATCH_BYTES:
                    yield batch
                    batch, size = _snapshot_batch(seq, ns.name, ts, instance), 0
            await asyncio.sleep(0)  # engines' calls run between slices
        if batch.events:
            yield batch


def _snapshot_batch(seq: int, namespace: str, ts: float, instance: str) -> pb.KvEventBatch:
    return pb.KvEventBatch(seq=seq, namespace=namespace, ts=ts, daemon_instance=instance, snapshot=True)


async def _until_stopping(sub: Subscription, stopping: asyncio.Event) -> AsyncIterator[PublishedBatch]:
    """The subscription's batches until `stopping` is set; always unsubscribes."""
    stream = AsyncSubscription(sub)
    stop = asyncio.ensure_future(stopping.wait())
    nxt = None
    try:
        while True:
            item = sub.get_nowait()  # raises SubscriberLagged once cut off
            if item is None:
                nxt = asyncio.ensure_future(anext(stream))
                await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    return
                item = nxt.result()
            yield item
    finally:
        stop.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()  # the reader went away mid-wait (a deadline): else a pending task is destroyed
        stream.close()


class BatchMessages:
    """The `KvEventBatch` messages of the latest published batches, made once for every
    WatchEvents stream that sends them (made per stream, a 1 MiB batch cost each reader
    11 ms on the loop). Streams only send a message, never change it. The newest KEEP
    are kept (readers keep up with the newest; one that lags makes its own again)."""

    KEEP = 16

    def __init__(self, instance: str):
        self.instance = instance
        self._made: OrderedDict[int, pb.KvEventBatch] = OrderedDict()

    def get(self, item: PublishedBatch) -> pb.KvEventBatch:
        message = self._made.get(item.seq)
        if message is None:
            message = self._made[item.seq] = batch_message(item, self.instance)
            if len(self._made) > self.KEEP:
                self._made.popitem(last=False)
        return message


def batch_message(item: PublishedBatch, instance: str) -> pb.KvEventBatch:
    decoded = item.batch
    batch = pb.KvEventBatch(seq=item.seq, namespace=item.namespace, ts=decoded.ts, daemon_instance=instance)
    keys = item.extra_keys
    for i, event in enumerate(decoded.events):
        _fill(batch.events.add(), event, keys[i] if i < len(keys) else b"")
    return batch


def _fill(out: pb.KvEvent, event, extra_key: bytes) -> None:
    """`out` (a fresh message, in its batch already) becomes `event` with its radixkv key."""
    kind = out.kind = _KIND[type(event).__name__]
    if kind == pb.KvEvent.ALL_BLOCKS_CLEARED:
        return
    out.tier = _TIER_OF.get(event.medium, "")
    out.medium = event.medium or ""
    out.block_hashes.extend(event.block_hashes)
    if kind == pb.KvEvent.BLOCK_STORED:
        if event.parent_block_hash is not None:
            out.parent_block_hash = event.parent_block_hash
        out.token_ids.extend(event.token_ids)
        out.block_size = event.block_size
        out.extra_key = extra_key
        out.lora_name = event.lora_name or ""
