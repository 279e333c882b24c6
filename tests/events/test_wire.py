"""Batches radixkv publishes decode with vLLM 0.32's own classes, encode byte for byte as
vLLM's do, and read the same with a schema-free msgpack decoder."""

import msgspec
import pytest
from vllm.distributed import kv_events as vllm_ev

from radixkv.routing import wire
from radixkv.routing.extra_keys import vllm_extra_key
from radixkv_server.core.tree import RadixTree
from radixkv_server.events.builder import CLEAR_RECORD, REMOVED, STORED, EventBuilder

from .helpers import PAGE, chain, path_of


def built_batch() -> wire.KVEventBatch:
    tree = RadixTree(PAGE)
    a, b = chain(tree, range(8), range(100, 104))
    lora = chain(tree, range(4), extra_key=b"lora-3")[0]
    tuned = chain(tree, range(8), extra_key=vllm_extra_key("tiny-adapter", "/a", "tenant-a"))[0]
    rec = lambda kind, medium, n: (kind, medium, n.extra_key, path_of(n))
    events, keys = EventBuilder(PAGE).build([
        rec(STORED, "GPU", a), rec(STORED, "CPU", b), rec(STORED, "STORAGE", lora),
        rec(REMOVED, "GPU", a), CLEAR_RECORD, rec(STORED, "CPU", tuned)])
    assert keys == [b"", b"", b"lora-3", b"", b"", tuned.extra_key]
    return wire.KVEventBatch(ts=1234.5, events=events, data_parallel_rank=0)


def to_vllm(event):
    cls = getattr(vllm_ev, type(event).__name__)
    return cls(**{f: getattr(event, f) for f in event.__struct_fields__})


def test_vllm_classes_decode_our_batches():
    payload = wire.encode_batch(built_batch())
    got = msgspec.msgpack.Decoder(vllm_ev.KVEventBatch).decode(payload)
    assert got.ts == 1234.5 and got.data_parallel_rank == 0
    kinds = [type(e).__name__ for e in got.events]
    assert kinds == ["BlockStored", "BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared",
                     "BlockStored"]
    first, second, lora = got.events[:3]
    assert isinstance(first, vllm_ev.BlockStored)
    assert first.medium == "GPU" and first.block_size == PAGE and first.parent_block_hash is None
    assert first.token_ids == list(range(8)) and len(first.block_hashes) == 2
    assert second.medium == "CPU" and second.parent_block_hash == first.block_hashes[-1]
    assert lora.medium == "STORAGE" and lora.extra_keys == [(b"lora-3",)]
    assert got.events[3].block_hashes == first.block_hashes and got.events[3].medium == "GPU"
    tuned = got.events[5]  # as vLLM publishes a LoRA request's blocks with a cache salt
    assert tuned.lora_name == "tiny-adapter" and tuned.extra_keys == [("tiny-adapter", "tenant-a"), ("tiny-adapter",)]


def test_encoding_is_byte_identical_to_vllm():
    ours = built_batch()
    theirs = vllm_ev.KVEventBatch(ts=ours.ts, events=[to_vllm(e) for e in ours.events],
                                  data_parallel_rank=0)
    assert wire.encode_batch(ours) == msgspec.msgpack.encode(theirs)
    # and the other way round: we decode what vLLM encodes
    assert wire.decode_batch(msgspec.msgpack.encode(theirs)) == ours


def test_schema_free_decoder_sees_vllm_layout():
    raw = msgspec.msgpack.decode(wire.encode_batch(built_batch()))
    ts, events, rank = raw  # the batch is a positional array
    assert (ts, rank) == (1234.5, 0)
    stored = events[0]
    assert list(stored)[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids",
                                "block_size", "lora_id", "medium", "lora_name"]
    assert stored["type"] == "BlockStored" and stored["medium"] == "GPU"
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored["block_hashes"])
    assert events[3] == {"type": "BlockRemoved", "block_hashes": stored["block_hashes"],
                         "medium": "GPU", "group_idx": 0}
    assert events[4] == {"type": "AllBlocksCleared"}


def test_vllm_encoded_bytes_hashes_decode_too():
    theirs = vllm_ev.KVEventBatch(ts=1.0, events=[vllm_ev.BlockRemoved(block_hashes=[b"\x01" * 32],
                                                                      medium=None)])
    got = wire.decode_batch(msgspec.msgpack.encode(theirs))
    assert got.events[0].block_hashes == [b"\x01" * 32] and got.events[0].medium is None


def test_bad_payload_raises_a_decode_error():
    with pytest.raises(msgspec.DecodeError):
        wire.decode_batch(b"\x93\xcb")
    assert wire.seq_of(wire.END_SEQ) == -1 and wire.seq_of(wire.seq_bytes(2**40)) == 2**40


def test_events_of_a_type_not_known_here_are_skipped_the_rest_kept(caplog):
    """A newer vLLM adding an event type: the batch's other events still apply (the whole
    batch once failed, and a router reset that worker at every batch); a bad event of a
    known type still fails the batch."""
    stored, removed = built_batch().events[0], built_batch().events[3]
    raw = msgspec.msgpack.decode(wire.encode_batch(wire.KVEventBatch(ts=2.0, events=[stored, removed])))
    raw[1].insert(1, {"type": "BlockReused", "block_hashes": [1, 2]})
    got = wire.decode_batch(msgspec.msgpack.encode(raw))
    assert (got.ts, got.events) == (2.0, [stored, removed])
    assert "'BlockReused' are not known here" in caplog.text
    raw[1][1] = {"type": "BlockRemoved", "block_hashes": "not a list"}
    with pytest.raises(msgspec.ValidationError):
        wire.decode_batch(msgspec.msgpack.encode(raw))
