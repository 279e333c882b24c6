"""The stored record: exact round trip, and every kind of damage detected."""

import os
import struct

import pytest

from radixkv_server.storage import CorruptPage, decode, encode
from radixkv_server.storage.record import HEADER_BYTES


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20])
def test_round_trip_is_byte_exact(size):
    payload = os.urandom(size)
    blob = encode(payload)
    assert len(blob) == HEADER_BYTES + size
    assert decode(blob) == payload
    assert decode(bytearray(blob)) == payload


def test_records_carry_zlibs_crc32_whichever_implementation_runs():
    # zlib-ng when installed, the standard library's zlib otherwise: a record written by
    # a daemon with one reads back in a daemon with the other.
    import zlib
    payload = os.urandom(70_000)
    checksum = struct.unpack_from("<I", encode(payload), 16)[0]
    assert checksum == zlib.crc32(payload)


def test_encode_takes_any_contiguous_buffer():
    values = memoryview(bytearray(range(16))).cast("I")  # 4 items, 16 bytes
    assert decode(encode(values)) == bytes(range(16))


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
    ("version", r"record version 99 \(this build reads 1\)"),
    ("truncated_payload", "truncated record"),
    ("truncated_header", "truncated record"),
    ("trailing", "trailing bytes"),
    ("empty", "truncated record"),
])
def test_damage_raises_corrupt_page(kind, message):
    blob = encode(os.urandom(64))
    with pytest.raises(CorruptPage, match=message):
        decode(_damage(kind, blob))


def test_a_record_of_another_format_version_is_a_miss_and_stays(tmp_path):
    """Daemons of two versions sharing a store during a rolling upgrade: a record this
    build does not read is a miss here, kept for the daemons that read it (it was
    removed as damage, so each version deleted the other's pages)."""
    from radixkv_server.storage import FileStorage

    backend = FileStorage(tmp_path)
    key = bytes(range(32))
    assert backend.put([(key, b"x" * 64)]) == 1
    path = backend.path_for(key)
    with open(path, "rb") as f:
        newer = _damage("version", f.read())
    with open(path, "wb") as f:
        f.write(newer)
    assert backend.get([key]) == [None]
    assert backend.stats.corrupt == 0
    with open(path, "rb") as f:
        assert f.read() == newer
