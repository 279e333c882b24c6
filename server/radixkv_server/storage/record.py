"""The stored form of a page: a fixed header, then the payload bytes as given.

Layout (all integers little-endian), 20 header bytes:

    offset  size  field
    0       4     magic b"RKVP"
    4       2     version (2)
    6       2     reserved, written 0, ignored on read
    8       8     payload length in bytes
    16      4     CRC-32 of the key, then the payload (zlib / IEEE 802.3 polynomial:
                  `zlib.crc32(payload, zlib.crc32(key))`)
    20      n     payload

The key is in the checksum (version 2; version 1 covered the payload alone), so a sound
record read under another key (moved, copied, or lined up with the wrong key by a bug in
a batched read) fails its check like a damaged one, and is never served as that key's
page. The key itself is not stored: the store already files the record under it.

Each format version names its records apart (`record_name`: "v2:" before the key's hex;
version 1 used the hex alone). Daemons of two versions sharing a store during a rolling
upgrade therefore never read, count or remove each other's records, and a rollback
finds the older version's records where it left them; the records of a version no
daemon runs any more leave by the store's own eviction.

The CRC is computed by zlib-ng (`zlib-ng` package: the same CRC-32, with the CPU's
carry-less multiply, ~40 GB/s per core measured here) and falls back to the standard
library's zlib (~2 GB/s: then the check costs more than reading the page) when that
package is missing; both give the same values, so records are the same either way. It
guards against torn, bit-flipped and misfiled records, not against tampering (anyone who
can write the store can write a record with a matching checksum).
"""

import struct

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # the standard library's, same polynomial and values, ~20x slower
    from zlib import crc32

MAGIC = b"RKVP"
VERSION = 2
_HEADER = struct.Struct("<4sHHQI")
HEADER_BYTES = _HEADER.size


class CorruptPage(ValueError):
    """A stored record that cannot be read back: bad magic, unknown version, truncated
    or overlong, or a payload whose checksum does not match. The message says which."""


class NotForThisReader(CorruptPage):
    """A record this reader cannot use that may well be sound: a miss for it, not damage
    (the record stays, for the readers it is for)."""


class SizeMismatch(NotForThisReader):
    """A sound record whose payload length differs from the page being filled (a page
    of another layout)."""


class OtherVersion(NotForThisReader):
    """A record of a newer format version than this build reads: a newer daemon's,
    during a rolling upgrade. Kept for the daemons that read it (removed as damage, the
    old daemons deleted the new ones' pages). A record of an OLDER version is damage to
    this build: removed, so this build stores its own page there (kept, it would block
    the key for good, since a present key is never written again)."""


def _version_error(version: int) -> CorruptPage:
    if version > VERSION:
        return OtherVersion(f"record version {version} is newer than this build reads ({VERSION})")
    return CorruptPage(f"record version {version} is older than this build's ({VERSION}): replaced")


NAME_TAG = f"v{VERSION}"


def record_name(key: bytes) -> str:
    """The name of `key`'s record in a store that names records by string, after the
    store's prefix: this format's tag and the key in lowercase hex ("v2:0a1b..."). Pure."""
    return f"{NAME_TAG}:{key.hex()}"


def checksum(key: bytes, payload) -> int:
    """The CRC-32 a record of `payload` stored under `key` carries. Pure."""
    return crc32(payload, crc32(key))


def _mismatch(expected: int, actual: int) -> CorruptPage:
    return CorruptPage(f"checksum mismatch: header says {expected:#010x}, key and payload give {actual:#010x} "
                       "(damaged, or a record stored under another key)")


def encode(key: bytes, payload: bytes) -> bytes:
    """Header + payload, ready to store under `key`. Pure; accepts any C-contiguous
    bytes-like payload."""
    view = memoryview(payload).cast("B")
    return _HEADER.pack(MAGIC, VERSION, 0, len(view), checksum(key, view)) + view


def decode(key: bytes, blob: bytes) -> bytes:
    """The payload of a record `encode` made for `key`; raises CorruptPage if it is
    damaged or was made for another key."""
    if len(blob) < HEADER_BYTES:
        raise CorruptPage(f"truncated record: {len(blob)} bytes, the header alone is {HEADER_BYTES}")
    magic, version, _reserved, length, expected = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptPage(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _version_error(version)
    found = len(blob) - HEADER_BYTES
    if found != length:
        what = "truncated record" if found < length else "trailing bytes after record"
        raise CorruptPage(f"{what}: header says {length} payload bytes, found {found}")
    payload = memoryview(blob)[HEADER_BYTES:]
    actual = checksum(key, payload)
    if actual != expected:
        raise _mismatch(expected, actual)
    return payload.tobytes()


def header(key: bytes, payload) -> bytes:
    """The header `encode` would put before `payload` for `key`, alone: for backends that
    store the header and the payload from two buffers (no concatenated copy). Pure."""
    view = memoryview(payload).cast("B")
    return _HEADER.pack(MAGIC, VERSION, 0, len(view), checksum(key, view))


def payload_length(head) -> int:
    """The payload length a record header announces; raises CorruptPage for a header
    that is short, of another format, or of an unknown version."""
    if len(head) < HEADER_BYTES:
        raise CorruptPage(f"truncated record: {len(head)} bytes, the header alone is {HEADER_BYTES}")
    magic, version, _reserved, length, _checksum = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptPage(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _version_error(version)
    return length


def verify(key: bytes, head, payload) -> None:
    """Check a payload read in place (e.g. straight into a host page) for `key` against
    its header: SizeMismatch when the header announces another length (a page of another
    layout), CorruptPage when the payload is damaged or was stored for another key.
    Reads only."""
    length = payload_length(head)
    view = memoryview(payload).cast("B")
    if len(view) != length:
        raise SizeMismatch(f"record holds {length} payload bytes, the page has {len(view)}")
    expected = _HEADER.unpack_from(head)[4]
    actual = checksum(key, view)
    if actual != expected:
        raise _mismatch(expected, actual)


def decode_into(key: bytes, blob, out) -> None:
    """Check the whole record `blob` of `key` and copy its payload into `out` (one copy, no
    temporary). SizeMismatch when the record is sound but not len(out) bytes long,
    CorruptPage when it is damaged or truncated; `out` is then unspecified.
    The payload is copied first and checked in `out`, where the copy left it in cache:
    the record is read once instead of twice (a checksum over the source first, then
    the copy, costs about a quarter more for 64 KiB pages read from DRAM)."""
    blob = memoryview(blob).cast("B")
    out = memoryview(out).cast("B")
    length = payload_length(blob[:HEADER_BYTES])
    found = len(blob) - HEADER_BYTES
    if found != length:
        what = "truncated record" if found < length else "trailing bytes after record"
        raise CorruptPage(f"{what}: header says {length} payload bytes, found {found}")
    if length != len(out):
        raise SizeMismatch(f"record holds {length} payload bytes, the page has {len(out)}")
    out[:] = blob[HEADER_BYTES:]
    verify(key, blob[:HEADER_BYTES], out)
