"""Both backends, same contract: exact pages back, leading-prefix probes, misses,
damaged pages as misses, no rewrites, sharing between instances, concurrent use."""

import os
import random
import struct
import threading
import zlib

import pytest

from radixkv_server.core.pages import pack
from radixkv_server.storage import StorageUnavailable, namespace_salt, page_keys
from radixkv_server.storage.record import HEADER_BYTES

SALT = namespace_salt("test-model", "fp16/L2/H2/D8/P4")


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return page_keys(SALT, pack(range(seed, seed + 4 * n)), 4)


def payloads(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [0, 1, 1 << 20] + [rng.randrange(1, 64 << 10) for _ in range(n - 3)]
    return [rng.randbytes(size) for size in sizes[:n]]


def test_round_trip_of_many_pages_is_byte_exact(store):
    backend = store.open()
    keys, pages = keys_for(200), payloads(200)
    assert backend.put(list(zip(keys, pages))) == 200
    assert backend.get(keys) == pages
    assert backend.get(list(reversed(keys))) == list(reversed(pages))
    s = backend.stats
    assert (s.puts, s.put_bytes, s.put_skipped) == (200, sum(map(len, pages)), 0)
    assert (s.gets, s.get_bytes, s.misses, s.corrupt, s.errors) == (400, 2 * sum(map(len, pages)), 0, 0, 0)
    assert s.seconds > 0


def test_exists_prefix_counts_leading_keys_and_stops_at_first_gap(store):
    backend = store.open()
    keys, pages = keys_for(10), payloads(10)
    backend.put([(k, p) for i, (k, p) in enumerate(zip(keys, pages)) if i != 5])
    assert backend.exists_prefix(keys) == 5
    assert backend.exists_prefix(keys[6:]) == 4
    assert backend.exists_prefix(keys[:3]) == 3
    assert backend.exists_prefix(keys_for(3, seed=999)) == 0
    assert backend.exists_prefix([]) == 0


def test_exists_prefix_across_batches(store):
    backend = store.open()
    keys = keys_for(150)
    backend.put([(k, b"x") for k in keys[:130]])
    assert backend.exists_prefix(keys) == 130


def test_missing_keys_read_as_none(store):
    backend = store.open()
    keys, pages = keys_for(4), payloads(4)
    backend.put([(keys[1], pages[1])])
    assert backend.get(keys) == [None, pages[1], None, None]
    assert backend.get([]) == []
    assert (backend.stats.gets, backend.stats.misses, backend.stats.corrupt) == (4, 3, 0)


def _flip_payload_byte(blob: bytes) -> bytes:
    damaged = bytearray(blob)
    damaged[HEADER_BYTES + len(damaged[HEADER_BYTES:]) // 2] ^= 0xFF
    return bytes(damaged)


@pytest.mark.parametrize("damage", [_flip_payload_byte, lambda blob: blob[: len(blob) // 2]],
                         ids=["flipped_byte", "truncated"])
def test_damaged_page_reads_as_none_and_can_be_stored_again(store, damage):
    backend = store.open()
    keys, pages = keys_for(3), payloads(3, seed=1)
    backend.put(list(zip(keys, pages)))
    store.write_raw(backend, keys[1], damage(store.read_raw(backend, keys[1])))

    assert backend.get(keys) == [pages[0], None, pages[2]]
    assert backend.stats.corrupt == 1
    assert backend.stats.misses == 0
    assert store.read_raw(backend, keys[1]) is None  # dropped, so it can heal
    assert backend.put([(keys[1], pages[1])]) == 1
    assert backend.get([keys[1]]) == [pages[1]]



def _version_1_record(payload: bytes) -> bytes:
    """A record as the version-1 format wrote it: its CRC over the payload alone."""
    return struct.pack("<4sHHQI", b"RKVP", 1, 0, len(payload), zlib.crc32(payload)) + payload


def test_records_of_the_older_format_and_this_one_live_side_by_side(store):
    """A rolling upgrade: daemons of the version-1 format and of this one share the
    store. Each format names its records apart, so this version never reads, counts or
    removes the older daemons' records (they would see it delete each of theirs it read,
    one page of a run at a time, and probe as present pages it then refused), and stores
    its own beside them; a rollback finds the older records where they were."""
    backend = store.open()
    keys, pages = keys_for(3), payloads(3, seed=4)
    for key, page in zip(keys, pages):
        store.write_raw(backend, key, _version_1_record(page), version=1)
    assert backend.exists_prefix(keys) == 0 and backend.get(keys) == [None] * 3
    assert backend.place(backend.read_ahead(keys, 1 << 20), []) == 0
    assert backend.put(list(zip(keys, pages))) == 3 and backend.get(keys) == pages
    assert (backend.stats.corrupt, backend.stats.put_skipped) == (0, 0)
    assert [store.read_raw(backend, k, version=1) for k in keys] == [_version_1_record(p) for p in pages]

def test_put_of_existing_key_keeps_the_first_page(store):
    backend = store.open()
    key = keys_for(1)[0]
    assert backend.put([(key, b"first")]) == 1
    raw = store.read_raw(backend, key)
    assert backend.put([(key, b"second"), (key, b"third")]) == 0
    assert backend.get([key]) == [b"first"]
    assert store.read_raw(backend, key) == raw
    assert backend.stats.put_skipped == 2


def test_two_instances_share_pages(store):
    a, b = store.open(), store.open()
    keys, pages = keys_for(8), payloads(8, seed=2)
    a.put(list(zip(keys[:5], pages[:5])))
    assert b.exists_prefix(keys) == 5
    assert b.get(keys[:5]) == pages[:5]
    assert b.put(list(zip(keys, pages))) == 3  # only the pages a lacked
    assert a.get(keys) == pages


def test_concurrent_writers_and_readers_see_whole_pages(store):
    backend, other = store.open(), store.open()
    keys, pages = keys_for(40, seed=3), payloads(40, seed=3)
    expected = dict(zip(keys, pages))
    bad = []

    def work(b, seed):
        rng = random.Random(seed)
        for _ in range(30):
            chosen = rng.sample(keys, 5)
            b.put([(k, expected[k]) for k in chosen])
            for k, got in zip(chosen, b.get(chosen)):
                if got is None and store.kind == "mooncake":
                    continue  # Mooncake: another writer's put of this key may still be in flight
                if got != expected[k]:
                    bad.append(k)

    threads = [threading.Thread(target=work, args=(backend if i % 2 else other, i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    assert backend.get(keys) == [expected[k] if backend.exists_prefix([k]) else None for k in keys]
    assert backend.stats.corrupt == other.stats.corrupt == 0


def test_bad_arguments_raise_before_touching_the_store(store):
    backend = store.open()
    with pytest.raises(ValueError, match="key must be 1..64 bytes"):
        backend.get(["not-bytes"])
    with pytest.raises(ValueError, match="key must be 1..64 bytes"):
        backend.exists_prefix([b""])
    with pytest.raises(ValueError, match="key must be 1..64 bytes"):
        backend.put([(b"k" * 65, b"page")])
    with pytest.raises(ValueError, match="tuple"):
        backend.put([b"key-only"])
    with pytest.raises(TypeError, match="payload must be bytes-like"):
        backend.put([(b"key", "text")])
    assert backend.stats.errors == 0


def test_close_is_idempotent_and_later_calls_raise(store):
    backend = store.open()
    key = keys_for(1)[0]
    backend.put([(key, b"page")])
    backend.close()
    backend.close()
    assert backend.closed
    with pytest.raises(StorageUnavailable, match="closed") as info:
        backend.get([key])
    assert info.value.operation == "get"
    assert store.open().get([key]) == [b"page"]  # closing one instance leaves the store alone


def test_check_passes_on_a_healthy_store(store):
    backend = store.open()
    backend.check()
    if store.kind == "file":
        assert [n for n in os.listdir(backend.directory) if n.endswith(".tmp")] == []
