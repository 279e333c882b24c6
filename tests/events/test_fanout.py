"""The in-process fan-out behind WatchEvents: replay from a sequence number, bounded
buffers, a clear signal for a reader that fell behind, and the asyncio adapter."""

import asyncio
import threading

import pytest

from radixkv_server.core.tree import RadixTree
from radixkv_server.events import (
    AsyncSubscription, Broadcast, EventHub, EventsConfig, ReplayUnavailable, SubscriberLagged,
)

from .helpers import PAGE, chain

JOIN_DEADLINE_S = 20.0  # a generous bound: a blocked publisher would never finish


def publish(b: Broadcast, n: int) -> None:
    for _ in range(n):
        b.publish("ns", b"kv@ns", b"payload")


def drain(sub) -> list[int]:
    return [item.seq for item in iter(sub.get_nowait, None)]


def test_replay_from_a_seq_then_live_is_contiguous():
    b = Broadcast(ring_size=100, capacity=50)
    publish(b, 10)
    sub = b.subscribe(from_seq=4)
    publish(b, 3)
    assert drain(sub) == list(range(4, 13))
    live = b.subscribe()
    publish(b, 2)
    assert drain(live) == [13, 14] and drain(sub) == [13, 14]


def test_replay_outside_the_ring_is_refused_with_its_bounds():
    b = Broadcast(ring_size=5, capacity=50)
    publish(b, 12)
    with pytest.raises(ReplayUnavailable) as err:
        b.subscribe(from_seq=3)
    assert (err.value.oldest, err.value.next_seq) == (7, 12)
    with pytest.raises(ReplayUnavailable):
        b.subscribe(from_seq=13)  # a seq from before a daemon restart
    assert drain(b.subscribe(from_seq=12)) == []


def test_a_held_reader_keeps_what_is_published_as_backlog_up_to_its_limit():
    """A WatchEvents stream sending its snapshot holds its subscription: what is published
    meanwhile waits as backlog, beyond the capacity, up to the limit; after `resume` the
    capacity bounds the lag on top of that backlog; past the limit it is cut off, and
    says it was held."""
    b = Broadcast(ring_size=1000, capacity=2)
    sub = b.subscribe(hold=20)
    publish(b, 15)              # 15 > capacity: a live reader would be cut off here
    sub.resume()
    publish(b, 2)               # the capacity's worth of lag on top of the backlog
    assert drain(sub) == list(range(17))
    sub.close()
    held = b.subscribe(hold=5)
    publish(b, 6)
    assert [held.get_nowait().seq for _ in range(5)] == list(range(17, 22))  # what it held stays readable
    with pytest.raises(SubscriberLagged) as err:
        held.get_nowait()
    assert err.value.missed_from == 22 and err.value.while_held
    assert b.num_lagged == 1


def test_a_reader_that_falls_behind_is_cut_off_not_waited_for():
    b = Broadcast(ring_size=1000, capacity=8)
    slow = b.subscribe()
    fast = b.subscribe()
    fast_seqs = []

    def publisher():  # nobody reads `slow` meanwhile: a publish that waited for it never returns
        for _ in range(100):
            publish(b, 1)
            fast_seqs.extend(drain(fast))

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    thread.join(JOIN_DEADLINE_S)
    assert not thread.is_alive(), "publish blocked on a subscriber nobody reads"
    assert fast_seqs == list(range(100))
    assert [slow.get_nowait().seq for _ in range(8)] == list(range(8))  # it kept its 8, no more
    with pytest.raises(SubscriberLagged) as err:
        slow.get_nowait()
    assert err.value.missed_from == 8
    assert b.num_lagged == 1
    resumed = b.subscribe(from_seq=err.value.missed_from, capacity=200)
    assert drain(resumed) == list(range(err.value.missed_from, 100))
    slow.close()
    slow.close()  # idempotent
    assert b.num_subscribers == 2


def test_a_replay_longer_than_the_buffer_is_served_then_the_buffer_bounds_live_batches():
    b = Broadcast(ring_size=100, capacity=4)
    publish(b, 30)
    sub = b.subscribe(from_seq=2)  # 28 batches of backlog, a buffer of 4
    assert [sub.get_nowait().seq for _ in range(20)] == list(range(2, 22))
    publish(b, 12)  # 8 backlog batches unread + room for 4 live ones: the 5th cuts it off
    assert drain_until_lagged(sub) == (list(range(22, 34)), 34)


def drain_until_lagged(sub):
    seqs = []
    with pytest.raises(SubscriberLagged) as err:
        while True:
            item = sub.get_nowait()
            assert item is not None, "never cut off"
            seqs.append(item.seq)
    return seqs, err.value.missed_from


def test_wait_blocks_until_a_batch_or_the_timeout():
    b = Broadcast(ring_size=10, capacity=10)
    sub = b.subscribe()
    assert sub.wait(timeout=0.01) is None
    publish(b, 1)
    assert sub.wait(timeout=1).seq == 0


def test_async_subscription_receives_batches_from_the_publisher_thread():
    async def main():
        hub = EventHub(EventsConfig())
        try:
            stream = AsyncSubscription(hub.subscribe(from_seq=0))
            tree = RadixTree(PAGE)
            listen = hub.attach("ns", PAGE)
            got = []
            for i in range(5):
                (node,) = chain(tree, range(i * 10, i * 10 + PAGE))
                listen("device", "stored", node)
                hub.flush()
            async for item in stream:
                got.append(item.seq)
                if len(got) == 6:
                    break
            stream.close()
            return got
        finally:
            hub.close()

    assert asyncio.run(asyncio.wait_for(main(), 20)) == list(range(6))


def test_the_ring_keeps_batches_within_its_bytes_the_newest_whatever_its_size():
    """Long prompts' batches are megabytes: the ring drops the oldest past `ring_bytes`
    (a count alone let one client's events grow the daemon by gigabytes), and a replay
    from a dropped seq is refused with the ring's bounds."""
    b = Broadcast(ring_size=1000, capacity=50, ring_bytes=10_000)
    for _ in range(10):
        b.publish("ns", b"kv@ns", b"x" * 3000, (b"k" * 100,))
    assert b.ring_held <= 10_000 and [item.seq for item in b.since(0)] == [7, 8, 9]
    with pytest.raises(ReplayUnavailable) as err:
        b.subscribe(from_seq=6)
    assert err.value.oldest == 7
    b.publish("ns", b"kv@ns", b"y" * 50_000)  # alone past the bound: kept, alone
    assert [item.seq for item in b.since(0)] == [10] and b.ring_held == 50_000


def test_a_reader_that_does_not_read_is_cut_off_past_the_rings_bytes():
    """Batches the ring dropped stay alive while a subscription holds them: a held reader
    (sending its snapshot) or a live one that stops reading is cut off once it holds the
    ring's bytes, as past its count, instead of keeping gigabytes."""
    b = Broadcast(ring_size=1000, capacity=1000, ring_bytes=10_000)
    held, live, reading = b.subscribe(hold=1000), b.subscribe(), b.subscribe()
    for _ in range(5):
        b.publish("ns", b"kv@ns", b"x" * 3000)
        assert reading.get_nowait() is not None  # a reader that reads keeps up whatever the bytes
    for sub in (held, live):
        assert drain_until_lagged(sub) == ([0, 1, 2], 3)  # 9000 bytes held; the fourth passed 10000
    b.publish("ns", b"kv@ns", b"y" * 50_000)  # alone past the bound: a reader with nothing queued takes it
    assert reading.get_nowait().payload == b"y" * 50_000

