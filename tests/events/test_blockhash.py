"""The block hash a router recomputes equals vLLM's own sha256_cbor chain."""

import random

import pytest

from radixkv.routing.blockhash import DEFAULT_SEED, block_digests, block_hashes, external_hash, root_digest

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
                  for _ in range(rng.randrange(0, 120))]
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


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [2**32, 1, 2, 3]])
def test_rejects_token_ids_cbor_cannot_carry_as_vllm_does(bad):
    with pytest.raises(ValueError):
        block_digests(bad, 4)
