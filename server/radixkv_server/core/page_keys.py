"""Storage keys: a hash chain over whole pages, salted with the namespace identity.

A page's key names the whole prefix that ends with it, so the same prompt prefix maps to
the same key in every daemon serving the same model and KV layout, and two models (or
two layouts, or two `extra_key`s) never share a key.

Exact byte layout (so other implementations can interoperate). `H(x)` is unkeyed
BLAKE2b with a 32-byte digest (`hashlib.blake2b(x, digest_size=32)`, no key, salt or
person parameters); `u32(n)` is n as 4 little-endian bytes; `||` concatenates.

    salt   = H(b"radixkv/namespace/v1\\x00" || u32(len(m)) || m || u32(len(f)) || f)
             m: model name as UTF-8, f: KV layout fingerprint as UTF-8
    prefix = b"radixkv/page/v1\\x00" || u32(len(salt)) || salt || u32(len(x)) || x
             x: extra_key (LoRA id, cache salt; empty by default)
    h_0    = start, or 32 zero bytes for the first page of a prompt
    h_i    = H(prefix || h_{i-1} || T_i)      (the key of page i, i = 1, 2, ...)
             T_i: the page_size * 4 bytes of page i's tokens (little-endian int32)

The layout fingerprint (`layout_fingerprint`) covers everything that changes a page's
bytes (dtype, layers, heads, head_dim, page_size, tensor-parallel shards); the model name
alone does not. A managed-device namespace whose engine splits a page over its buffers
otherwise than the layout's own way adds that split (`service.registration.storage_salt`).
Every part of a key is made here; a storage backend only names a key's record from
`hex(key)` and the record format's version: Redis, Redis Cluster and Mooncake as
`prefix + "v2:" + hex(key)` (the URL's `prefix=`, "radixkv:" by default: daemons share
records only under one prefix), the file backend as `<dir>/<hex[0:2]>/<hex[2:4]>/<hex>.v2.page`
(storage/record.py).
"""

import hashlib
import struct

KEY_BYTES = 32
ROOT = bytes(KEY_BYTES)  # h_0 of every chain that starts at the first token
_NAMESPACE_TAG = b"radixkv/namespace/v1\x00"
_PAGE_TAG = b"radixkv/page/v1\x00"
_U32 = struct.Struct("<I")
_INT32 = 4


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _hash(data: bytes = b""):
    return hashlib.blake2b(data, digest_size=KEY_BYTES)


def namespace_salt(model: str, layout_fingerprint: str) -> bytes:
    """The 32-byte salt of one namespace: a model name and a KV layout fingerprint.

    Pure and deterministic: equal arguments give equal salts in every process.
    Raises TypeError unless both arguments are `str`, ValueError if `model` is empty.
    """
    if not isinstance(model, str) or not isinstance(layout_fingerprint, str):
        raise TypeError(
            f"namespace_salt takes two str, got {type(model).__name__} and "
            f"{type(layout_fingerprint).__name__}")
    if not model:
        raise ValueError("namespace_salt: model name must not be empty")
    data = _NAMESPACE_TAG + _field(model.encode()) + _field(layout_fingerprint.encode())
    return _hash(data).digest()


def layout_fingerprint(layout, tp_size: int = 1) -> str:
    """The fingerprint `f` of `layout` (a `radixkv.layout.KvLayout`): everything about it
    that changes a page's bytes, as
    `{kv_format}:{num_layers}x{num_kv_heads}x{head_dim}:{dtype}:p{page_size}{shards}`. A
    tensor-parallel namespace's host page holds `tp_size` rank shards one after another:
    as many heads as one unsharded page, in another order, so the shard count is part of
    it (written only past 1 rank, so unsharded keys stay as they were)."""
    shards = "" if tp_size <= 1 else f":tp{tp_size}"
    return (f"{layout.kv_format}:{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}:"
            f"{layout.dtype}:p{layout.page_size}{shards}")


def page_keys(
    salt: bytes,
    tokens: bytes,
    page_size: int,
    extra_key: bytes = b"",
    start: bytes | None = None,
) -> list[bytes]:
    """One 32-byte key per whole page of `tokens`; a trailing partial page gets none.

    `tokens` is packed little-endian int32 (bytes, bytearray or memoryview). `start` is
    the key of the page just before `tokens[0]` (a parent node's last key): the result
    then equals the tail of `page_keys` over the whole prompt, with the same `salt` and
    `extra_key`. Pure; raises ValueError for a length that is not whole int32s, a
    page_size below 1, or a `start` that is not a 32-byte key.
    """
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    view = memoryview(tokens).cast("B")
    if len(view) % _INT32:
        raise ValueError(
            f"tokens must be packed int32: {len(view)} bytes is not a multiple of {_INT32}")
    if start is not None and (not isinstance(start, bytes) or len(start) != KEY_BYTES):
        raise ValueError(f"start must be a {KEY_BYTES}-byte key or None, got {start!r:.80}")
    base = _hash(_PAGE_TAG + _field(bytes(salt)) + _field(bytes(extra_key)))
    stride = page_size * _INT32
    prev = ROOT if start is None else start
    keys = []
    for offset in range(0, len(view) - stride + 1, stride):
        h = base.copy()
        h.update(prev)
        h.update(view[offset:offset + stride])
        prev = h.digest()
        keys.append(prev)
    return keys
