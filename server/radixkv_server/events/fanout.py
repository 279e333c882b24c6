"""Published batches: the replay ring and the in-process fan-out behind `WatchEvents`.

`Broadcast` numbers batches as they are published (contiguous from 0), keeps the last
`ring_size` for replay (fewer when they pass `ring_bytes`: a batch of long prompts'
events is up to a megabyte), and hands each one to every `Subscription`. A subscription's buffer
is bounded: one that falls `capacity` batches (or `ring_bytes`) behind is cut off and raises
`SubscriberLagged` (with the first sequence number it missed) instead of slowing the
publisher; its reader may resubscribe from that number while the ring still holds it, or
start over from a fresh snapshot. No asyncio here; `AsyncSubscription` adapts one
subscription to an event loop.
"""

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from radixkv.routing.wire import KVEventBatch, decode_batch


@dataclass(frozen=True, slots=True)
class PublishedBatch:
    """One published batch, as the ring keeps it: the wire bytes only. Its decoded form
    is made on demand (`batch`, for WatchEvents): kept beside the bytes, a 2k-token
    BlockStored's token list took 80 KiB against its 8 KiB of msgpack, and a full ring
    of them most of a gigabyte."""
    seq: int
    namespace: str
    topic: bytes
    payload: bytes          # the msgpack KVEventBatch, as sent on ZMQ
    extra_keys: tuple[bytes, ...] = ()  # per event, the radixkv extra_key of its blocks (gRPC shows it)
    size: int = field(init=False)  # the bytes it holds (payload and extra keys), as the ring counts them

    def __post_init__(self):
        object.__setattr__(self, "size", len(self.payload) + sum(len(k) for k in self.extra_keys))

    @property
    def batch(self) -> KVEventBatch:
        """The batch, decoded from `payload` (a new object each call)."""
        return decode_batch(self.payload)


class SubscriberLagged(Exception):
    """The subscriber missed batches from `missed_from` on (its buffer overflowed);
    `while_held`: while it was held (`Broadcast.subscribe`), past its limit."""

    def __init__(self, missed_from: int, while_held: bool = False):
        super().__init__(f"subscriber fell behind; batches from seq {missed_from} were dropped")
        self.missed_from = missed_from
        self.while_held = while_held


class ReplayUnavailable(Exception):
    """Replay from `requested` is impossible: the ring now spans [oldest, next_seq)."""

    def __init__(self, requested: int, oldest: int, next_seq: int):
        super().__init__(f"cannot replay from seq {requested}: the replay buffer holds "
                         f"[{oldest}, {next_seq}); resubscribe without from_seq after a snapshot")
        self.requested, self.oldest, self.next_seq = requested, oldest, next_seq


class Subscription:
    """One reader's bounded queue of batches. Thread-safe; `get_nowait`/`wait` consume."""

    def __init__(self, owner: "Broadcast", capacity: int):
        self._owner = owner
        self._items: deque[PublishedBatch] = deque()
        self._capacity = capacity  # room for live batches; a replay's backlog comes on top
        self._backlog = 0          # replayed batches not read yet (they never cut a reader off)
        self._bytes = 0            # what the batches it holds hold: at most the ring's bytes
        self._missed_from: int | None = None
        self._held: int | None = None  # while held: how many batches it may hold in all
        self._missed_while_held = False
        self.on_ready: Callable[[], None] | None = None  # called (publisher thread) on news
        self.start_seq = 0  # the seq of the first batch it gets (set by subscribe)

    def resume(self) -> None:
        """End a hold (`Broadcast.subscribe`): what it holds stays backlog; `capacity`
        bounds the lag from here."""
        with self._owner._lock:
            self._held = None

    def _offer(self, item: PublishedBatch) -> None:
        """Caller holds the owner's lock."""
        if self._missed_from is not None:
            return
        # Past the ring's bytes it is cut off as past its count: batches the ring dropped
        # would otherwise stay in memory for a reader that does not read.
        too_big = bool(self._items) and self._bytes + item.size > self._owner.ring_bytes
        if self._held is not None:
            if len(self._items) < self._held and not too_big:
                self._items.append(item)
                self._bytes += item.size
                self._backlog += 1
            else:
                self._missed_from, self._missed_while_held = item.seq, True
                self._owner.num_lagged += 1
        elif len(self._items) >= self._capacity + self._backlog or too_big:
            self._missed_from = item.seq  # what it holds stays readable; then the signal
            self._owner.num_lagged += 1
        else:
            self._items.append(item)
            self._bytes += item.size
        if self.on_ready is not None:
            self.on_ready()

    def get_nowait(self) -> PublishedBatch | None:
        """The next batch, or None if none is waiting. Raises SubscriberLagged once cut off."""
        with self._owner._lock:
            if self._items:
                self._backlog = max(0, self._backlog - 1)
                item = self._items.popleft()
                self._bytes -= item.size
                return item
            if self._missed_from is not None:
                raise SubscriberLagged(self._missed_from, self._missed_while_held)
            return None

    def wait(self, timeout: float | None = None) -> PublishedBatch | None:
        """Block up to `timeout` seconds for the next batch (None on timeout)."""
        with self._owner._ready:
            self._owner._ready.wait_for(lambda: self._items or self._missed_from is not None, timeout)
        return self.get_nowait()

    def close(self) -> None:
        """Stop receiving; idempotent."""
        self._owner._unsubscribe(self)


class Broadcast:
    def __init__(self, ring_size: int, capacity: int, ring_bytes: int = 256 << 20):
        if ring_size < 1 or capacity < 1 or ring_bytes < 1:
            raise ValueError("ring_size, capacity and ring_bytes must be >= 1")
        # The publisher thread appends; subscribers, gRPC streams and replays read.
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._ring: deque[PublishedBatch] = deque()
        self._ring_size = ring_size
        self.ring_bytes = ring_bytes
        self.ring_held = 0  # bytes the ring holds (PublishedBatch.size)
        self._subs: set[Subscription] = set()
        self._capacity = capacity
        self.next_seq = 0
        self.num_lagged = 0  # subscriptions cut off for falling behind

    def publish(self, namespace: str, topic: bytes, payload: bytes,
                extra_keys: tuple[bytes, ...] = ()) -> PublishedBatch:
        """Number the batch (next_seq), keep it for replay, hand it to every subscriber."""
        with self._lock:
            item = PublishedBatch(self.next_seq, namespace, topic, payload, extra_keys)
            self.next_seq += 1
            self._ring.append(item)
            self.ring_held += item.size
            while len(self._ring) > 1 and (len(self._ring) > self._ring_size or self.ring_held > self.ring_bytes):
                self.ring_held -= self._ring.popleft().size  # the newest batch stays, whatever its size
            for sub in self._subs:
                sub._offer(item)
            self._ready.notify_all()
        return item

    def since(self, seq: int) -> list[PublishedBatch]:
        """Ring batches with seq >= `seq`, oldest first (may start later than `seq`)."""
        with self._lock:
            if not self._ring or seq <= self._ring[0].seq:
                return list(self._ring)
            start = seq - self._ring[0].seq
            return [self._ring[i] for i in range(start, len(self._ring))]

    def subscribe(self, from_seq: int | None = None, capacity: int | None = None,
                  hold: int | None = None) -> Subscription:
        """A subscription to every batch from `from_seq` on (None: from the next one).

        Raises ReplayUnavailable when `from_seq` is outside [oldest in ring, next_seq]. The
        replayed backlog (references to ring entries) may exceed the subscription's
        capacity; the capacity bounds how far it falls behind the live batches after it.
        With `hold`, until `Subscription.resume` the batches published join the backlog
        too, up to `hold` batches held in all: for a reader that cannot take live batches
        yet (a WatchEvents snapshot is sent first, and on a busy daemon takes longer than
        `capacity` batches last).
        """
        sub = Subscription(self, capacity or self._capacity)
        sub._held = hold
        with self._lock:
            if from_seq is not None:
                oldest = self._ring[0].seq if self._ring else self.next_seq
                if not oldest <= from_seq <= self.next_seq:
                    raise ReplayUnavailable(from_seq, oldest, self.next_seq)
                backlog = [b for b in self._ring if b.seq >= from_seq]
                sub._items.extend(backlog)
                sub._backlog = len(backlog)
                sub._bytes = sum(b.size for b in backlog)
            sub.start_seq = self.next_seq if from_seq is None else from_seq
            self._subs.add(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subs)


class AsyncSubscription:
    """`async for batch in AsyncSubscription(sub)`: the subscription on an event loop.
    Raises SubscriberLagged from the iteration when the subscription was cut off."""

    def __init__(self, sub: Subscription, loop: asyncio.AbstractEventLoop | None = None):
        self._sub = sub
        self._loop = loop or asyncio.get_running_loop()
        self._event = asyncio.Event()
        sub.on_ready = self._wake

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            self._sub.on_ready = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> PublishedBatch:
        while True:
            item = self._sub.get_nowait()
            if item is not None:
                return item
            self._event.clear()
            item = self._sub.get_nowait()  # published between the check and the clear
            if item is not None:
                return item
            await self._event.wait()

    def close(self) -> None:
        self._sub.on_ready = None
        self._sub.close()
