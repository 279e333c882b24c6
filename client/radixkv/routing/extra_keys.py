"""Extra keys: what sets a prompt's KV apart besides its token ids, in block hashes and events.

radixkv's `extra_key` is opaque bytes to the daemon: a separate tree and separate storage
keys per value. In block hashes (the daemon's KV events, `RoutingIndex` scores) it has two
forms:

- **vLLM's form** (`vllm_extra_key`): a LoRA adapter (name and path) and a cache salt. Its
  blocks hash exactly as vLLM 0.32 hashes them: vLLM puts `("lora", name, path)` in the
  extra keys of every block of a LoRA request and `("cache_salt", salt)` in the prompt's
  first block only, and publishes them untagged (`lora_name`, and per block `(name,)`,
  `(name, salt)` or `(salt,)`). So a router merges a vLLM engine's own GPU events with its
  radixkv daemon's CPU/STORAGE events of LoRA and salted requests by hash, as it does for
  plain ones. The bytes are `MAGIC` followed by the three fields, each a presence byte and,
  when present, a 4-byte little-endian length and its UTF-8 text; a LoRA key may add a
  fourth, the adapter's content digest (`lora_digest`), which sets apart KV of other
  weights at the same path but, as vLLM hashes no content, stays out of block hashes.
- **Opaque** (any other non-empty key, e.g. an SGLang-style engine's own): the one-element
  array `[extra_key]` (a byte string) in every block, `(extra_key,)` in every event entry.

Pure functions; `parse` remembers recent keys (a prompt's key is parsed once per event).
"""

import functools
from dataclasses import dataclass

MAGIC = b"\x00vllm-keys\x00"
NULL = b"\xf6"  # CBOR null: the extra slot of a block with no extra keys
_FIELDS = 3
_LEN = 4


def cbor_head(major: int, n: int) -> bytes:
    """CBOR initial byte(s) of an item of `major` type with argument `n` (shortest form)."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | extra]) + n.to_bytes(width, "big")
    raise ValueError(f"CBOR argument too large: {n}")


def cbor_text(text: str) -> bytes:
    data = text.encode()
    return cbor_head(3, len(data)) + data


def cbor_bytes(data: bytes) -> bytes:
    return cbor_head(2, len(data)) + data


@dataclass(frozen=True)
class VllmKeys:
    """A request's extra keys as vLLM 0.32 hashes them (`generate_block_hash_extra_keys`,
    multimodal inputs and prompt embeddings aside)."""

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    lora_digest: str | None = None  # not hashed: vLLM's hashes name the adapter by path

    def tagged(self, first: bool) -> tuple | None:
        """vLLM's extra keys of a block (`first`: the prompt's first block), or None."""
        keys: list[tuple] = []
        if self.lora_name:
            keys.append(("lora", self.lora_name, self.lora_path))
        if first and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None

    def untagged(self, first: bool) -> tuple | None:
        """The same as vLLM's events publish it (`to_event_extra_keys`)."""
        keys = self.tagged(first)
        return None if keys is None else tuple(k[1] for k in keys)

    def cbor(self, first: bool) -> bytes:
        """Canonical CBOR of `tagged(first)`: the extra slot of the block's hash input."""
        keys = self.tagged(first)
        if keys is None:
            return NULL
        out = [cbor_head(4, len(keys))]
        for key in keys:
            out.append(cbor_head(4, len(key)))
            out.extend(NULL if v is None else cbor_text(v) for v in key)
        return b"".join(out)


def vllm_extra_key(lora_name: str | None = None, lora_path: str | None = None,
                   cache_salt: str | None = None, lora_digest: str | None = None) -> bytes:
    """The extra key of a request under LoRA adapter `lora_name` (at `lora_path`, its
    files' digest `lora_digest` when known) and `cache_salt`, in vLLM's form; b"" with
    neither (a plain prompt)."""
    if not lora_name:
        lora_path = lora_digest = None
    fields = (lora_name or None, lora_path, cache_salt or None)
    if fields == (None, None, None):
        return b""
    if lora_digest:
        fields += (lora_digest,)
    out = [MAGIC]
    for f in fields:
        if f is None:
            out.append(b"\x00")
        else:
            data = str(f).encode()
            out.append(b"\x01" + len(data).to_bytes(_LEN, "little") + data)
    return b"".join(out)


@functools.lru_cache(maxsize=4096)
def parse(extra_key: bytes) -> VllmKeys | None:
    """The fields of a key made by `vllm_extra_key`; None for any other key (opaque)."""
    if not extra_key.startswith(MAGIC):
        return None
    fields: list[str | None] = []
    i = len(MAGIC)
    try:
        while len(fields) < _FIELDS or (len(fields) == _FIELDS and i < len(extra_key) and fields[0]):
            flag = extra_key[i]
            i += 1
            if flag == 0:
                fields.append(None)
                continue
            if flag != 1:
                return None
            n = int.from_bytes(extra_key[i:i + _LEN], "little")
            i += _LEN
            if i + n > len(extra_key):
                return None
            fields.append(extra_key[i:i + n].decode())
            i += n
    except (IndexError, UnicodeDecodeError):
        return None
    if i != len(extra_key) or (fields[0] is None and fields[1] is not None) or fields[_FIELDS:] == [None]:
        return None
    return VllmKeys(*fields)


def block_tails(extra_key: bytes) -> tuple[bytes, bytes]:
    """The CBOR extra slot of (the prompt's first block, any later block) under `extra_key`."""
    if not extra_key:
        return NULL, NULL
    keys = parse(bytes(extra_key))
    if keys is None:
        tail = b"\x81" + cbor_bytes(bytes(extra_key))
        return tail, tail
    return keys.cbor(True), keys.cbor(False)


def lora_name(extra_key: bytes) -> str | None:
    """The LoRA adapter a vLLM-form key names (what events carry as `lora_name`)."""
    keys = parse(bytes(extra_key)) if extra_key else None
    return keys.lora_name if keys is not None else None


def event_extra_keys(extra_key: bytes, num_blocks: int, starts_prompt: bool) -> list | None:
    """`BlockStored.extra_keys` of `num_blocks` blocks under `extra_key` (`starts_prompt`:
    the first of them is the prompt's first block); None for a plain prompt."""
    if not extra_key or num_blocks == 0:
        return None
    keys = parse(bytes(extra_key))
    if keys is None:
        return [(bytes(extra_key),)] * num_blocks
    out = [keys.untagged(False)] * num_blocks
    if starts_prompt:
        out[0] = keys.untagged(True)
    return out


__all__ = ["MAGIC", "VllmKeys", "block_tails", "event_extra_keys", "lora_name", "parse", "vllm_extra_key"]
