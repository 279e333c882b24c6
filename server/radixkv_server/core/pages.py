"""Packed int32 lists: the form tokens and page indices take on the wire and in the core.

Tokens and page indices travel as little-endian int32 `bytes`. The core keeps them that
way: a node's key is a `bytes` slice of the prompt and its page lists are `bytes`, so a
match concatenates slices instead of building lists of ints.
"""

import sys
from array import array

from .errors import InvalidRequest

INT32 = 4

if sys.byteorder != "little":  # array('i') is native-endian; the wire is little-endian.
    raise ImportError("radixkv assumes a little-endian host")


def require_packed(buf: bytes, what: str) -> None:
    """Raise InvalidRequest unless `buf` is packed int32 (whole 4-byte values), saying
    "<what> bytes (n) are not a multiple of 4 (packed int32)". Every check of a caller's
    tokens or page list, wire or core, is this one."""
    if len(buf) % INT32:
        raise InvalidRequest(f"{what} bytes ({len(buf)}) are not a multiple of 4 (packed int32)")


def pack(values) -> bytes:
    """Pack an iterable of ints as little-endian int32 bytes."""
    return array("i", values).tobytes()


def unpack(buf: bytes) -> array:
    """Unpack little-endian int32 bytes into an array('i')."""
    out = array("i")
    out.frombytes(buf)
    return out


def count(buf: bytes) -> int:
    """Number of int32 values in a packed buffer."""
    return len(buf) // INT32
