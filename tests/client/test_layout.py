"""KvLayout: validation names the bad field; derived sizes match the documented layout."""

import dataclasses

import pytest

from radixkv import KvLayout
from radixkv.layout import DTYPE_SIZES


def test_mha_sizes():
    lay = KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    assert lay.itemsize == 2
    assert lay.buffers_per_layer == 2
    assert lay.num_buffers == 64
    assert lay.chunk_bytes == 16 * 8 * 128 * 2
    assert lay.page_bytes == 64 * lay.chunk_bytes
    assert lay.buffer_bytes(10) == 10 * lay.chunk_bytes
    assert lay.buffer_bytes(0) == 0


def test_mla_has_one_buffer_per_layer():
    lay = KvLayout(61, 1, 576, "float8_e4m3fn", 64, kv_format="mla")
    assert lay.buffers_per_layer == 1
    assert lay.num_buffers == 61
    assert lay.chunk_bytes == 64 * 576
    assert lay.page_bytes == 61 * 64 * 576


def test_buffer_order_is_layer_major():
    lay = KvLayout(3, 1, 1, "uint8", 1)
    assert [lay.buffer_index(layer, j) for layer in range(3) for j in range(2)] == list(range(6))
    with pytest.raises(ValueError, match="layer 3"):
        lay.buffer_index(3, 0)
    with pytest.raises(ValueError, match="mla|mha"):
        KvLayout(3, 1, 1, "uint8", 1, kv_format="mla").buffer_index(0, 1)


# Bytes per element as the dtypes define them, written down here, not read from the table.
KNOWN_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1, "uint8": 1}


def test_the_size_table_covers_the_known_dtypes():
    assert set(DTYPE_SIZES) == set(KNOWN_SIZES)


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_every_dtype_has_its_itemsize(dtype):
    torch = pytest.importorskip("torch")
    itemsize = KvLayout(1, 1, 1, dtype, 1).itemsize
    assert itemsize == torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    assert itemsize == KNOWN_SIZES[dtype]


def test_float32_page_bytes_as_computed_by_hand():
    # 4 layers of K and V, 2 heads of 64 floats, 16 tokens a page:
    # 8 buffers * 16 tokens * 2 heads * 64 dims * 4 bytes = 65536 bytes a host page.
    lay = KvLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16)
    assert lay.page_bytes == 65536
    assert lay.chunk_bytes == 8192


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_bad_sizes_name_the_field(field, bad):
    kwargs = dict(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16", page_size=4)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=field):
        KvLayout(**kwargs)


def test_bad_dtype_and_format_name_the_field():
    with pytest.raises(ValueError, match="dtype.*float64"):
        KvLayout(1, 1, 1, "float64", 1)
    with pytest.raises(ValueError, match="kv_format.*gqa"):
        KvLayout(1, 1, 1, "float16", 1, kv_format="gqa")


def test_frozen_and_hashable():
    lay = KvLayout(1, 1, 1, "float16", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.page_size = 2
    assert {lay: 1}[KvLayout(1, 1, 1, "float16", 1)] == 1
    with pytest.raises(ValueError):
        lay.buffer_bytes(-1)
