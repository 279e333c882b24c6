"""The storage tier as the core sees it: what gets stored when, keys, prefetch."""

import pytest
from radixkv_server.core.pages import pack
from radixkv_server.core.page_keys import page_keys
from radixkv_server.core.errors import InvalidRequest, NotReady, UnknownTransfer
from radixkv_server.core.transfers import TransferKind

from harness import Engine, identity, make_cache, tokens


def clean(cache):
    assert cache.check_invariants() == []


def drain(cache, copier, eng):
    for outcome in copier.complete_all(cache).values():
        eng.give(getattr(outcome, "freed_pages", b""))


def test_storage_write_through_stores_once_the_host_copy_is_valid():
    cache, copier = make_cache("write_through", storage="write_through")
    eng = Engine(cache, copier)
    prompt = tokens(1, 2, 3, 4)
    eng.insert(prompt)
    drain(cache, copier, eng)  # backup, then (on its completion) the store
    drain(cache, copier, eng)
    keys = page_keys(b"test-salt", prompt, 2)
    assert set(keys) <= set(copier.storage)
    assert cache.counters.stored_tokens == 4
    clean(cache)


def test_storage_write_back_stores_on_host_eviction_then_frees_the_host_copy():
    cache, copier = make_cache("write_through", storage="write_back", host_pages=2)
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4))
    drain(cache, copier, eng)
    assert not copier.storage
    eng.give(cache.evict_device(2).freed_pages)  # host-only now
    assert cache.evict_host(2) == 0             # nothing free yet: a store starts
    assert cache.host.num_free == 0
    clean(cache)
    drain(cache, copier, eng)
    assert cache.host.num_free == 2 and len(copier.storage) == 2
    assert cache.match(tokens(1, 2, 3, 4)).host_tokens == 0
    clean(cache)


def test_host_eviction_frees_stored_leaves_at_once_while_others_are_written():
    """Storage write-back: leaves storage already holds leave the host immediately, so an
    allocation under pressure does not wait for the writes of the others."""
    cache, copier = make_cache("write_through", storage="write_back", host_pages=4)
    eng = Engine(cache, copier)
    old, new = tokens(1, 2, 3, 4), tokens(5, 6, 7, 8)
    eng.insert(old)
    drain(cache, copier, eng)
    eng.give(cache.evict_device(2).freed_pages)
    cache.evict_host(2)
    drain(cache, copier, eng)  # old is stored and gone from the host
    assert cache.storage_probe(old).cached_pages == 0
    tid = cache.start_prefetch(old, b"", 2)  # back on host, stored: cheap to evict
    copier.complete(cache, tid)
    eng.insert(new)
    drain(cache, copier, eng)
    eng.give(cache.evict_device(2).freed_pages)
    cache.match(old)  # old is the most recently used, yet the stored one goes first
    assert cache.evict_host(2) == 2
    assert cache.match(old).host_tokens == 0 and cache.match(new).host_tokens == 4
    assert len(copier.pending) == 1  # and the unstored one is being written meanwhile
    clean(cache)


def test_failed_store_on_host_eviction_still_frees_the_host():
    cache, copier = make_cache("write_through", storage="write_back", host_pages=2)
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4))
    drain(cache, copier, eng)
    eng.give(cache.evict_device(2).freed_pages)
    cache.evict_host(2)
    (tid,) = copier.pending
    copier.complete(cache, tid, fail=True)
    assert cache.host.num_free == 2
    assert cache.counters.store_dropped_tokens == 4
    clean(cache)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_prefetch_then_load_back_restores_the_stored_bytes(policy):
    """A prefix stored, then dropped from device and host, comes back from storage."""
    cache, copier = make_cache(policy, storage="write_through")
    eng = Engine(cache, copier)
    prompt = tokens(*range(12))
    eng.insert(prompt)
    drain(cache, copier, eng)
    while cache.device.num_held:  # write_back: the store happens after the write-back
        eng.give(cache.evict_device(10).freed_pages)
        drain(cache, copier, eng)
    drain(cache, copier, eng)
    cache.evict_host(100)
    drain(cache, copier, eng)
    assert cache.match(prompt).host_tokens == 0
    probe = cache.storage_probe(prompt + tokens(99))
    cached, keys = probe.cached_pages, probe.keys
    assert cached == 0 and len(keys) == 6 and all(k in copier.storage for k in keys)
    tid = cache.start_prefetch(prompt, b"", len(keys))
    clean(cache)
    outcome = copier.complete(cache, tid)
    assert outcome.added_tokens == 12
    m = cache.match(prompt)
    assert (m.device_tokens, m.host_tokens) == (0, 12)
    lb = cache.load_back(m.host_node, pack(eng.alloc(6)))
    copier.complete(cache, lb.transfer)
    cache.finish_load_back(lb.transfer)
    assert eng.verify(prompt, b"", lb.device_pages) == []
    assert len(cache.duplicates) >= 1  # prefetched host copies are settled duplicates after the ACK
    clean(cache)


def test_prefetch_gives_a_device_only_node_its_host_copy():
    """SGLang's seed case: host KV from storage meets a device copy that was never backed
    up locally; the node must be tracked as a settled duplicate."""
    cache, copier = make_cache("write_back", storage="write_through")
    eng = Engine(cache, copier)
    prompt = tokens(1, 2, 3, 4)
    eng.insert(prompt)
    copier.storage.update({k: b"|" + prompt[: (i + 1) * 8] for i, k in enumerate(page_keys(b"test-salt", prompt, 2))})
    tid = cache.start_prefetch(prompt, b"", 2)
    assert tid == 0  # fully cached already: nothing to fetch
    # Drop the host side only: the node is device-only; fetch its pages from storage.
    node = cache.node(cache.match(prompt).host_node)
    assert node.full.host_pages is None
    added = cache.prefetches.insert_host(prompt, 0, cache.host.alloc(2), b"")
    assert added == 2 and node in cache.duplicates and node.full.stored
    clean(cache)


def test_prefetch_is_dropped_when_its_prefix_left_the_cache():
    cache, copier = make_cache("write_through", storage="write_through")
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2))
    drain(cache, copier, eng)
    drain(cache, copier, eng)
    longer = tokens(1, 2, 3, 4)
    copier.storage[page_keys(b"test-salt", longer, 2)[1]] = b"|" + longer
    tid = cache.start_prefetch(longer, b"", 1)
    assert tid
    while cache.device.num_held:
        eng.give(cache.evict_device(10).freed_pages)
    cache.evict_host(100)
    drain(cache, copier, eng)
    assert cache.match(longer).host_tokens == 0
    clean(cache)
    assert cache.host.num_free == cache.host.capacity


def stored_and_gone(cache, copier, eng, prompt) -> None:
    """Insert `prompt` (2 pages), then evict it from the device and the host: it is in
    storage only."""
    eng.insert(prompt)
    drain(cache, copier, eng)
    eng.give(cache.evict_device(2).freed_pages)
    cache.evict_host(2)
    drain(cache, copier, eng)
    assert cache.match(prompt).host_tokens == 0


def test_an_engine_restart_does_not_wait_for_a_storage_fetch():
    """A fetch fills host pages reserved apart from the tree: the device tier drops
    under it (a Close need not wait for a frozen store), and its pages land after."""
    cache, copier = make_cache("write_through", storage="write_back", host_pages=4)
    eng = Engine(cache, copier)
    old = tokens(1, 2, 3, 4)
    stored_and_gone(cache, copier, eng, old)
    tid = cache.start_prefetch(old, b"", 2)
    assert tid and cache.device_drop_waits_for() == []
    cache.drop_device(32)
    clean(cache)
    copier.complete(cache, tid)  # the store answers later
    clean(cache)
    assert cache.match(old).host_tokens == 4


def test_a_fetch_in_flight_when_the_store_lost_its_contents_lands_as_not_stored():
    """Its bytes are right, but the store may no longer hold them: when the pages leave
    the host they are stored again, not dropped as if storage kept a copy."""
    cache, copier = make_cache("write_through", storage="write_back", host_pages=4)
    eng = Engine(cache, copier)
    old = tokens(1, 2, 3, 4)
    stored_and_gone(cache, copier, eng, old)
    tid = cache.start_prefetch(old, b"", 2)
    cache.storage_lost()
    copier.complete(cache, tid)
    clean(cache)
    assert cache.match(old).host_tokens == 4
    assert cache.evict_host(2) == 0  # not freed at once: stored first
    assert [k for k, *_ in copier.pending.values()] == ["store"]
    clean(cache)


def test_a_fetch_read_ahead_before_a_loss_it_started_after_lands_as_not_stored():
    """A Prefetch that waits reads the pages while it looks (before its fetch exists):
    a loss in that gap counts too."""
    cache, copier = make_cache("write_through", storage="write_back", host_pages=4)
    eng = Engine(cache, copier)
    old = tokens(1, 2, 3, 4)
    stored_and_gone(cache, copier, eng, old)
    seen = cache.storage_losses  # the lookup reads the pages here
    cache.storage_lost()
    tid = cache.start_prefetch(old, b"", 2, losses_seen=seen)
    copier.complete(cache, tid)
    assert cache.evict_host(2) == 0 and [k for k, *_ in copier.pending.values()] == ["store"]
    clean(cache)


def test_completions_of_the_wrong_kind_are_refused_without_a_change():
    cache, copier = make_cache("write_back", storage="write_through")
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4))
    eng.give(cache.evict_device(2).freed_pages)
    for outcome in copier.complete_all(cache).values():
        eng.give(outcome.freed_pages)
    m = cache.match(tokens(1, 2, 3, 4))
    lb = cache.load_back(m.host_node, pack(eng.alloc(2)))
    before = cache.state_digest()
    for bad in (lb.transfer, 12345):
        with pytest.raises(UnknownTransfer):
            cache.on_fetch_done(bad, 1)
    with pytest.raises(InvalidRequest):
        cache.drop_device(-1)
    assert cache.state_digest() == before
    clean(cache)


def test_unaligned_storage_probe_and_extra_key_salt_the_keys():
    cache, copier = make_cache(storage="write_through")
    plain = cache.storage_probe(tokens(1, 2, 3)).keys
    lora = cache.storage_probe(tokens(1, 2, 3), b"lora").keys
    assert len(plain) == 1 and plain != lora


def test_host_copies_storage_lacks_are_listed_parents_first_and_stored_once():
    """What a shutdown stores under storage write-back: every whole host copy not in
    storage, parents before children; a node stored meanwhile is skipped."""
    cache, copier = make_cache("write_through", storage="write_back")
    eng = Engine(cache, copier)
    eng.insert(tokens(1, 2, 3, 4, 5, 6))
    eng.insert(tokens(1, 2, 3, 4, 7, 8))  # splits: [1 2 3 4] with children [5 6] and [7 8]
    eng.insert(tokens(9, 10))
    assert cache.unstored_host_nodes() == []  # backups in flight: no host copy is whole yet
    drain(cache, copier, eng)
    nodes = cache.unstored_host_nodes()
    parent = cache.node(cache.match(tokens(1, 2, 3, 4)).device_node)
    assert len(nodes) == 4 and nodes.index(parent) < min(nodes.index(c) for c in parent.children.values())
    first = cache.store_host_copies(nodes[:2])
    assert first and {n.id for n in cache.unstored_host_nodes()} == {n.id for n in nodes[2:]}
    clean(cache)
    drain(cache, copier, eng)
    assert cache.store_host_copies(nodes[:2]) == 0  # stored already: nothing to start
    assert cache.store_host_copies(nodes) and cache.unstored_host_nodes() == []
    drain(cache, copier, eng)
    assert cache.counters.stored_tokens == 10 and len(copier.storage) == 5
    clean(cache)


def test_a_write_back_split_by_a_landing_prefetch_leaves_the_device_deepest_first():
    """A prefetch landing splits a node whose write-back runs; when the write-back ends,
    routers are told the lower half left the device before the upper half (the upper
    half was told first: for a moment a device node's parent was off the device)."""
    cache, copier = make_cache("write_back", page_size=2, storage="write_back")
    eng = Engine(cache, copier)
    ab, abe = tokens(1, 2, 3, 4), tokens(1, 2, 3, 4, 5, 6)
    for i, k in enumerate(page_keys(b"test-salt", ab, 2)):
        copier.storage[k] = identity(ab, b"", i, 2)
    fetch = cache.start_prefetch(ab, b"", 2)
    eng.insert(abe)  # one device-only node of 3 pages
    told = []

    class Listener:
        def residency_changed(self, tier, change, node):
            if tier == "device" and change == "removed":
                told.append([c.id for c in node.children.values() if c.full.device_pages is not None])

    cache.residency_listener = Listener()
    assert cache.evict_device(3).pending
    copier.complete(cache, fetch)  # lands on ab: the evicting node splits at 2 pages
    drain(cache, copier, eng)
    clean(cache)
    assert len(told) == 2 and told == [[], []]  # each half, none told with a device child


def test_an_evict_covered_by_nodes_waiting_for_room_still_takes_a_leaf_with_a_host_copy():
    """X (no host copy) waits for the store freeing host room; Y, next in line, has a
    host copy and leaves at once: the Evict frees Y now instead of coming back empty."""
    cache, copier = make_cache("write_through", page_size=2, host_pages=4, storage="write_through")
    eng = Engine(cache, copier)

    def complete(kind, fail=False):
        for tid in [t for t, tr in cache.transfers.items() if tr.kind is kind]:
            copier.complete(cache, tid, fail)

    a, x, y = tokens(1, 2, 3, 4, 5, 6), tokens(7, 8), tokens(9, 10)
    eng.insert(a)
    complete(TransferKind.BACKUP)
    complete(TransferKind.STORE, fail=True)    # A: on host, not in storage
    eng.give(cache.evict_device(3).freed_pages)  # A: host only (3 of 4 host pages)
    eng.insert(x)
    complete(TransferKind.BACKUP, fail=True)   # X: device only
    eng.insert(y)
    complete(TransferKind.BACKUP)              # Y: device and host; its store stays in flight
    assert cache.host.num_free == 0
    r = cache.evict_device(1)                  # X first (least recent): no room, A's store frees some
    assert len(r.freed_pages) == 4 and not r.pending  # one page (packed int32), at once
    assert cache.match(y).device_tokens == 0 and cache.match(y).host_tokens == 2  # Y left the device
    assert cache.match(x).device_tokens == 2  # X waits for the room
    clean(cache)


def test_a_prefetch_short_of_host_room_names_the_stores_that_make_it_or_takes_what_fits():
    """The pool lacks room for the whole run only until a store in flight ends (its pages
    become evictable then): the whole fetch waits for that store (NotReady names it); one
    that takes part of the run fetches its first pages, as many as are free. Before, the
    fetch was all or nothing: a lookup staging a prompt right after another prompt was
    written through got no hit at all."""
    cache, copier = make_cache("write_through", storage="write_through", host_pages=3)
    eng = Engine(cache, copier)
    old, new = tokens(1, 2, 3, 4), tokens(5, 6, 7, 8)
    eng.insert(old)
    drain(cache, copier, eng)  # the backup, then the store it starts
    drain(cache, copier, eng)
    eng.give(cache.evict_device(2).freed_pages)
    cache.evict_host(2)  # stored: it leaves the host at once
    assert cache.match(old).host_tokens == 0 and cache.storage_probe(old).keys
    eng.insert(new)
    [backup] = cache.transfers
    copier.complete(cache, backup)  # the store it starts stays in flight
    [store] = [tid for tid, t in cache.transfers.items() if t.kind is TransferKind.STORE]
    assert cache.host.num_free == 1
    with pytest.raises(NotReady) as refused:
        cache.start_prefetch(old, b"", 2)
    assert refused.value.transfers == (store,) and cache.host.num_free == 1
    clean(cache)
    part = cache.start_prefetch(old, b"", 2, partial=True)
    assert copier.complete(cache, part).added_tokens == 2  # the run's first page
    assert cache.match(old).host_tokens == 2
    clean(cache)
    copier.complete(cache, store)  # new is stored: evictable, so the rest of old fits
    rest = cache.start_prefetch(old, b"", 2)
    assert copier.complete(cache, rest).added_tokens == 2
    assert cache.match(old).host_tokens == 4
    clean(cache)


def test_a_prefetch_with_no_store_in_flight_takes_what_fits_at_once():
    """Room held by a lease does not come by waiting: the run's first pages that fit."""
    cache, copier = make_cache("write_through", storage="write_through", host_pages=3)
    eng = Engine(cache, copier)
    old, new = tokens(1, 2, 3, 4), tokens(5, 6, 7, 8)
    eng.insert(old)
    drain(cache, copier, eng)
    drain(cache, copier, eng)
    eng.give(cache.evict_device(2).freed_pages)
    cache.evict_host(2)
    eng.insert(new)
    drain(cache, copier, eng)
    eng.give(cache.evict_device(2).freed_pages)  # new on host only (and stored)
    cache.lock(cache.match(new).host_node)  # a lease: its host copy may not leave
    tid = cache.start_prefetch(old, b"", 2)
    assert copier.complete(cache, tid).added_tokens == 2
    assert cache.match(old).host_tokens == 2
    clean(cache)
