"""vLLM's KV cache on CUDA, handed to the daemon by CUDA IPC handle (backend "cuda").

vLLM allocates its CUDA KV cache itself (no memory-pool context is needed) and views it
per layer in the attention backend's layout. `export(kv_caches, block_size)` exports
each distinct storage under the views once (`UntypedStorage._share_cuda_`, encoded by
`radixkv.cuda_handle.encode_cuda_handle`) and describes every layer's blocks with
`layouts.describe_views`: offsets are bytes from the storage's start. Each Register
needs its own export (torch counts every IPC reference), so the buffers returned are a
list with `fresh()`, which the client calls for each automatic re-registration.

Ordering on the GPU (the daemon copies on its own streams):
- a save (Insert) waits for `step_event()` recorded after the forward wrote the blocks;
- a load (LoadBack) overwrites blocks only after `step_event()` recorded before it (kernels
  still reading those blocks finish first), and vLLM's stream waits on the daemon's
  per-layer events of the load (`wait_loaded`): each attention layer waits for its own
  layer's events as it begins, once vLLM is seen to ask for every layer (`layer_waits`).
Proven only where a GPU is lent (tests/gpu/test_vllm_cuda.py); nothing here runs on CPU.
"""

import torch

from radixkv.cuda_handle import encode_cuda_handle
from radixkv.kvbuffers import CudaKvBuffers, device_uuid

from .layouts import KvMemory, describe_views


class CudaKvExport(list):
    """The buffers of one export of vLLM's CUDA KV views (a list of Register buffers);
    `fresh()` exports the same storages again (a new IPC reference each). Holds the
    views, so the storages outlive the session."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int, num_blocks: int | None):
        self._args = (dict(kv_caches), block_size, num_blocks)
        self.memory = _describe(*self._args)
        super().__init__(self.memory.buffers)

    def fresh(self) -> list:
        return list(_describe(*self._args).buffers)


def export(kv_caches: dict[str, torch.Tensor], block_size: int, num_blocks: int | None = None) -> CudaKvExport:
    """Export vLLM's CUDA KV views (all on one device). Raises ValueError naming the
    layer for a view that is not on CUDA, or for a layout `describe_views` refuses."""
    devices = {t.device for t in kv_caches.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"vLLM's KV views are on {sorted(map(str, devices))}; the cuda export needs one CUDA device")
    return CudaKvExport(kv_caches, block_size, num_blocks)


def device_of(kv_caches: dict[str, torch.Tensor]) -> tuple[int, str]:
    """(ordinal, "GPU-<uuid>") of the device vLLM's KV views are on."""
    index = next(iter(kv_caches.values())).device.index or 0
    return index, device_uuid(index)


def step_event(device: int) -> "torch.cuda.Event":
    """An interprocess event recorded now on vLLM's current stream of `device`: pass it as
    `engine_event` so the daemon's copy runs after every kernel queued so far."""
    return CudaKvBuffers.record_event(torch.cuda.current_stream(device))


def wait_loaded(layer_events: tuple[bytes, ...], device: int) -> None:
    """Make vLLM's current stream wait for these events of the daemon's loads (every
    layer of a load, or one layer of this step's loads: `layer_waits`)."""
    if layer_events:
        CudaKvBuffers.wait_events(list(layer_events), torch.cuda.current_stream(device))


def _describe(kv_caches: dict[str, torch.Tensor], block_size: int, num_blocks: int | None) -> KvMemory:
    handles: dict[int, bytes] = {}  # storage address -> handle: views of one storage share it

    def locate(name: str, t: torch.Tensor) -> tuple[bytes, int]:
        storage = t.untyped_storage()
        handle = handles.get(storage.data_ptr())
        if handle is None:
            handle = handles[storage.data_ptr()] = encode_cuda_handle(storage._share_cuda_())
        return handle, t.data_ptr() - storage.data_ptr()

    return describe_views(kv_caches, block_size, locate, num_blocks)


__all__ = ["CudaKvExport", "device_of", "export", "step_event", "wait_loaded"]
