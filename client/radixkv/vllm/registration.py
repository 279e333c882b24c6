"""One worker's KV memory registered with the daemon, on CPU or CUDA (no vLLM import).

`register_worker` is what the connector's `register_kv_caches` does: CUDA views are
exported by IPC handle (`cudamemory`, backend "cuda"), CPU views are described inside
the shared-memory allocation vLLM made in `get_mem_pool_context` (backend "shm"); both
with the page description of `layouts.describe_views`.
"""

import torch

from .daemon import DaemonAdapter
from .kvmemory import ShmAllocation, describe


def register_worker(adapter: DaemonAdapter, kv_caches: dict[str, torch.Tensor], block_size: int,
                    allocation: ShmAllocation | None = None) -> None:
    """Register one worker's KV views with `adapter`: CUDA views by IPC handle, CPU views
    as the shared-memory `allocation` they live in. Raises RuntimeError (CPU views
    outside shared memory, a layout radixkv cannot describe, a daemon that refuses)."""
    first = next(iter(kv_caches.values()), None)
    try:
        if first is not None and first.is_cuda:
            from . import cudamemory
            buffers = cudamemory.export(kv_caches, block_size)
            device, uuid = cudamemory.device_of(kv_caches)
            memory = buffers.memory
            adapter.attach(memory.layout, buffers, memory.num_blocks, cuda_device=device, device_uuid=uuid)
            return
        seg = allocation.segment if allocation is not None else None
        if seg is None:
            raise RuntimeError("radixkv: vLLM's KV cache is neither in shared memory nor on CUDA "
                               "(docs/vllm.md)")
        memory = describe(kv_caches, seg.tensor, seg.name.encode(), block_size)
    except ValueError as e:
        raise RuntimeError(f"radixkv: cannot describe vLLM's KV cache: {e}") from None
    adapter.attach(memory.layout, memory.buffers, memory.num_blocks)


__all__ = ["register_worker"]
