"""get_into, the prefetch path: payloads land in the caller's page buffers (a host pool
in the daemon), checked in place; the run of pages stops at the first miss or damage,
and never leaves wrong bytes counted as read. Every backend kind."""

import numpy as np
import pytest

from radixkv_server.storage.record import HEADER_BYTES

from test_storage_backends import keys_for

PAGE = 4096


def pool_with(n: int, seed: int = 0) -> np.ndarray:
    """Host-pool-like memory: [pages, PAGE] bytes; the first n pages random."""
    pool = np.zeros((2 * n, PAGE), dtype=np.uint8)
    pool[:n] = np.random.default_rng(seed).integers(0, 256, size=(n, PAGE), dtype=np.uint8)
    return pool


def views(pool: np.ndarray, rows) -> list[memoryview]:
    return [memoryview(pool[r]) for r in rows]


def test_pages_from_attached_memory_round_trip_in_place(store):
    backend = store.open()
    pool = pool_with(24, seed=1)
    backend.attach_memory(pool.ctypes.data, pool.nbytes)
    keys = keys_for(24, seed=10)
    assert backend.put(list(zip(keys, views(pool, range(24))))) == 24
    assert backend.get_into(keys, views(pool, range(24, 48))) == 24
    assert np.array_equal(pool[24:], pool[:24])
    assert backend.stats.get_bytes == 24 * PAGE and backend.stats.misses == 0


def test_run_stops_at_the_first_missing_page(store):
    backend = store.open()
    pool = pool_with(8, seed=2)
    backend.attach_memory(pool.ctypes.data, pool.nbytes)
    keys = keys_for(8, seed=20)
    backend.put([(k, memoryview(pool[i])) for i, k in enumerate(keys) if i != 5])
    assert backend.get_into(keys, views(pool, range(8, 16))) == 5
    assert np.array_equal(pool[8:13], pool[:5])


def test_damaged_page_ends_the_run_and_is_dropped(store):
    backend = store.open()
    pool = pool_with(6, seed=3)
    backend.attach_memory(pool.ctypes.data, pool.nbytes)
    keys = keys_for(6, seed=30)
    backend.put(list(zip(keys, views(pool, range(6)))))
    raw = bytearray(store.read_raw(backend, keys[2]))
    raw[HEADER_BYTES + 100] ^= 0x01
    store.write_raw(backend, keys[2], bytes(raw))
    assert backend.get_into(keys, views(pool, range(6, 12))) == 2
    assert np.array_equal(pool[6:8], pool[:2])
    assert backend.stats.corrupt == 1
    assert store.read_raw(backend, keys[2]) is None



@pytest.mark.parametrize("path", ["get", "get_into", "read_ahead"])
def test_a_sound_record_filed_under_another_key_never_lands(store, path):
    """Another page's whole, undamaged record under a key (copied or moved in the store,
    or lined up with the wrong key by a batched read) is that other page's KV: it ends
    the run as damage, never read as this key's page. Before, only the payload was in
    the checksum, and it was served."""
    backend = store.open()
    pool = pool_with(4, seed=5)
    backend.attach_memory(pool.ctypes.data, pool.nbytes)
    keys = keys_for(4, seed=50)
    backend.put(list(zip(keys, views(pool, range(4)))))
    store.write_raw(backend, keys[2], store.read_raw(backend, keys[0]))
    if path == "get":
        assert backend.get(keys)[2] is None
    elif path == "get_into":
        assert backend.get_into(keys, views(pool, range(4, 8))) == 2
    else:
        assert backend.place(backend.read_ahead(keys, PAGE), views(pool, range(4, 8))) == 2
    assert backend.stats.corrupt == 1 and store.read_raw(backend, keys[2]) is None

def test_page_of_another_size_is_a_miss_not_damage(store):
    backend = store.open()
    key = keys_for(1, seed=40)[0]
    backend.put([(key, b"x" * (PAGE // 2))])
    page = bytearray(PAGE)
    assert backend.get_into([key], [memoryview(page)]) == 0
    assert (backend.stats.misses, backend.stats.corrupt) == (1, 0)
    assert backend.get([key]) == [b"x" * (PAGE // 2)]  # still there for its own layout


def test_pages_outside_attached_memory_still_round_trip(store):
    backend = store.open()
    keys = keys_for(3, seed=50)
    pages = [bytes([i]) * PAGE for i in range(3)]
    backend.put(list(zip(keys, pages)))
    out = [bytearray(PAGE) for _ in range(3)]
    assert backend.get_into(keys, [memoryview(o) for o in out]) == 3
    assert [bytes(o) for o in out] == pages


def test_mismatched_lists_are_refused(store):
    backend = store.open()
    with pytest.raises(ValueError, match="2 keys but 1 pages"):
        backend.get_into(keys_for(2), [bytearray(PAGE)])


# -- read_ahead then place: a prefetch finds the run first, reserves pages, then fills them --

def test_read_ahead_finds_the_run_and_place_fills_it(store):
    backend = store.open()
    pool = pool_with(8, seed=6)
    backend.attach_memory(pool.ctypes.data, pool.nbytes)
    keys = keys_for(8, seed=60)
    backend.put([(k, memoryview(pool[i])) for i, k in enumerate(keys) if i != 6])
    ahead = backend.read_ahead(keys, PAGE)
    assert ahead.found == 6 and ahead.keys == keys[:6]
    assert backend.place(ahead, views(pool, range(8, 14))) == 6
    assert np.array_equal(pool[8:14], pool[:6])
    assert backend.stats.get_bytes == 6 * PAGE


def test_place_may_take_fewer_pages_than_the_run(store):
    backend = store.open()
    pool = pool_with(4, seed=7)
    keys = keys_for(4, seed=70)
    backend.put(list(zip(keys, views(pool, range(4)))))
    ahead = backend.read_ahead(keys, PAGE)
    assert backend.place(ahead, views(pool, range(4, 6))) == 2
    assert np.array_equal(pool[4:6], pool[:2]) and not pool[6:].any()
    with pytest.raises(ValueError, match="5 pages for a run of 4"):
        backend.place(ahead, views(pool, range(3)) + views(pool, range(2)))


def test_a_damaged_page_in_a_run_found_ahead_never_lands(store):
    """read_ahead finds what is present (a probe does not read payloads); every page is
    checked as it is placed: the run ends at damage, and the damaged record is dropped."""
    backend = store.open()
    pool = pool_with(4, seed=8)
    keys = keys_for(4, seed=80)
    backend.put(list(zip(keys, views(pool, range(4)))))
    raw = bytearray(store.read_raw(backend, keys[1]))
    raw[HEADER_BYTES + 7] ^= 0x01
    store.write_raw(backend, keys[1], bytes(raw))
    ahead = backend.read_ahead(keys, PAGE)
    assert ahead.found == 4  # present (a probe does not check payloads)
    assert backend.place(ahead, views(pool, range(4, 8))) == 1
    assert np.array_equal(pool[4], pool[0])
    assert backend.stats.corrupt == 1 and store.read_raw(backend, keys[1]) is None


def test_read_ahead_of_nothing_stored_finds_nothing(store):
    backend = store.open()
    ahead = backend.read_ahead(keys_for(3, seed=90), PAGE)
    assert (ahead.found, ahead.keys) == (0, [])
    assert backend.read_ahead([], PAGE).found == 0


def test_read_aheads_dropped_unplaced_give_back_what_they_held(store):
    """A prefetch that finds no host room closes its read: a store that lends staging
    buffers (Mooncake) must still read ahead after many such reads."""
    backend = store.open()
    pool = pool_with(4, seed=9)
    keys = keys_for(4, seed=95)
    backend.put(list(zip(keys, views(pool, range(4)))))
    first = backend.read_ahead(keys, PAGE)
    for _ in range(12):
        backend.read_ahead(keys, PAGE).close()
    again = backend.read_ahead(keys, PAGE)
    assert (again.records is None) == (first.records is None) and again.found == 4
    first.close()
    assert backend.place(again, views(pool, range(4, 8))) == 4
    assert np.array_equal(pool[4:8], pool[:4])
