"""Which layout the cuda backend copies a registration's buffers with (pure: no GPU).

vLLM's FlashAttention keeps K and V of a block in two halves; the connector describes a
layer as two buffers of half pages under the namespace's "mla" layout, and the cuda
backend copies them as that layout's "mha" twin, whose host pages hold the same bytes."""

import pytest

from radixkv.layout import KvLayout
from radixkv_server.datapath.device import DeviceOpenError
from radixkv_server.datapath.open import cuda_layout

MLA = KvLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float16", page_size=16, kv_format="mla")


def test_the_layouts_own_buffers_are_copied_with_it():
    assert cuda_layout(MLA, 3, MLA.chunk_bytes, [MLA.chunk_bytes] * 3) is MLA


def test_two_half_pages_per_layer_are_the_mha_twin_with_the_same_host_page():
    half = MLA.chunk_bytes // 2
    twin = cuda_layout(MLA, 6, half, [half] * 6)
    assert twin.kv_format == "mha" and twin.num_buffers == 6 and twin.chunk_bytes == half
    assert twin.page_bytes == MLA.page_bytes and twin.num_layers == MLA.num_layers


def test_strided_or_odd_pages_are_refused_on_cuda():
    half = MLA.chunk_bytes // 2
    with pytest.raises(DeviceOpenError, match="contiguous pages only"):
        cuda_layout(MLA, 3, MLA.chunk_bytes, [2 * MLA.chunk_bytes] * 3)
    with pytest.raises(DeviceOpenError, match="do not fit"):
        cuda_layout(MLA, 12, half // 2, [half // 2] * 12)
