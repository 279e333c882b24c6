"""WorkerFeed, the per-daemon sequence state machine, driven frame by frame: batches are
applied once and in order, gaps are repaired by replay or reset the worker, duplicates
are dropped, and a restarted publisher is told from a duplicate by its payload."""

from radixkv.routing import RoutingIndex, WorkerFeed
from radixkv.routing.blockhash import block_hashes
from radixkv.routing.wire import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch

PAGE = 4
TOPIC = b"kv@m"


def stored(i: int, ts: float = 1.0) -> bytes:
    tokens = list(range(i * 100, i * 100 + PAGE))
    event = BlockStored(block_hashes=block_hashes(tokens, PAGE), parent_block_hash=None,
                        token_ids=tokens, block_size=PAGE, lora_id=None, medium="GPU", lora_name=None)
    return encode_batch(KVEventBatch(ts=ts, events=[event]))


def held(index, i):
    return index.score(list(range(i * 100, i * 100 + PAGE)), namespace="m")[0].score > 0


def feed():
    index = RoutingIndex(PAGE)
    return index, WorkerFeed("w", index)


def test_in_order_batches_apply_once_and_duplicates_are_dropped():
    index, f = feed()
    for seq in range(3):
        assert f.on_live(TOPIC, seq, stored(seq), can_replay=True) is None
    assert f.on_live(TOPIC, 1, stored(1), can_replay=True) is None
    assert (f.num_applied, f.num_duplicates, f.last_seq) == (3, 1, 2)
    assert all(held(index, i) for i in range(3))


def test_a_gap_asks_for_replay_from_the_last_seq_and_the_replay_fills_it():
    index, f = feed()
    f.on_live(TOPIC, 0, stored(0), can_replay=True)
    assert f.on_live(TOPIC, 3, stored(3), can_replay=True) == 0
    assert f.on_live(TOPIC, 4, stored(4), can_replay=True) is None  # buffered meanwhile
    for seq in range(4):  # the ring answers from 0: 0 checks continuity, 1..3 fill the hole
        f.on_replay(TOPIC, seq, stored(seq))
    assert f.on_replay_end() is None
    assert f.last_seq == 4 and f.num_resets == 0 and f.num_applied == 5
    assert all(held(index, i) for i in range(5))


def test_a_hole_the_ring_no_longer_holds_resets_the_worker():
    index, f = feed()
    f.on_live(TOPIC, 0, stored(0), can_replay=True)
    f.on_live(TOPIC, 9, stored(9), can_replay=True)
    f.on_replay(TOPIC, 7, stored(7))  # the ring starts at 7
    f.on_replay(TOPIC, 8, stored(8))
    f.on_replay_end()
    assert f.num_resets == 1 and f.last_seq == 9
    assert not held(index, 0) and held(index, 7) and held(index, 9)


def test_a_restart_is_told_from_a_duplicate_by_its_payload():
    index, f = feed()
    for seq in range(3):
        f.on_live(TOPIC, seq, stored(seq), can_replay=True)
    # a new publisher: seq 1 again, with other contents
    assert f.on_live(TOPIC, 1, stored(50, ts=2.0), can_replay=True) == 0
    f.on_replay(TOPIC, 0, encode_batch(KVEventBatch(ts=2.0, events=[AllBlocksCleared()])))
    f.on_replay(TOPIC, 1, stored(50, ts=2.0))
    assert f.on_replay_end() is None
    assert f.num_restarts == 1 and f.last_seq == 1
    assert not held(index, 0) and not held(index, 2) and held(index, 50)


def test_a_restart_found_by_the_continuity_check_replays_from_zero():
    index, f = feed()
    for seq in range(3):
        f.on_live(TOPIC, seq, stored(seq), can_replay=True)
    f.start_replay(2)                       # the periodic check: replay from the last seq
    f.on_replay(TOPIC, 2, stored(60, ts=3.0))  # seq 2 now holds something else
    f.on_replay(TOPIC, 3, stored(61, ts=3.0))  # ignored: asked again from 0
    assert f.on_replay_end() == 0
    for seq, i in enumerate((59, 58, 60, 61)):
        f.on_replay(TOPIC, seq, stored(i, ts=3.0))
    assert f.on_replay_end() is None
    assert f.num_restarts == 1 and f.last_seq == 3
    assert not held(index, 1) and all(held(index, i) for i in (58, 59, 60, 61))


def test_without_replay_a_gap_resets_and_an_undecodable_batch_resets():
    index, f = feed()
    f.on_live(TOPIC, 5, stored(5), can_replay=False)     # joined late: nothing to repair
    f.on_live(TOPIC, 7, stored(7), can_replay=False)
    assert f.num_resets == 2 and held(index, 7) and not held(index, 5)
    f.on_live(TOPIC, 8, b"not msgpack", can_replay=False)
    assert f.num_bad == 1 and not held(index, 7)


def test_a_restart_seen_in_the_batches_buffered_during_a_replay_replays_from_zero():
    """The restarted publisher's first live batches arrive while a replay asked of the old
    one is in flight: counted as a restart (not a plain gap), and its ring read from 0."""
    index, f = feed()
    for seq in range(5):
        f.on_live(TOPIC, seq, stored(seq), can_replay=True)
    f.start_replay(4)                                   # the periodic check
    assert f.on_live(TOPIC, 2, stored(70, ts=5.0), can_replay=True) is None  # buffered
    f.on_replay(TOPIC, 4, stored(4))                    # the old publisher still answered
    assert f.on_replay_end() == 0
    for seq, i in enumerate((68, 69, 70)):
        f.on_replay(TOPIC, seq, stored(i, ts=5.0))
    assert f.on_replay_end() is None
    assert f.num_restarts == 1 and f.last_seq == 2
    assert not held(index, 4) and all(held(index, i) for i in (68, 69, 70))


def test_an_empty_answer_to_a_replay_from_an_applied_seq_is_a_restart():
    """A quiet publisher restarted with fewer batches than were applied answers a replay
    from the last applied seq with nothing: the worker is forgotten and read from 0."""
    index, f = feed()
    for seq in range(5):
        f.on_live(TOPIC, seq, stored(seq), can_replay=True)
    f.start_replay(4)
    assert f.on_replay_end() == 0                       # END with no batch at all
    f.on_replay(TOPIC, 0, encode_batch(KVEventBatch(ts=6.0, events=[AllBlocksCleared()])))
    f.on_replay(TOPIC, 1, stored(80, ts=6.0))
    assert f.on_replay_end() is None
    assert f.num_restarts == 1 and f.last_seq == 1
    assert not any(held(index, i) for i in range(5)) and held(index, 80)


def test_a_replay_given_up_on_is_not_taken_for_a_restart():
    index, f = feed()
    f.on_live(TOPIC, 0, stored(0), can_replay=True)
    f.start_replay(0)
    assert f.on_replay_end(gave_up=True) is None
    assert f.num_restarts == 0 and held(index, 0)


def test_a_batch_lost_again_right_after_a_replay_is_asked_again_before_any_reset():
    """A live batch lost, replayed; another one lost just after the replay was answered:
    the ring still holds it, so the feed asks again (a few times in a row at most)
    instead of forgetting the worker."""
    index, f = feed()
    f.on_live(TOPIC, 0, stored(0), can_replay=True)
    assert f.on_live(TOPIC, 2, stored(2), can_replay=True) == 0          # 1 lost
    assert f.on_live(TOPIC, 4, stored(4), can_replay=True) is None       # 3 lost too, buffered
    for seq in range(3):
        f.on_replay(TOPIC, seq, stored(seq))
    ask = f.on_replay_end()
    assert ask == f.check_from() == 1 and f.num_resets == 0               # 3 asked for
    for seq in range(1, 4):
        f.on_replay(TOPIC, seq, stored(seq))
    assert f.on_replay_end() is None
    assert (f.last_seq, f.num_resets) == (4, 0) and all(held(index, i) for i in range(5))


def test_a_restarted_publisher_seen_first_at_the_next_seq_is_found_by_the_continuity_check():
    """The router missed a restart announcement and every new batch up to the seq it had
    reached: the new run's next batch looks like the next one. The continuity check asks
    from the batch before the last applied one, whose payload tells the runs apart."""
    index, f = feed()
    for seq in range(5):
        f.on_live(TOPIC, seq, stored(seq), can_replay=True)
    assert f.on_live(TOPIC, 5, stored(95, ts=9.0), can_replay=True) is None   # the new run's seq 5
    start = f.check_from()
    assert start == 4
    f.start_replay(start)
    f.on_replay(TOPIC, 4, stored(94, ts=9.0))   # not what was applied under 4: a restart
    f.on_replay(TOPIC, 5, stored(95, ts=9.0))
    assert f.on_replay_end() == 0
    for seq in range(6):
        f.on_replay(TOPIC, seq, stored(90 + seq, ts=9.0))
    assert f.on_replay_end() is None
    assert f.num_restarts == 1 and not any(held(index, i) for i in range(5))
    assert all(held(index, 90 + i) for i in range(6))


def test_a_stream_that_speaks_for_some_tiers_changes_no_other_tier():
    """An engine's stream followed for its GPU blocks (media=("GPU",)) also carries the
    connector's relay of the daemon's CPU and STORAGE blocks; the daemon's own stream
    speaks for those. The relay's withdrawal (its stream to the daemon broke) must not
    remove what the daemon's stream still says is on the host."""
    from radixkv.routing.wire import BlockRemoved

    index = RoutingIndex(PAGE)
    engine, daemon = WorkerFeed("w", index, media=("GPU",)), WorkerFeed("w", index, media=("CPU", "STORAGE"))
    tokens = list(range(PAGE))
    hashes = block_hashes(tokens, PAGE)

    def batch(*events) -> bytes:
        return encode_batch(KVEventBatch(ts=1.0, events=list(events)))

    def event(cls, medium):
        if cls is BlockRemoved:
            return BlockRemoved(block_hashes=hashes, medium=medium)
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=PAGE,
                           lora_id=None, medium=medium, lora_name=None)

    daemon.on_live(TOPIC, 0, batch(event(BlockStored, "CPU")), can_replay=False)
    engine.on_live(TOPIC, 0, batch(event(BlockStored, "GPU"), event(BlockStored, "CPU")), can_replay=False)
    engine.on_live(TOPIC, 1, batch(event(BlockRemoved, "CPU"), event(BlockRemoved, None)), can_replay=False)  # relay
    assert index.num_blocks("w", "m") == (0, 1, 0)  # GPU gone by the engine's word; CPU still by the daemon's
    daemon.on_live(TOPIC, 1, batch(event(BlockRemoved, "CPU")), can_replay=False)
    assert index.num_blocks("w", "m") == (0, 0, 0)
