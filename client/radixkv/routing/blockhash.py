"""Block hashes of KV events: vLLM's `sha256_cbor` prefix hash chain, one block per page.

A router recomputes every hash from token ids alone, in any language, with SHA-256 and
canonical CBOR (RFC 8949 core deterministic encoding); no radixkv code is needed:

    seed   = "vllm-none-hash"                       (vLLM 0.32's default; PYTHONHASHSEED
                                                     replaces it where a vLLM fleet sets it)
    d_0    = SHA256(CBOR(seed))                     (vLLM's NONE_HASH)
    d_i    = SHA256(CBOR([d_{i-1}, [t_1, ..., t_B], extra]))
             d_{i-1}: 32-byte digest as a CBOR byte string; t_j: the B = block_size token
             ids of block i as CBOR integers; extra: CBOR null for a plain prompt;
             for a LoRA adapter or cache salt (`extra_keys.vllm_extra_key`) vLLM's
             tagged extra keys, [["lora", name, path], ["cache_salt", salt]] with the
             salt in the prompt's first block only; for any other radixkv `extra_key`
             x the one-element array [x] (x as a byte string)
    hash_i = the low 64 bits of d_i read big-endian = int.from_bytes(d_i[24:32], "big")

`hash_i` is what BlockStored/BlockRemoved carry (`block_hashes`, `parent_block_hash`), as
vLLM publishes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). The chain runs on the
full 32-byte digests, so a truncation collision never propagates down a prefix. For plain,
LoRA and salted prompts this equals vLLM's own hashes when vLLM runs with
`--prefix-caching-hash-algo sha256_cbor` and a block size equal to radixkv's page size, so
a router may mix a vLLM engine's GPU events and radixkv's CPU/STORAGE events of one worker.

Encoding is vectorised with numpy (hashing a 2k-token prompt costs ~1 us per block), and
token by token for runs too short to pay numpy's fixed cost.
"""

import hashlib

import numpy as np

from .extra_keys import block_tails, cbor_head, cbor_text

DEFAULT_SEED = "vllm-none-hash"
DIGEST_BYTES = 32
_U64 = (1 << 64) - 1


def root_digest(seed: str = DEFAULT_SEED) -> bytes:
    """d_0: the digest every chain starts from (vLLM's NONE_HASH for this seed)."""
    return hashlib.sha256(cbor_text(seed)).digest()


# Per token, by its width code c = (u >= 24) + (u >= 256) + (u >= 65536) of its CBOR
# argument u (t itself, or -1 - t for a negative id: major type 1, as cbor2 writes it,
# and so vLLM): the head byte (u itself when c == 0, plus 0x20 when negative), which of
# [head, b3, b2, b1, b0] to keep, the width.
_HEAD = np.array([0, 0x18, 0x19, 0x1A], dtype=np.uint8)
_KEEP = np.array([[1, 0, 0, 0, 0], [1, 0, 0, 0, 1], [1, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=bool)
_WIDTH = np.array([1, 2, 3, 5])
SMALL_RUN = 128  # tokens: measured crossover of the two encodings (64: 9 against 16 us; 256: 38 against 22)


def _cbor_tokens(tokens: np.ndarray, block_size: int) -> tuple[bytes, list[int]]:
    """CBOR encodings of int64 `tokens` (whole blocks of `block_size`), concatenated, and
    the end offset of each block's. Short runs are encoded token by token: numpy's fixed
    cost (about 15 us) is more than Python's per token below SMALL_RUN tokens (a node of
    a few pages, the common KV event)."""
    if len(tokens) < SMALL_RUN:
        return _cbor_tokens_small(tokens.tolist(), block_size)
    t = tokens
    if int(t.min()) < -(1 << 32) or int(t.max()) >= 1 << 32:
        raise ValueError("token ids must be in [-2**32, 2**32)")
    negative = t < 0
    u = np.where(negative, -1 - t, t)
    code = (u >= 24).astype(np.int8)
    code += u >= 256
    code += u >= 65536
    rows = np.empty((len(t), 5), dtype=np.uint8)
    rows[:, 1:] = u.astype(">u4").view(np.uint8).reshape(-1, 4)
    rows[:, 0] = np.where(code == 0, u, _HEAD[code]) | (negative.astype(np.uint8) << 5)
    return rows[_KEEP[code]].tobytes(), np.cumsum(_WIDTH[code])[block_size - 1::block_size].tolist()


def _cbor_tokens_small(tokens: list[int], block_size: int) -> tuple[bytes, list[int]]:
    out = bytearray()
    ends = []
    for i, t in enumerate(tokens, 1):
        major, u = (0x20, -1 - t) if t < 0 else (0, t)
        if u < 24:
            out.append(major | u)
        elif u < 256:
            out += bytes((major | 0x18, u))
        elif u < 65536:
            out += bytes((major | 0x19,)) + u.to_bytes(2, "big")
        elif u < 1 << 32:
            out += bytes((major | 0x1A,)) + u.to_bytes(4, "big")
        else:
            raise ValueError("token ids must be in [-2**32, 2**32)")
        if i % block_size == 0:
            ends.append(len(out))
    return bytes(out), ends


def as_token_array(tokens) -> np.ndarray:
    """Token ids as int64: from packed little-endian int32 bytes, a numpy array or a list."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        view = memoryview(tokens).cast("B")
        if len(view) % 4:
            raise ValueError(f"packed tokens must be whole int32s, got {len(view)} bytes")
        return np.frombuffer(view, dtype="<i4").astype(np.int64)
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def block_digests(tokens, block_size: int, *, parent: bytes | None = None,
                  extra_key: bytes = b"", seed: str = DEFAULT_SEED) -> list[bytes]:
    """d_i of every whole block of `tokens`; a trailing partial block gets none.

    `parent` is the digest of the block just before `tokens[0]` (None: `tokens` starts a
    prompt, whose first block carries a cache salt). Pure; raises ValueError for a
    block_size below 1, a negative token id or a parent that is not a 32-byte digest.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if parent is not None and len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent must be a {DIGEST_BYTES}-byte digest or None")
    t = as_token_array(tokens)
    n = len(t) // block_size
    if n == 0:
        return []
    encoded, ends = _cbor_tokens(t[:n * block_size], block_size)
    base = hashlib.sha256(b"\x83\x58\x20")  # [parent, tokens, extra]; parent: 32 bytes
    tokens_head = cbor_head(4, block_size)
    first_tail, tail = block_tails(extra_key)
    if parent is None:
        prev, tails = root_digest(seed), [first_tail] + [tail] * (n - 1)
    else:
        prev, tails = parent, [tail] * n
    out = []
    lo = 0
    for hi, tail in zip(ends, tails):
        h = base.copy()
        h.update(prev)
        h.update(tokens_head)
        h.update(encoded[lo:hi])
        h.update(tail)
        prev = h.digest()
        out.append(prev)
        lo = hi
    return out


def external_hash(digest: bytes) -> int:
    """hash_i: the 64-bit integer KV events carry for a block digest."""
    return int.from_bytes(digest, "big") & _U64


def block_hashes(tokens, block_size: int, *, parent: bytes | None = None,
                 extra_key: bytes = b"", seed: str = DEFAULT_SEED) -> list[int]:
    """The 64-bit hashes of every whole block of `tokens` (see `block_digests`)."""
    return [external_hash(d) for d in block_digests(
        tokens, block_size, parent=parent, extra_key=extra_key, seed=seed)]
