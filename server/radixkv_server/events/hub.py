"""The daemon's KV-event hub, on the event loop's side.

Wiring (a few lines in the service layer):

    hub = EventHub(EventsConfig.from_daemon(config), call_later=loop.call_later)
    listener = hub.attach(namespace, page_size, snapshot=lambda: resident(tree))  # one per tree
    cache.residency_listener = listener   # the core's seam (core/residency.py)
    ...
    listener.clear()      # the namespace is dropped (or its tree is rebuilt: attach again)
    hub.close()           # at shutdown, after the gRPC server has stopped

The core calls `listener.residency_changed(tier, change, node)` (tier "device", "host" or
"storage", change "stored" or "removed"). The listener copies nothing: it records the
node's token path as immutable `(id, key, parent's)` cells (`token_path`, kept on the
node: keys are immutable bytes) and returns in a few us, however deep the node.
Records are flushed as one batch per namespace (one `call_later(0, flush)` per loop turn,
or the caller's explicit `flush()`); hashing, encoding and sending happen on the
publisher thread. `resident(tree)` yields `(tier, node)` for every (tier, node) pair the
core knows of, storage included (for nodes still in the tree).

A slow subscriber or socket never blocks the loop: the queue to the publisher thread is
bounded, a batch it has no room for is dropped and counted (`num_dropped`), and the
namespace is then resynchronised: its next batch starts with AllBlocksCleared followed by
a BlockStored for every (tier, node) of the snapshot (without a snapshot function,
AllBlocksCleared alone: routers then underestimate that namespace until new events arrive). Sequence numbers
stay contiguous: they are assigned to batches as they are published.
"""

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from radixkv.routing.wire import Event

from .builder import CLEAR_RECORD, REMOVED, STORED, TIER_MEDIUM, EventBuilder
from .config import EventsConfig
from .fanout import Subscription
from .publisher import Publisher

log = logging.getLogger("radixkv.events")
_CHANGES = {"stored": STORED, "removed": REMOVED}
RESYNC_RETRY_S = 0.05  # how soon a dropped namespace's resync is tried again
RESYNC_SLICE = 1024  # (tier, node) pairs a resync records per loop turn (~1 ms)


def _record(tier: str, change: str, node) -> tuple:
    medium = TIER_MEDIUM.get(tier)
    kind = _CHANGES.get(change)
    if medium is None or kind is None:
        raise ValueError(f"residency change must be (device|host|storage, stored|removed), "
                         f"got ({tier!r}, {change!r})")
    if node.parent is None:
        raise ValueError("a root node has no pages and no residency")
    return (kind, medium, node.extra_key, token_path(node))


def _told_in_presence(tier: str, node, snapshot: bool = False) -> bool:
    """Whether presence events (`EventsConfig.presence`) tell this change of `node` on
    `tier`: only when the node's other tier holds none of it, as the node is now (a split
    gives both parts the same residency, so it is read here, on the loop, not learned
    from earlier records). Storage is never told. A snapshot tells each node once: its
    device pair, or its host pair when it is not on the device."""
    s = node.full
    if tier == "device":
        return snapshot or not (s.host_valid and not s.shards_missing)
    return tier == "host" and s.device_pages is None


def token_path(node) -> tuple:
    """The node's token path from the root as immutable cells `(id, key, parent's cell)`
    (the root's cell: None), kept on the node (`Node.event_path`) so that a record costs
    O(1) however deep the node: only nodes whose cell is missing or whose key changed (a
    split gives the lower part a shorter key, and a new parent) get a new one. A cell of
    an ancestor made before a split still names the same tokens (the split node keeps its
    id and its last page), so cells made under it stay right; removed nodes' ids are never
    reused."""
    stale = []
    while node.parent is not None:
        cell = node.event_path
        if cell is not None and cell[1] is node.key:
            break
        stale.append(node)
        node = node.parent
    else:
        cell = None
    for node in reversed(stale):
        cell = node.event_path = (node.id, node.key, cell)
    return cell


def resident(tree) -> Iterator[tuple[str, object]]:
    """A snapshot function's answer for a core tree, what a resync announces per tier:
    ("device", node) for every node whose pages are on the device, ("host", node) for
    every node with a complete valid host copy (every tensor-parallel shard arrived), and
    ("storage", node) for every node the storage tier holds (`stored`). The core knows
    storage only for nodes still in the tree: pages stored and then evicted from the host
    (storage-only) are not in it, so a resync cannot re-announce them.

    It may be consumed across loop turns while the tree changes (a WatchEvents snapshot
    takes it a slice at a time): it walks a copy of the node list taken at its first
    step, skips nodes removed since (and every node once the namespace closed: its tree
    is unlinked), and tells each node's tiers as they are when it gets there. A node
    split since then also yields its new upper part, which no live event announces (a
    split changes no residency) and the copy does not hold."""
    nodes = list(tree.nodes.values())
    newest = tree.newest_id()
    tops: set[int] = set()  # upper parts of splits since the copy, yielded once
    for node in nodes:
        if node.parent is None:
            continue  # a root
        if tree.nodes.get(node.id) is node:  # not removed since the copy
            yield from _tiers(node)
        up = node.parent  # (a removed node keeps it: the part split off it may still be there)
        while up is not None and up.id > newest and up.parent is not None and up.id not in tops:
            tops.add(up.id)
            if tree.nodes.get(up.id) is up:
                yield from _tiers(up)
            up = up.parent


def _tiers(node) -> Iterator[tuple[str, object]]:
    s = node.full
    if s.device_pages is not None:
        yield "device", node
    if s.host_valid and not s.shards_missing:
        yield "host", node
    if s.stored:
        yield "storage", node


class NamespaceEvents:
    """The residency listener of one namespace (one attachment: one tree)."""

    __slots__ = ("namespace", "topic", "builder", "snapshot", "pending", "resync", "_hub", "closed",
                 "num_invalid", "_resyncing")

    def __init__(self, hub: "EventHub", namespace: str, page_size: int,
                 snapshot: Callable[[], Iterable[tuple[str, object]]] | None):
        self._hub = hub
        self.namespace = namespace
        self.topic = hub.config.topic_for(namespace)
        self.builder = EventBuilder(page_size, hub.config.hash_seed, presence=hub.config.presence)  # the thread's only
        self.snapshot = snapshot
        self.pending: list[tuple] = []
        self.resync = False  # a batch was lost: a resync is due (see `take`)
        self._resyncing: Iterator[tuple[str, object]] | None = None  # the snapshot a resync is telling
        self.closed = False
        self.num_invalid = 0  # seam calls with an unknown tier or change (a core bug)

    def residency_changed(self, tier: str, change: str, node) -> None:
        """The core's seam (core/residency.py): record that `node`'s pages were stored on
        or removed from `tier`. Never raises (the seam's contract): a call that names an
        unknown tier or change is logged and counted in `num_invalid`."""
        if self.closed or self.resync or (self._hub.config.presence and not _told_in_presence(tier, node)):
            return
        try:
            record = _record(tier, change, node)
        except ValueError as e:
            self.num_invalid += 1
            log.error("kv events for %s: %s", self.namespace, e)
            return
        self._note(record)

    __call__ = residency_changed

    def clear(self) -> None:
        """Everything of this namespace is gone (AllBlocksCleared); the listener stops."""
        if not self.closed:
            self.pending.clear()
            self._note(CLEAR_RECORD)
            self.closed = True
            self._hub._forget(self)

    def _note(self, record: tuple) -> None:
        if self.resync:
            return  # a resync is due: it will describe the state as it is then
        if not self.pending:
            self._hub._mark(self)
        self.pending.append(record)

    def take(self) -> list[tuple]:
        """The records of the next batch. A resync, once due, starts with AllBlocksCleared
        (what was noted before is superseded) and then tells every (tier, node) of the
        snapshot function as "stored", RESYNC_SLICE pairs per batch, a batch per loop turn
        (`resyncing` until told whole): no turn pays for the whole tree. What happens
        meanwhile is noted and told in between, in the order it happened (`resident` tells
        each node as it is when it gets there): the last batch leaves routers with the
        state as it is."""
        records, self.pending = self.pending, []
        if self.resync:
            records = [CLEAR_RECORD]
            self._resyncing = self._snapshot_pairs()
        if self.closed:
            self._resyncing = None  # cleared: nothing may follow its AllBlocksCleared
        elif self._resyncing is not None:
            chunk = list(itertools.islice(self._resyncing, RESYNC_SLICE))
            if len(chunk) < RESYNC_SLICE:
                self._resyncing = None
            records += self.records_of(chunk)
        return records

    @property
    def resyncing(self) -> bool:
        """A resync is being told, a slice per loop turn (see `take`)."""
        return self._resyncing is not None

    def records_of(self, pairs: Iterable[tuple[str, object]]) -> list[tuple]:
        """"stored" records of these (tier, node) pairs' token paths as they are now. On the loop."""
        records: list[tuple] = []
        for tier, node in pairs:
            if self._hub.config.presence and not _told_in_presence(tier, node, snapshot=True):
                continue
            try:
                records.append(_record(tier, "stored", node))
            except ValueError as e:
                self.num_invalid += 1
                log.error("kv events for %s: snapshot: %s", self.namespace, e)
        return records

    def snapshot_slices(self, size: int) -> Iterator[tuple[list[Event], list[bytes]]]:
        """A snapshot's events (and their extra keys, as `EventBuilder.build`), slice by
        slice: AllBlocksCleared, then the stored events of `size` (tier, node) pairs at a
        time, each slice's pairs taken from the snapshot function and recorded when the
        slice is asked for (`resident` is made for that: a node split or removed meanwhile
        is still told right), with a builder of its own (the publisher thread owns
        `builder`). Drive it on the loop; no slice costs more than `size` pairs, whatever
        the tree's size."""
        builder = EventBuilder(self.builder.block_size, self.builder.seed, presence=self.builder.presence)
        yield builder.build([CLEAR_RECORD])
        pairs = self._snapshot_pairs()
        while not self.closed and (chunk := list(itertools.islice(pairs, size))):  # a dropped namespace: no more
            yield builder.build(self.records_of(chunk))

    def _snapshot_pairs(self) -> Iterator[tuple[str, object]]:
        if self.closed or self.snapshot is None:
            return iter(())
        return iter(self.snapshot())


class EventHub:
    """Owns the publisher thread; hands out namespace listeners, flushes their records,
    subscribes WatchEvents readers and reports counters. Used from the event loop only
    (`subscribe` and `stats` are safe from any thread)."""

    def __init__(self, config: EventsConfig, call_later: Callable | None = None,
                 clock: Callable[[], float] = time.time):
        self.config = config
        self._publisher = Publisher(config)
        self._dirty: list[NamespaceEvents] = []
        self._call_later = call_later
        self._flush_due = False
        self._clock = clock
        self._listeners: dict[str, NamespaceEvents] = {}  # the latest attachment of each namespace
        # A (re)started daemon holds nothing: tell routers to forget this worker.
        self._publisher.submit((EventBuilder(1), "", config.topic_for(""), clock(), [CLEAR_RECORD]))

    def attach(self, namespace: str, page_size: int,
               snapshot: Callable[[], Iterable[tuple[str, object]]] | None = None) -> NamespaceEvents:
        """A listener for one namespace's tree; attach again for a new tree of the same name.
        Its first batch is an AllBlocksCleared on its own topic: a router following only
        that topic forgets what an earlier daemon run (or an earlier namespace of the name)
        held there. A dropped predecessor's batch still waiting for queue room (its
        AllBlocksCleared) is superseded by it, so it can never follow the new blocks."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        ns = NamespaceEvents(self, namespace, page_size, snapshot)
        self._listeners[namespace] = ns
        self._dirty = [old for old in self._dirty if not (old.closed and old.topic == ns.topic)]
        if not self._publisher.submit((ns.builder, namespace, ns.topic, self._clock(), [CLEAR_RECORD])):
            ns.resync = True  # no room: its resync (which starts with the clear) comes instead
            self._mark(ns)
        return ns

    def _mark(self, ns: NamespaceEvents) -> None:
        self._dirty.append(ns)
        if self._call_later is not None and not self._flush_due:
            self._flush_due = True
            self._call_later(0, self.flush)

    def flush(self) -> int:
        """Queue one batch per namespace with news; returns how many were queued. A batch
        the queue has no room for is dropped and counted; the namespace then records
        nothing until a resync is queued, which waits for the queue to be half empty."""
        self._flush_due = False
        self._resync_failed_builds()
        dirty, self._dirty = list(dict.fromkeys(self._dirty)), []
        queued = 0
        next_turn = False  # a resync goes on: its next slice on the loop's next turn
        for ns in dirty:
            if ns.resync and not self._publisher.has_room(self.config.queue_size // 2):
                self._dirty.append(ns)
                continue
            records = ns.take()
            if not records:
                continue
            if self._publisher.submit((ns.builder, ns.namespace, ns.topic, self._clock(), records)):
                ns.resync = False
                queued += 1
                if ns.resyncing:
                    self._dirty.append(ns)
                    next_turn = True
            else:
                ns.resync = True  # (told again from its start)
                self._dirty.append(ns)
        if self._dirty and self._call_later is not None and not self._flush_due:
            self._flush_due = True
            self._call_later(0 if next_turn else RESYNC_RETRY_S, self.flush)
        return queued

    def _forget(self, ns: NamespaceEvents) -> None:
        """A dropped namespace's listener leaves the table (its snapshot function holds
        the namespace's whole tree)."""
        if self._listeners.get(ns.namespace) is ns:
            del self._listeners[ns.namespace]

    def _resync_failed_builds(self) -> None:
        """A batch the publisher could not build was dropped: what it told is lost to
        routers, so its namespace is told again whole (AllBlocksCleared and a snapshot)."""
        failed = self._publisher.failed_builds
        while failed:
            ns = self._listeners.get(failed.popleft())
            if ns is not None and not ns.closed and not ns.resync:
                ns.resync = True
                self._dirty.append(ns)

    @property
    def resync_pending(self) -> bool:
        """Some namespace lost a batch and its resync is not queued yet."""
        return bool(self._dirty) and any(ns.resync for ns in self._dirty)

    def subscribe(self, from_seq: int | None = None, hold: bool = False) -> Subscription:
        """In-process subscription (WatchEvents): see fanout.Broadcast.subscribe; `hold`
        holds it (up to the replay ring's size) until `resume`."""
        return self._publisher.broadcast.subscribe(from_seq, hold=self.config.ring_size if hold else None)

    @property
    def drained(self) -> bool:
        """Every queued batch has been published (and nothing is pending on the loop)."""
        p = self._publisher
        return not self._dirty and p.num_done == p.num_submitted

    @property
    def next_seq(self) -> int:
        return self._publisher.broadcast.next_seq

    def stats(self) -> dict[str, int]:
        """Counters for the metrics layer (monotonic except the two gauges)."""
        p = self._publisher
        return {
            "published": p.broadcast.next_seq,
            "dropped": p.num_dropped,
            "send_errors": p.num_send_errors,
            "replays": p.num_replays,
            "build_errors": p.num_build_errors,
            "lagged_subscribers": p.broadcast.num_lagged,
            "queue_depth": p.queue_depth,            # gauge
            "subscribers": p.broadcast.num_subscribers,  # gauge
        }

    def close(self, timeout: float = 2.0) -> None:
        """Flush, publish what is queued (up to `timeout`), stop. Idempotent."""
        self._call_later = None
        self.flush()
        self._publisher.close(timeout)
