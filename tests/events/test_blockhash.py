"""The block hash a router recomputes equals vLLM's own sha256_cbor chain."""

import random

import pytest

from radixkv.routing.blockhash import (
    DEFAULT_SEED, SMALL_RUN, block_digests, block_hashes, external_hash, root_digest,
)

from .helpers import packed



def vllm_chain(tokens, block_size, extra=None):
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as u

    u.init_none_hash(sha256_cbor)
    parent, out = None, []
    for i in range(len(tokens) // block_size):
        parent = u.hash_block_tokens(sha256_cbor, parent, tokens[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out


def test_equals_vllm_sha256_cbor_including_its_int_conversion():
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    rng = random.Random(7)
    for _ in range(30):
        block_size = rng.choice([1, 4, 16, 17])
        tokens = [rng.choice([0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, rng.randrange(200_000)])
                  for _ in range(rng.randrange(0, 400))]  # both encodings: runs below and above SMALL_RUN
        theirs = vllm_chain(tokens, block_size)
        assert block_digests(tokens, block_size) == [bytes(d) for d in theirs]
        assert block_hashes(tokens, block_size) == [maybe_convert_block_hash(d) for d in theirs]


def test_extra_key_is_a_one_element_tuple_in_the_chain():
    tokens = list(range(100, 132))
    assert block_digests(tokens, 16, extra_key=b"lora-7") == [
        bytes(d) for d in vllm_chain(tokens, 16, (b"lora-7",))]
    assert block_hashes(tokens, 16, extra_key=b"lora-7") != block_hashes(tokens, 16)


def test_chain_continues_from_a_parent_and_ignores_a_partial_block():
    tokens = list(range(1000, 1050))  # 3 whole blocks of 16, 2 tokens left over
    whole = block_digests(tokens, 16)
    assert len(whole) == 3
    assert block_digests(tokens[16:], 16, parent=whole[0]) == whole[1:]
    assert block_digests(packed(tokens), 16) == whole
    assert root_digest(DEFAULT_SEED) != root_digest("another-seed")
    assert block_digests(tokens, 16, seed="another-seed") != whole
    assert external_hash(whole[0]) == int.from_bytes(whole[0][24:], "big")


@pytest.mark.parametrize("length", [4, SMALL_RUN + 4])  # each encoding
def test_rejects_token_ids_wider_than_32_bits(length):
    with pytest.raises(ValueError):
        block_digests(([2**32, 1, 2, 3] * length)[:length], 4)


@pytest.mark.parametrize("length", [8, 2 * SMALL_RUN])  # each encoding
def test_negative_token_ids_hash_as_vllm_does(length):
    """The daemon takes any int32 token id; a negative one (a placeholder some engines
    use) hashes as vLLM's sha256_cbor writes it (CBOR major type 1), at every width,
    instead of failing the whole batch of events it is in."""
    rng = random.Random(11)
    widths = [-1, -24, -25, -256, -257, -65536, -65537, -2**31, 0, 23, 70000]
    tokens = [rng.choice(widths) for _ in range(length)]
    assert block_digests(tokens, 4) == [bytes(d) for d in vllm_chain(tokens, 4)]


def test_a_long_run_hashes_as_its_short_pieces_chained():
    """Runs of SMALL_RUN tokens and more are encoded with numpy, shorter ones token by
    token: a long run's digests equal those of its short pieces chained with `parent`,
    at every CBOR width."""
    rng = random.Random(3)
    widths = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]
    tokens = [rng.choice(widths + [rng.randrange(2**32)]) for _ in range(4 * SMALL_RUN)]
    pieces, parent = [], None
    for i in range(0, len(tokens), 32):
        part = block_digests(tokens[i:i + 32], 16, parent=parent)
        pieces, parent = pieces + part, part[-1]
    assert pieces == block_digests(tokens, 16)


@pytest.mark.parametrize("lora, salt", [(None, "tenant-a"), (("adapter", "/loras/a"), None),
                                        (("adapter", "/loras/a"), "tenant-ü")])
def test_lora_and_salt_keys_hash_and_publish_as_vllm_does(lora, salt):
    """A vLLM request's own block hashes (vLLM's hasher on a real vLLM Request) and its
    events' untagged extra keys equal radixkv's for `vllm_extra_key` of its adapter and salt,
    also for a chain continued from a parent (the salt stays in the first block only)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as u
    from vllm.v1.request import Request

    from radixkv.routing.extra_keys import event_extra_keys, lora_name, vllm_extra_key

    tokens = list(range(300, 300 + 5 * 16))
    u.init_none_hash(sha256_cbor)
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                      lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None)
    theirs = [bytes(h) for h in u.get_request_block_hasher(16, sha256_cbor)(request)]
    their_keys = u.to_event_extra_keys(
        [u.generate_block_hash_extra_keys(request, i * 16, (i + 1) * 16, 0)[0] for i in range(5)])
    key = vllm_extra_key(*(lora or (None, None)), cache_salt=salt)
    ours = block_digests(tokens, 16, extra_key=key)
    assert ours == theirs
    assert block_digests(tokens[32:], 16, parent=ours[1], extra_key=key) == theirs[2:]
    assert event_extra_keys(key, 5, starts_prompt=True) == their_keys
    assert event_extra_keys(key, 3, starts_prompt=False) == their_keys[2:]
    assert lora_name(key) == (lora[0] if lora else None)
    assert ours != block_digests(tokens, 16) and ours != block_digests(tokens, 16, extra_key=key + b"x")


def test_a_key_that_only_looks_like_vllm_form_is_opaque():
    from radixkv.routing.extra_keys import MAGIC, parse, vllm_extra_key

    key = vllm_extra_key("adapter", "/a", "salt")
    assert vllm_extra_key() == b"" and parse(key).cache_salt == "salt"
    for bad in (MAGIC, key[:-1], key + b"\x00", MAGIC + b"\x02" + key[len(MAGIC) + 1:],
                MAGIC + b"\x00\x01\x01\x00\x00\x00a\x00"):  # a path without an adapter
        assert parse(bad) is None
        assert block_digests(list(range(16)), 16, extra_key=bad) == [bytes(d) for d in vllm_chain(
            list(range(16)), 16, (bad,))]


def test_an_adapters_content_digest_sets_its_key_apart_but_not_its_block_hashes():
    """The connector adds a LoRA adapter's content digest to its key (new weights at the
    same path are another tree), which vLLM's hashes know nothing of: a router scoring
    with the adapter's name and path alone finds the same blocks."""
    from radixkv.routing.extra_keys import parse, vllm_extra_key

    plain, v1, v2 = (vllm_extra_key("adapter", "/a", "salt", digest) for digest in (None, "d1", "d2"))
    assert len({plain, v1, v2}) == 3 and parse(v1).lora_digest == "d1"
    tokens = list(range(32))
    assert block_digests(tokens, 16, extra_key=v1) == block_digests(tokens, 16, extra_key=plain)
    assert vllm_extra_key(cache_salt="salt", lora_digest="d1") == vllm_extra_key(cache_salt="salt")
