"""vLLM's per-layer KV views described as whole opaque pages, for CPU and CUDA alike.

A page is one vLLM block of one layer. The daemon copies it as opaque bytes, so it needs,
per buffer, where block 0 starts (a byte offset into some memory), the bytes from one
block to the next (`page_stride`) and the bytes of a block (`page_bytes`). vLLM's
attention backends lay a layer out three ways (`block_dim` tells them apart):

- CPU attention `[num_blocks, heads, block_size, 2*head_size]`: block i is `t[i]`, one
  dense run: one buffer per layer, contiguous pages.
- FlashInfer `[num_blocks, 2, block_size, heads, head_dim]`: the same (K and V of block
  i sit together in `t[i]`).
- FlashAttention `[2, num_blocks, block_size, heads, head_dim]`: K and V are two halves;
  block i is `t[0, i]` and `t[1, i]`: two buffers per layer (K region, V region), each
  with contiguous pages of half a block.

`describe_views` does the arithmetic for any of them; where the memory lives (a
shared-memory segment, a CUDA storage exported by IPC handle) is the caller's `locate`.
Everything here is pure: no daemon, no vLLM import, CPU tensors test it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixkv.layout import KvLayout

Buffer = tuple  # (handle, offset, size) or (handle, offset, size, page_stride, page_bytes)


@dataclass(frozen=True)
class KvMemory:
    """What Register needs about vLLM's KV memory on one worker.

    `layout`: one page = one block of one layer, as an opaque run of bytes (described to
    the daemon as kv_format "mla" with head_dim = bytes of a token's content in `dtype`
    units, what the scheduler derives from vLLM's spec: `layout_from_spec`). `buffers`:
    `regions` per layer, in vLLM's layer order, each starting at block 0 of its region:
    (handle, offset, size) when every layer is one region of contiguous pages, else
    (handle, offset, size, page_stride, page_bytes). `block_stride`: bytes from one block
    of a region to the next. `page_bytes`: bytes of a block of one layer (all regions).
    `layer_names`: vLLM's names, in buffer order."""

    layout: KvLayout
    buffers: tuple[Buffer, ...]
    num_blocks: int
    block_stride: int
    page_bytes: int
    layer_names: tuple[str, ...]
    regions: int = 1


def block_dim(shape: tuple[int, ...], num_blocks: int | None = None) -> int:
    """The dimension that indexes blocks: 0 (CPU attention, 4-d; FlashInfer, 5-d) or 1
    (FlashAttention: `[2, num_blocks, ...]`). `num_blocks` (vLLM's, when known) settles
    shapes the dimensions alone leave open. Raises ValueError for another shape, or
    one that reads both ways (e.g. 2 blocks of a 5-d layout, without `num_blocks`)."""
    shape = tuple(shape)
    if len(shape) == 4:
        if num_blocks is not None and shape[0] != num_blocks:
            raise ValueError(f"a 4-d KV view {shape} does not start with vLLM's {num_blocks} blocks")
        return 0
    if len(shape) != 5:
        raise ValueError(f"KV view of shape {shape}: radixkv knows vLLM's CPU attention (4-d), "
                         "FlashAttention and FlashInfer (5-d) layouts")
    first = shape[1] == 2 and (num_blocks is None or shape[0] == num_blocks)
    second = shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks)
    if first and second:
        raise ValueError(f"KV view of shape {shape} reads as FlashInfer and as FlashAttention; "
                         "give vLLM's num_blocks")
    if first or second:
        return 0 if first else 1
    raise ValueError(f"KV view of shape {shape} is neither [num_blocks, 2, ...] (FlashInfer) nor "
                     f"[2, num_blocks, ...] (FlashAttention)" + (f" with {num_blocks} blocks" if num_blocks else ""))


def block_regions(t: torch.Tensor, num_blocks: int | None = None) -> tuple[list[tuple[int, int, int]], int]:
    """(regions, num_blocks) of one layer's view `t`: per region (byte offset of its block
    0 from `t.data_ptr()`, page stride, page bytes), such that block i of the layer is
    exactly the bytes [offset + i*stride, offset + i*stride + page_bytes) of every
    region. Raises ValueError when a block of a region is not one dense run of bytes."""
    dim = block_dim(tuple(t.shape), num_blocks)
    parts = [t] if dim == 0 else [t[0], t[1]]
    item = t.element_size()
    out = []
    for part in parts:
        block = part[0]
        if not _dense(block):
            raise ValueError(f"a KV block (shape {tuple(block.shape)}, strides {block.stride()}) of a view "
                             f"{tuple(t.shape)} is not one dense run of bytes")
        page = block.numel() * item
        stride = part.stride(0) * item
        if stride < page:
            raise ValueError(f"KV blocks of a view {tuple(t.shape)} overlap (stride {stride} < {page} bytes)")
        out.append((part.data_ptr() - t.data_ptr(), stride, page))
    return out, t.shape[dim]


def describe_views(kv_caches: dict[str, torch.Tensor], block_size: int,
                   locate: Callable[[str, torch.Tensor], tuple[bytes, int]],
                   num_blocks: int | None = None) -> KvMemory:
    """Describe vLLM's per-layer KV views (`register_kv_caches`' argument). `locate(name,
    view)` gives (handle, byte offset of `view.data_ptr()` in the memory the handle names)
    and raises ValueError, naming the layer, for a view it cannot place. Raises ValueError
    when layers disagree on shape, dtype or strides (one full-attention group is
    supported), a block holds other than `block_size` tokens, or a block is not dense."""
    if not kv_caches:
        raise ValueError("vLLM registered no KV cache layers")
    names = tuple(kv_caches)
    first = kv_caches[names[0]]
    for name in names:
        t = kv_caches[name]
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise ValueError(f"layer {name}: shape {tuple(t.shape)} {t.dtype} differs from layer "
                             f"{names[0]}'s {tuple(first.shape)} {first.dtype}; radixkv supports "
                             "one full-attention KV cache group")
    regions, blocks = block_regions(first, num_blocks)
    tokens = first.shape[2]
    if tokens != block_size:
        raise ValueError(f"KV cache views hold {tokens} tokens per block, vLLM's block size is "
                         f"{block_size}: kernel block splitting is not supported")
    heads = first.shape[1] if first.dim() == 4 else first.shape[3]
    item = first.element_size()
    page_bytes = sum(page for _, _, page in regions)
    stride, chunk = regions[0][1], regions[0][2]
    if any(s != stride or p != chunk for _, s, p in regions):
        raise ValueError(f"the K and V halves of a view {tuple(first.shape)} have different block geometry")
    plain = len(regions) == 1 and stride == chunk
    buffers = []
    for name in names:
        handle, at = locate(name, kv_caches[name])
        for off, s, p in regions:
            size = (blocks - 1) * s + p
            buffers.append((handle, at + off, size) if plain else (handle, at + off, size, s, p))
    layout = KvLayout(num_layers=len(names), num_kv_heads=heads, head_dim=page_bytes // (heads * tokens * item),
                      dtype=str(first.dtype).removeprefix("torch."), page_size=tokens, kv_format="mla")
    return KvMemory(layout, tuple(buffers), blocks, stride, page_bytes, names, len(regions))


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill one run of `t.numel()` elements (any dimension order)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


__all__ = ["KvMemory", "block_dim", "block_regions", "describe_views"]
