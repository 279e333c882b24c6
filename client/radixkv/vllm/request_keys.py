"""What identifies a vLLM request's KV besides its token ids, keyed the way radixkv keys it.

vLLM's own prefix cache hashes each block with "extra keys" beside its tokens: the LoRA
adapter (name and path), the request's `cache_salt`, the multimodal inputs placed in the
block, and its prompt embeddings. KV computed under one of them must never be served to a
request under another (another adapter computes other K and V; a salt isolates tenants;
two images behind the same placeholder tokens are different prompts). radixkv keys the
same things:

- the LoRA adapter (its name, path and a digest of its files' content, so an adapter
  retrained and copied over the same path is another key: `fingerprints`) and the cache
  salt make the request's `extra_key`: the daemon keeps a
  separate tree and separate storage keys per extra key, so nothing is shared across them.
  The key is in vLLM's form (`radixkv.routing.extra_keys`), so the daemon's KV events hash
  and name these blocks exactly as vLLM's own events do; after a `reset_cache` the epoch
  joins the key, which then is an opaque hash (vLLM's hashes know no epochs);
- a multimodal input's placeholder tokens are replaced, in the tokens radixkv sees, by
  ids drawn from the input's identifier (vLLM's content hash of it): the prefix before
  the first input is shared as before, the same input at the same place matches, another
  input diverges where it starts;
- a request with prompt embeddings is not cached by radixkv at all (`cacheable`): its
  token ids do not say what its KV was computed from, and hashing the embeddings on the
  scheduler's thread costs more than the lookup it would allow.

Pure functions of the request; the scheduler side computes a request's key once per prompt
(again when a streaming-input session grows by a chunk).
"""

import hashlib
import logging

from radixkv.routing.extra_keys import vllm_extra_key
from radixkv.types import Prompt

from .fingerprints import adapter_fingerprint

log = logging.getLogger("vllm.radixkv")

_INT32 = 4


def cacheable(request) -> bool:
    """Whether radixkv may look `request` up and save its blocks (not with prompt embeddings)."""
    return getattr(request, "prompt_embeds", None) is None


def extra_key(request, epoch: bytes = b"") -> bytes:
    """The request's LoRA adapter (with its files' digest, `adapter_digest`) and cache
    salt, and the engine's cache `epoch` (new after each `reset_cache`: the weights may
    have changed), as one extra key (`key_of`)."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return key_of(cache_salt=getattr(request, "cache_salt", None), epoch=epoch)
    return key_of(lora_name=lora.lora_name, lora_path=lora.lora_path, lora_digest=adapter_digest(lora.lora_path),
                  cache_salt=getattr(request, "cache_salt", None), epoch=epoch)


_unresolved: set[str] = set()


def adapter_digest(path: str | None) -> str | None:
    """`fingerprints.adapter_fingerprint` of the adapter at `path`; None (the path alone
    keys it, said once per path) where no local files are found."""
    digest = adapter_fingerprint(path)
    if digest is None and path not in _unresolved:
        _unresolved.add(path)
        log.warning("radixkv: no local files for LoRA adapter %s: its KV is keyed by its path alone, so "
                    "new weights there would be served the old weights' KV", path)
    return digest


MAX_VLLM_FORM_BYTES = 1024  # a longer key is sent hashed: the daemon refuses past 4 KiB by default


def key_of(*, lora_name: str | None = None, lora_path: str | None = None, cache_salt: str | None = None,
           epoch: bytes = b"", lora_digest: str | None = None) -> bytes:
    """The extra key of a request under LoRA adapter `lora_name` (at `lora_path`, whose
    files' digest is `lora_digest`) and `cache_salt` (b"" with none of them):
    `vllm_extra_key` of them, or after a reset
    (`epoch`), or when that form passes MAX_VLLM_FORM_BYTES (an end user's salt has no
    bound), 16 bytes of a hash over the tagged, length-prefixed fields: such requests stay
    cached and apart, their events just lack vLLM's form of the keys. Routers pass it to
    `RoutingIndex.score(extra_key=...)` to score such a request against what the
    connector saved (no vLLM import needed; the digest stays out of block hashes, so a
    router may leave it out)."""
    if not epoch:
        key = vllm_extra_key(lora_name, lora_path, cache_salt, lora_digest)
        if len(key) <= MAX_VLLM_FORM_BYTES:
            return key
    fields = [b"epoch", epoch]
    if lora_name:
        fields += [b"lora", str(lora_name).encode(), str(lora_path or "").encode()]
        if lora_digest:
            fields += [b"lora_digest", lora_digest.encode()]
    if cache_salt:
        fields += [b"cache_salt", str(cache_salt).encode()]
    h = hashlib.blake2b(digest_size=16, person=b"radixkv-vllm-key")
    for f in fields:
        h.update(len(f).to_bytes(4, "little") + f)
    return h.digest()


def with_inputs(packed: bytes, request) -> bytes:
    """`packed` (the request's first tokens, little-endian int32) with every multimodal
    input's placeholder range, where it lies within them, replaced by ids derived from the
    input's identifier (the same identifier gives the same ids)."""
    features = getattr(request, "mm_features", None)
    if not features:
        return packed
    n = len(packed) // _INT32
    out = None
    for feature in features:
        start, length = feature.mm_position.offset, feature.mm_position.length
        end = min(start + length, n)
        if start >= end:
            continue
        if out is None:
            out = bytearray(packed)
        ids = hashlib.shake_128(b"radixkv-mm\0" + str(feature.identifier).encode()).digest(length * _INT32)
        out[start * _INT32:end * _INT32] = ids[:(end - start) * _INT32]
    return packed if out is None else bytes(out)


def prompt_key(packed: bytes, request, epoch: bytes = b"") -> Prompt:
    """The radixkv prompt of `request`'s tokens `packed`: multimodal inputs applied, with
    its extra key (under the engine's cache `epoch`)."""
    return Prompt(with_inputs(packed, request), extra_key(request, epoch))


__all__ = ["cacheable", "extra_key", "key_of", "prompt_key", "with_inputs"]
