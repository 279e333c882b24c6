"""vLLM's KV-events wire format (vLLM 0.32, `vllm/distributed/kv_events.py`), as our own
msgspec structs that encode byte for byte as vLLM's do and decode vLLM's batches.

- A batch is a msgpack array `[ts, events, data_parallel_rank]` (`array_like=True`).
- Each event is a msgpack map whose first key is `"type"` (the class name: `BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`), then its fields in declaration order; fields left
  at their default are omitted (`omit_defaults=True`). vLLM switched events from arrays to
  maps in 0.2x (vllm-project/vllm#42892); this module reads and writes maps only.
- ZMQ framing (PUB): `(topic, seq, payload)`, `seq` an 8-byte big-endian unsigned int.
  Replay (ROUTER): a request `(b"", seq)` from a DEALER (not REQ, which takes one reply
  per request) answers `(b"", topic, seq, payload)` per buffered batch with seq >= the request,
  then `(b"", b"", END_SEQ, b"")`, END_SEQ being -1 as 8 signed big-endian bytes.
"""

import logging
from typing import Any

import msgspec

from radixkv.v1 import radixkv_pb2 as pb

from .extra_keys import event_extra_keys

log = logging.getLogger("radixkv.routing")

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockHash = int | bytes  # vLLM's ExternalBlockHash: a 64-bit int by default, else 32 bytes


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; `tag=True` writes the class name under "type"."""


class BlockStored(KVCacheEvent):
    """Blocks now resident on `medium`, chained: block i's parent is block i-1, block 0's
    is `parent_block_hash` (None: the prompt's first block). `token_ids` holds
    `block_size` ids per block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer resident on `medium` (None: on every medium vLLM knows)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything the publisher announced (for this topic) is gone."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _LooseBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch whose events are decoded one by one (see `decode_batch`)."""
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_loose_decoder = msgspec.msgpack.Decoder(_LooseBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)
KNOWN_EVENTS = frozenset(cls.__name__ for cls in (BlockStored, BlockRemoved, AllBlocksCleared))
_unknown_seen: set[str] = set()  # event types skipped and logged (once each)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload. Events of a type this module does not know (a newer vLLM's)
    are skipped, logged once per type: they once failed the whole batch, and a router
    then reset that worker at every batch. Raises msgspec.DecodeError (a ValueError) on
    a bad payload, or a bad event of a known type."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError:
        loose = _loose_decoder.decode(payload)
    events = []
    for raw in loose.events:
        kind = _event_type(raw)
        if kind in KNOWN_EVENTS:
            events.append(_event_decoder.decode(raw))
        elif kind not in _unknown_seen:
            _unknown_seen.add(kind)
            log.warning("KV events of type %r are not known here (a newer vLLM?): skipped", kind)
    return KVEventBatch(loose.ts, events, loose.data_parallel_rank)


def _event_type(raw: msgspec.Raw) -> str:
    event = msgspec.msgpack.decode(raw)
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise msgspec.DecodeError(f"a KV event is not a map with a 'type': {event!r:.80}")
    return event["type"]


def watch_event_fields(event: pb.KvEvent) -> tuple[str, dict[str, Any]]:
    """A WatchEvents `KvEvent` (gRPC) as the vLLM event it was made from: the class name
    ("BlockStored", "BlockRemoved" or "AllBlocksCleared") and its fields, for these
    classes or vLLM's own (the extra keys as the daemon publishes them on ZMQ)."""
    if event.kind == pb.KvEvent.ALL_BLOCKS_CLEARED:
        return "AllBlocksCleared", {}
    hashes = list(event.block_hashes)
    if event.kind == pb.KvEvent.BLOCK_REMOVED:
        return "BlockRemoved", {"block_hashes": hashes, "medium": event.medium or None, "group_idx": 0}
    parent = event.parent_block_hash if event.HasField("parent_block_hash") else None
    return "BlockStored", {
        "block_hashes": hashes, "parent_block_hash": parent, "token_ids": list(event.token_ids),
        "block_size": event.block_size, "lora_id": None, "medium": event.medium or None,
        "lora_name": event.lora_name or None,
        "extra_keys": event_extra_keys(event.extra_key, len(hashes), starts_prompt=parent is None),
        "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """Sequence number of an 8-byte frame; -1 for END_SEQ."""
    if len(frame) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(frame)}")
    if frame == END_SEQ:
        return -1
    return int.from_bytes(frame, "big")
