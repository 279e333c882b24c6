"""The loop-side hub: residency changes of real tree nodes become ordered, numbered vLLM
batches whose hashes a router recomputes from the prompt alone."""

import pytest

from radixkv.routing.blockhash import block_hashes
from radixkv.routing.wire import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv_server.core.tree import RadixTree
from radixkv_server.events import EventHub, EventsConfig

from .helpers import PAGE, chain, packed, wait_for


@pytest.fixture
def hub():
    h = EventHub(EventsConfig(topic="kv@{namespace}"))
    yield h
    h.close()


def drain(sub, n, timeout=10.0):
    out = []
    wait_for(lambda: out.extend(iter(sub.get_nowait, None)) or len(out) >= n, timeout, f"{n} batches")
    return out


def test_a_node_of_k_pages_is_one_event_with_k_hashes_of_the_prompt(hub):
    sub = hub.subscribe(from_seq=0)
    tree = RadixTree(PAGE)
    listen = hub.attach("llama/tp0", PAGE)
    a, b = chain(tree, range(12), range(50, 58))
    listen("device", "stored", a)
    listen("device", "stored", b)
    listen("host", "stored", b)
    assert hub.flush() == 1
    restart, cleared, batch = drain(sub, 3)
    assert restart.seq == 0 and restart.batch.events == [AllBlocksCleared()] and restart.topic == b"kv@"
    # A namespace's first batch clears its own topic (a router following only that topic
    # forgets what an earlier daemon run held there).
    assert (cleared.seq, cleared.topic, cleared.batch.events) == (1, b"kv@llama/tp0", [AllBlocksCleared()])
    assert batch.seq == 2 and batch.topic == b"kv@llama/tp0" and batch.namespace == "llama/tp0"
    prompt = list(range(12)) + list(range(50, 58))
    want = block_hashes(prompt, PAGE)
    e1, e2, e3 = batch.batch.events
    assert isinstance(e1, BlockStored) and e1.block_hashes == want[:3] and e1.medium == "GPU"
    assert e2.block_hashes == want[3:] and e2.parent_block_hash == want[2] and e2.token_ids == list(range(50, 58))
    assert e3.medium == "CPU" and e3.block_hashes == want[3:]


def test_split_nodes_keep_their_hashes_and_removal_names_the_same_blocks(hub):
    sub = hub.subscribe(from_seq=0)
    tree = RadixTree(PAGE)
    listen = hub.attach("ns", PAGE)
    (node,) = chain(tree, range(16))
    listen("host", "stored", node)
    hub.flush()
    top = tree.split(node, 1)           # residency unchanged: no event
    child = tree.add_child(top, packed(range(900, 904)))
    listen("host", "stored", child)
    listen("host", "removed", node)     # the lower part (pages 1..3) leaves the host
    listen("host", "removed", top)
    hub.flush()
    _, _, first, second = drain(sub, 4)
    full = block_hashes(list(range(16)), PAGE)
    assert first.batch.events[0].block_hashes == full
    stored_child, removed_lower, removed_top = second.batch.events
    assert stored_child.parent_block_hash == full[0]
    assert stored_child.block_hashes == block_hashes(list(range(4)) + list(range(900, 904)), PAGE)[1:]
    assert isinstance(removed_lower, BlockRemoved) and removed_lower.block_hashes == full[1:]
    assert removed_top.block_hashes == full[:1]


def test_events_deep_in_a_path_name_the_whole_prompt_before_and_after_a_split_above(hub):
    # A conversation 2000 turns deep: each event names its blocks by the whole prompt
    # (records share their ancestors' path cells), and splitting an ancestor that events
    # already named changes neither the blocks below it nor what the split parts name.
    sub = hub.subscribe(from_seq=0)
    tree = RadixTree(PAGE)
    listen = hub.attach("ns", PAGE)
    runs = [range(i * 8, i * 8 + 8) for i in range(2000)]
    path = chain(tree, *runs)
    prompt = [t for run in runs for t in run]
    full = block_hashes(prompt, PAGE)
    listen("device", "stored", path[-1])
    listen("device", "stored", path[1000])
    hub.flush()
    top = tree.split(path[1000], 1)
    fork = tree.add_child(top, packed(range(-8, -4)))
    deeper = tree.add_child(path[-1], packed(range(-4, 0)))
    for node in (path[1000], top, fork, deeper, path[-1]):
        listen("device", "stored", node)
    hub.flush()
    _, _, first, second = drain(sub, 4)
    assert [e.block_hashes for e in first.batch.events] == [full[-2:], full[2000:2002]]
    lower, upper, forked, below, last = second.batch.events
    assert (lower.block_hashes, upper.block_hashes) == ([full[2001]], [full[2000]])
    assert lower.parent_block_hash == full[2000] and upper.parent_block_hash == full[1999]
    assert forked.block_hashes == block_hashes(prompt[:8004] + list(range(-8, -4)), PAGE)[2001:]
    assert below.block_hashes == block_hashes(prompt + list(range(-4, 0)), PAGE)[-1:]
    assert last.block_hashes == full[-2:] and last.parent_block_hash == full[-3]


def test_extra_key_roots_chain_separately(hub):
    sub = hub.subscribe(from_seq=0)
    tree = RadixTree(PAGE)
    listen = hub.attach("ns", PAGE)
    (plain,) = chain(tree, range(8))
    (salted,) = chain(tree, range(8), extra_key=b"tenant-a")
    listen("storage", "stored", plain)
    listen("storage", "stored", salted)
    hub.flush()
    events = drain(sub, 3)[2].batch.events
    assert events[0].block_hashes == block_hashes(list(range(8)), PAGE)
    assert events[1].block_hashes == block_hashes(list(range(8)), PAGE, extra_key=b"tenant-a")
    assert events[1].extra_keys == [(b"tenant-a",)] * 2 and events[0].medium == "STORAGE"


def test_clear_ends_the_namespace_and_unknown_changes_are_counted(hub):
    sub = hub.subscribe(from_seq=0)
    tree = RadixTree(PAGE)
    listen = hub.attach("gone", PAGE)
    (node,) = chain(tree, range(4))
    listen.residency_changed("gpu", "stored", node)       # the seam must not raise:
    listen.residency_changed("device", "evicted", node)   # a core bug is logged and counted
    assert listen.num_invalid == 2
    listen("device", "stored", node)
    listen.clear()                       # pending events are superseded by the clear
    listen("device", "stored", node)     # after clear: ignored
    hub.flush()
    batch = drain(sub, 3)[2]
    assert batch.batch.events == [AllBlocksCleared()] and batch.topic == b"kv@gone"
    assert hub.flush() == 0


def test_call_later_flushes_once_per_turn():
    calls = []
    h = EventHub(EventsConfig(), call_later=lambda delay, fn: calls.append((delay, fn)))
    try:
        tree = RadixTree(PAGE)
        listen = h.attach("ns", PAGE)
        a, b = chain(tree, range(4), range(4, 8))
        listen("device", "stored", a)
        listen("device", "stored", b)
        assert [d for d, _ in calls] == [0]
        assert calls[0][1]() == 1
        listen("device", "removed", b)
        assert len(calls) == 2
    finally:
        h.close()


def test_watch_events_show_the_radixkv_key_and_the_adapter_of_each_event(hub):
    """WatchEvents (grpcurl) shows each stored event's radixkv extra_key, opaque or in
    vLLM's form, and the LoRA adapter vLLM's events name."""
    from radixkv.routing.extra_keys import vllm_extra_key
    from radixkv_server.service.watch import batch_message

    sub = hub.subscribe(from_seq=0)
    tree = RadixTree(PAGE)
    listen = hub.attach("ns", PAGE)
    tuned_key = vllm_extra_key("tiny-adapter", "/loras/tiny", "tenant-a")
    nodes = [chain(tree, range(8), extra_key=k)[0] for k in (b"", b"tenant-b", tuned_key)]
    for node in nodes:
        listen("host", "stored", node)
    hub.flush()
    message = batch_message(drain(sub, 3)[2], "instance")
    assert [e.extra_key for e in message.events] == [b"", b"tenant-b", tuned_key]
    assert [e.lora_name for e in message.events] == ["", "", "tiny-adapter"]
    assert list(message.events[2].block_hashes) == block_hashes(list(range(8)), PAGE, extra_key=tuned_key)


def test_a_batch_that_fails_to_build_is_followed_by_a_resync_of_its_namespace(hub):
    """A batch the publisher cannot build (a bug) is dropped, counted, and its namespace
    told again whole at the next flush: AllBlocksCleared, then what it holds, instead of
    routers missing what the lost batch said for good."""
    sub = hub.subscribe(from_seq=0)
    tree = RadixTree(PAGE)
    resident = []
    listen = hub.attach("ns", PAGE, snapshot=lambda: [("device", n) for n in resident])
    (node,) = chain(tree, range(8))
    resident.append(node)
    wait_for(lambda: hub.drained, what="the namespace's first batch published")
    good_build = listen.builder.build

    def broken(records):
        raise ValueError("injected: a batch that cannot be built")

    listen.builder.build = broken
    listen("device", "stored", node)
    hub.flush()
    wait_for(lambda: hub.stats()["build_errors"] == 1 and hub.drained, what="the batch dropped")
    listen.builder.build = good_build
    hub.flush()
    _, cleared, resync = drain(sub, 3)
    assert cleared.batch.events == [AllBlocksCleared()]
    assert resync.batch.events[0] == AllBlocksCleared()
    assert resync.batch.events[1].block_hashes == block_hashes(list(range(8)), PAGE)


def test_a_dropped_namespace_leaves_nothing_of_its_tree_in_the_hub(hub):
    """The hub's table of listeners (for resyncs after a failed build) forgets a cleared
    namespace: its snapshot function would keep the dropped tree alive."""
    import gc
    import weakref

    tree = RadixTree(PAGE)
    def snapshot_of(t):  # holds the tree itself, as the daemon's snapshot functions do
        return lambda: [("device", n) for n in t.iter_nodes()]

    listen = hub.attach("gone", PAGE, snapshot=snapshot_of(tree))
    alive = weakref.ref(tree)
    listen.clear()
    hub.flush()
    del tree, listen
    gc.collect()
    assert alive() is None


def test_the_replay_ring_keeps_wire_bytes_not_decoded_token_lists(hub):
    """A full ring of long prompts' events costs about their msgpack size: it once kept
    each batch decoded beside its bytes, 80 KiB of Python ints per 2k-token BlockStored
    against 8 KiB on the wire (most of a gigabyte at the default 10000 batches)."""
    import tracemalloc

    n, tokens = 200, 2048
    sub = hub.subscribe(from_seq=0)
    tree = RadixTree(PAGE)
    listen = hub.attach("long", PAGE)
    nodes = [chain(tree, range(1_000_000 * (i + 1), 1_000_000 * (i + 1) + tokens))[0] for i in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for node in nodes:
            listen("host", "stored", node)
            hub.flush()
        items = drain(sub, n + 2)  # with the start's and the namespace's clears
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    wire = sum(len(item.payload) for item in items)
    assert wire > n * tokens * 3  # the token ids are in the bytes (msgpack: 3-5 bytes each)
    # On top of the bytes: the builder's memo of the last nodes' block hashes (bounded;
    # 512 hashes a node at this page size). Token lists kept anywhere were 16 MB more.
    assert kept < 4 * wire, f"the ring and the subscriber hold {kept} bytes for {wire} bytes of batches"
    assert items[-1].batch.events[0].token_ids == list(range(1_000_000 * n, 1_000_000 * n + tokens))


def test_a_job_of_long_prompts_goes_out_in_batches_a_default_grpc_client_takes():
    """200 stored 2k-token nodes in one flush are ~2 MB of msgpack: published as several
    batches under 1 MiB each (one batch once passed the 4 MiB a router's channel takes by
    default), their events in order and none lost."""
    from radixkv_server.events.publisher import MAX_BATCH_BYTES

    hub = EventHub(EventsConfig(topic="kv@{namespace}"))
    try:
        n, tokens = 200, 2048
        sub = hub.subscribe(from_seq=0)
        tree = RadixTree(PAGE)
        listen = hub.attach("long", PAGE)
        nodes = [chain(tree, range(1_000_000 * (i + 1), 1_000_000 * (i + 1) + tokens))[0] for i in range(n)]
        for node in nodes:
            listen("host", "stored", node)
        hub.flush()
        items = drain(sub, 4)[2:]  # after the start's and the namespace's clears
        wait_for(lambda: items.extend(iter(sub.get_nowait, None)) or
                 sum(len(i.batch.events) for i in items) >= n, 10, "every event")
        assert len(items) > 1 and all(len(i.payload) <= MAX_BATCH_BYTES for i in items)
        firsts = [e.token_ids[0] for i in items for e in i.batch.events]
        assert firsts == [1_000_000 * (i + 1) for i in range(n)]
        assert [i.seq for i in items] == list(range(items[0].seq, items[0].seq + len(items)))
    finally:
        hub.close()
