"""The stored record: exact round trip, and every kind of damage detected."""

import os
import struct

import pytest

from radixkv_server.storage import CorruptPage, decode, encode
from radixkv_server.storage.record import HEADER_BYTES, decode_into, verify


KEY = bytes(range(32))


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20])
def test_round_trip_is_byte_exact(size):
    payload = os.urandom(size)
    blob = encode(KEY, payload)
    assert len(blob) == HEADER_BYTES + size
    assert decode(KEY, blob) == payload
    assert decode(KEY, bytearray(blob)) == payload


def test_records_carry_zlibs_crc32_of_key_and_payload_whichever_implementation_runs():
    # zlib-ng when installed, the standard library's zlib otherwise: a record written by
    # a daemon with one reads back in a daemon with the other.
    import zlib
    payload = os.urandom(70_000)
    checksum = struct.unpack_from("<I", encode(KEY, payload), 16)[0]
    assert checksum == zlib.crc32(payload, zlib.crc32(KEY))


def test_a_sound_record_read_under_another_key_is_refused_as_misfiled():
    """A record copied, moved or lined up with the wrong key (a batched read's bug) is
    sound bytes for ANOTHER page: served, the engine would compute on wrong KV."""
    payload = os.urandom(4096)
    blob = encode(KEY, payload)
    other = bytes(reversed(KEY))
    with pytest.raises(CorruptPage, match="record stored under another key"):
        decode(other, blob)
    with pytest.raises(CorruptPage, match="record stored under another key"):
        decode_into(other, blob, bytearray(4096))
    with pytest.raises(CorruptPage, match="record stored under another key"):
        verify(other, blob[:HEADER_BYTES], payload)


def test_encode_takes_any_contiguous_buffer():
    values = memoryview(bytearray(range(16))).cast("I")  # 4 items, 16 bytes
    assert decode(KEY, encode(KEY, values)) == bytes(range(16))


def _damage(kind: str, blob: bytes) -> bytes:
    b = bytearray(blob)
    if kind == "flip_payload":
        b[HEADER_BYTES + 5] ^= 0x40
    elif kind == "flip_checksum":
        b[HEADER_BYTES - 1] ^= 0x01
    elif kind == "magic":
        b[0:4] = b"XXXX"
    elif kind == "version":
        b[4:6] = struct.pack("<H", 99)
    elif kind == "old_version":
        b[4:6] = struct.pack("<H", 1)  # the format before keys were in the checksum
    elif kind == "truncated_payload":
        del b[-1]
    elif kind == "truncated_header":
        del b[HEADER_BYTES - 3:]
    elif kind == "trailing":
        b += b"\x00"
    elif kind == "empty":
        b = bytearray()
    return bytes(b)


@pytest.mark.parametrize("kind, message", [
    ("flip_payload", "checksum mismatch"),
    ("flip_checksum", "checksum mismatch"),
    ("magic", "bad magic"),
    ("version", r"record version 99 is newer than this build reads \(2\)"),
    ("old_version", r"record version 1 is older than this build's \(2\): replaced"),
    ("truncated_payload", "truncated record"),
    ("truncated_header", "truncated record"),
    ("trailing", "trailing bytes"),
    ("empty", "truncated record"),
])
def test_damage_raises_corrupt_page(kind, message):
    blob = encode(KEY, os.urandom(64))
    with pytest.raises(CorruptPage, match=message):
        decode(KEY, _damage(kind, blob))


def test_records_of_other_format_versions_under_this_formats_name(tmp_path):
    """Each format names its records apart (test_storage_backends.py: the two live side
    by side), so a record of another version under this format's name was put there by
    hand or by a future format sharing names. A newer one is a miss and stays (for the
    daemons that read it); an older one is replaced by this version's page (kept, it
    would block its key for good: a present key is never written again)."""
    from radixkv_server.storage import FileStorage

    backend = FileStorage(tmp_path)
    newer, older = bytes(range(32)), bytes(range(1, 33))
    payload = b"x" * 64
    assert backend.put([(newer, payload), (older, payload)]) == 2
    for key, kind in ((newer, "version"), (older, "old_version")):
        path = backend.path_for(key)
        with open(path, "rb") as f:
            damaged = _damage(kind, f.read())
        with open(path, "wb") as f:
            f.write(damaged)
    assert backend.get([newer]) == [None] and backend.stats.corrupt == 0
    with open(backend.path_for(newer), "rb") as f:
        assert f.read()[4:6] == struct.pack("<H", 99)  # kept for the newer daemons
    assert backend.get([older]) == [None] and backend.stats.corrupt == 1  # removed...
    assert backend.put([(older, payload)]) == 1 and backend.get([older]) == [payload]  # ...and stored anew
