"""vLLM's three KV layouts described as pages (radixkv.vllm.layouts), on CPU tensors.

For each layout the described byte ranges of block i are exactly the bytes a pattern
written into block i through vLLM's view lands in (nothing more, nothing less); the
FlashAttention layout (K and V halves) also round-trips through a real daemon from
shared memory, through the connector's registration code.
"""

from types import SimpleNamespace

import pytest
import torch

from radixkv.vllm.config import ConnectorConfig
from radixkv.vllm.registration import register_worker
from radixkv.vllm.daemon import DaemonAdapter
from radixkv.vllm.kvmemory import ShmAllocation, layout_from_spec
from radixkv.vllm.layouts import block_dim, describe_views
from tests.vllm.scheduler_session import SchedulerSession

BLOCKS, LAYERS, HEADS, TOKENS, HEAD = 6, 3, 2, 16, 8


def cpu_attention(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).view(BLOCKS, HEADS, TOKENS, 2 * HEAD)


def flash_attention(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).view(2, BLOCKS, TOKENS, HEADS, HEAD)


def flash_infer(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).view(BLOCKS, 2, TOKENS, HEADS, HEAD)


def block(view: torch.Tensor, kind, i: int) -> list[torch.Tensor]:
    """vLLM's block i of one layer: what its attention kernels read and write."""
    return [view[0, i], view[1, i]] if kind is flash_attention else [view[i]]


LAYER_BYTES = BLOCKS * HEADS * TOKENS * 2 * HEAD * 2
KINDS = [cpu_attention, flash_attention, flash_infer]


def views_of(raw: torch.Tensor, kind, gap: int = 64) -> dict[str, torch.Tensor]:
    """Per-layer views of `raw`, `gap` bytes apart (layers need not be back to back)."""
    step = LAYER_BYTES + gap
    return {f"model.layers.{i}.self_attn.attn": kind(raw[i * step:i * step + LAYER_BYTES]) for i in range(LAYERS)}


def described_bytes(raw: torch.Tensor, memory, layer: int, i: int) -> torch.Tensor:
    """Bytes of block i of `layer` as the description says the daemon finds them."""
    per = memory.regions
    out = []
    for handle, offset, size, *geometry in memory.buffers[layer * per:(layer + 1) * per]:
        stride, page = geometry or (memory.block_stride, memory.page_bytes)
        assert i * stride + page <= size  # inside the buffer Register names
        out.append(raw[offset + i * stride:offset + i * stride + page])
    return torch.cat(out)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_the_described_pages_are_exactly_the_bytes_of_each_block(kind):
    raw = torch.zeros(LAYERS * (LAYER_BYTES + 64), dtype=torch.int8)
    views = views_of(raw, kind)
    memory = describe_views(views, TOKENS, lambda name, t: (b"seg", t.data_ptr() - raw.data_ptr()))
    assert memory.num_blocks == BLOCKS and memory.layout.num_layers == LAYERS
    assert memory.layout.page_bytes == LAYERS * memory.page_bytes == LAYERS * LAYER_BYTES // BLOCKS
    assert len(memory.buffers) == LAYERS * memory.regions
    for layer, view in enumerate(views.values()):
        for i in range(BLOCKS):
            raw.zero_()
            for part in block(view, kind, i):
                part.copy_(torch.randn(part.shape).to(part.dtype))
            pattern = raw.clone()
            got = described_bytes(raw, memory, layer, i)
            assert got.numel() == memory.page_bytes
            # the described ranges hold every byte written into block i ...
            assert int(got.count_nonzero()) == int(pattern.count_nonzero())
            # ... and clearing them clears the block, and nothing else was in them
            for handle, offset, size, *geometry in memory.buffers[layer * memory.regions:(layer + 1) * memory.regions]:
                stride, page = geometry or (memory.block_stride, memory.page_bytes)
                raw[offset + i * stride:offset + i * stride + page] = 0
            assert int(raw.count_nonzero()) == 0


def test_flash_attention_is_two_regions_of_half_blocks_and_the_others_one():
    raw = torch.zeros(LAYERS * (LAYER_BYTES + 64), dtype=torch.int8)
    where = lambda name, t: (b"seg", t.data_ptr() - raw.data_ptr())  # noqa: E731
    fa = describe_views(views_of(raw, flash_attention), TOKENS, where)
    half = LAYER_BYTES // BLOCKS // 2
    assert fa.regions == 2 and [b[3:] for b in fa.buffers[:2]] == [(half, half)] * 2
    assert fa.buffers[1][1] - fa.buffers[0][1] == LAYER_BYTES // 2  # V half after the K half
    for kind in (cpu_attention, flash_infer):
        m = describe_views(views_of(raw, kind), TOKENS, where)
        assert m.regions == 1 and all(len(b) == 3 for b in m.buffers)  # plain: CPU registers as before
    layouts = {describe_views(views_of(raw, k), TOKENS, where).layout for k in KINDS}
    assert len(layouts) == 1  # one namespace layout whatever the backend: what the scheduler derives


def test_the_scheduler_layout_matches_every_backend():
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    raw = torch.zeros(LAYERS * (LAYER_BYTES + 64), dtype=torch.int8)
    views = views_of(raw, flash_attention)
    spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=list(views), kv_cache_spec=spec)])
    memory = describe_views(views, TOKENS, lambda name, t: (b"seg", t.data_ptr() - raw.data_ptr()))
    assert layout_from_spec(config) == memory.layout


def test_the_block_dimension_is_found_and_ambiguous_shapes_refused():
    assert block_dim((BLOCKS, HEADS, TOKENS, 2 * HEAD)) == 0
    assert block_dim((2, BLOCKS, TOKENS, HEADS, HEAD)) == 1
    assert block_dim((BLOCKS, 2, TOKENS, HEADS, HEAD)) == 0
    with pytest.raises(ValueError, match="reads as FlashInfer and as FlashAttention"):
        block_dim((2, 2, TOKENS, HEADS, HEAD))
    assert block_dim((2, BLOCKS, TOKENS, HEADS, HEAD), num_blocks=BLOCKS) == 1
    with pytest.raises(ValueError, match="neither"):
        block_dim((2, BLOCKS, TOKENS, HEADS, HEAD), num_blocks=BLOCKS + 1)
    with pytest.raises(ValueError, match="neither"):
        block_dim((3, 4, TOKENS, HEADS, HEAD))
    raw = torch.zeros(LAYER_BYTES, dtype=torch.int8)
    permuted = {"l": flash_attention(raw).transpose(1, 2)}  # blocks no longer dense runs
    with pytest.raises(ValueError):
        describe_views(permuted, TOKENS, lambda name, t: (b"seg", 0))


def test_flash_attention_pages_round_trip_through_a_daemon(daemon):
    """K and V halves registered through the connector's code (shared memory here; the
    same description goes by IPC handle on CUDA: tests/gpu/test_vllm_cuda.py)."""
    alloc = ShmAllocation()
    with alloc:
        raw = torch.zeros(LAYERS * (LAYER_BYTES + 64), dtype=torch.int8)
    views = views_of(raw, flash_attention)
    config = ConnectorConfig(target=daemon.target, namespace="fa")
    adapter = DaemonAdapter(config, engine="test")
    try:
        register_worker(adapter, views, TOKENS, alloc)
        scheduler = SchedulerSession(config, describe_views(views, TOKENS, lambda n, t: (b"", 0)).layout)
        try:
            for layer, v in enumerate(views.values()):
                for i in (1, 2):
                    v[0, i].fill_(10 * i + layer)   # K
                    v[1, i].fill_(-10 * i - layer)  # V
            tokens = torch.arange(5, 5 + 2 * TOKENS, dtype=torch.int32).numpy().tobytes()
            transfer = adapter.save(tokens, [1, 2])
            assert transfer and adapter.done([transfer], timeout=None) == {transfer}
            [hit] = scheduler.lookup([tokens])
            assert hit.tokens == 2 * TOKENS
            assert adapter.load(hit.node, [4, 5], 0, hit.lease) == 2
            scheduler.release([hit.lease])
            for layer, v in enumerate(views.values()):
                for src, dst in ((1, 4), (2, 5)):
                    assert torch.equal(v[0, dst], v[0, src]) and torch.equal(v[1, dst], v[1, src])
                assert torch.equal(v[0, 0], torch.zeros_like(v[0, 0]))  # untouched
        finally:
            scheduler.close()
    finally:
        adapter.close()
        alloc.segment.unlink()


def test_engines_on_different_devices_never_share_storage_keys():
    """CPU attention and the GPU backends lay a block's bytes out in other orders, and
    the described layouts cannot tell them apart (both whole opaque pages of one size):
    the model identity the connector registers names the device and vLLM's KV layout, so
    a fleet mixing CPU and GPU engines (or GPUs whose FlashInfer picks NHD and HND) on one
    store keeps their pages apart (before: the same keys, and one loaded the other's
    bytes in the wrong order)."""
    from radixkv.vllm.config import on_device
    from radixkv_server.core.page_keys import namespace_salt
    from radixkv_server.core.page_keys import layout_fingerprint

    cpu, gpu = (describe_views({"layer.0": view(torch.zeros(LAYER_BYTES, dtype=torch.uint8))},
                               TOKENS, lambda name, v: (b"h", 0), num_blocks=BLOCKS).layout
                for view in (cpu_attention, flash_attention))
    assert layout_fingerprint(cpu) == layout_fingerprint(gpu)  # what the daemon sees of the bytes
    identities = [on_device("/models/llama", device, layout)
                  for device, layout in (("cpu", None), ("cuda", "NHD"), ("cuda", "HND"))]
    assert len({namespace_salt(identity, layout_fingerprint(cpu)) for identity in identities}) == 3


def test_overrides_and_a_kv_cache_in_another_dtype_are_part_of_the_model_identity():
    """hf_overrides change the model's config (RoPE scaling, layers) and so its KV, and an
    fp8 KV cache computed in bfloat16 or float16 stores other values under one layout:
    neither changed the identity that salts storage keys (the data-integrity review)."""
    from types import SimpleNamespace

    import torch

    from radixkv.vllm.config import model_identity

    def model(hf_overrides=None, dtype=torch.bfloat16):
        return SimpleNamespace(model="/models/llama", revision=None, quantization=None, hf_overrides=hf_overrides,
                               dtype=dtype)

    plain = model_identity(model())
    assert plain == "/models/llama"  # unchanged for the usual engine: its stored pages stay warm
    assert model_identity(model(), SimpleNamespace(cache_dtype="auto")) == plain
    rope = model_identity(model(hf_overrides={"rope_scaling": {"type": "yarn", "factor": 4.0}}))
    other_rope = model_identity(model(hf_overrides={"rope_scaling": {"type": "yarn", "factor": 2.0}}))
    assert len({plain, rope, other_rope}) == 3
    fp8 = SimpleNamespace(cache_dtype="fp8")
    assert model_identity(model(), fp8) == "/models/llama kv_cache_dtype=fp8 dtype=bfloat16"
    assert model_identity(model(dtype=torch.float16), fp8) == "/models/llama kv_cache_dtype=fp8 dtype=float16"
