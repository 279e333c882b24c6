"""`open_device_buffers`: the one place that knows every device backend.

`BACKENDS` maps a backend name (the `backend` of a Register) to the function opening
the engine's buffers with it. The backends import `device`, never this module.
"""

import dataclasses
from collections.abc import Callable

from radixkv.layout import KvLayout

from .cuda import CudaDeviceBuffers
from .device import BufferSpec, DeviceBuffers, DeviceOpenError, buffer_geometry, buffer_name
from .shm import ShmDeviceBuffers

Opener = Callable[..., DeviceBuffers]  # (layout, num_pages, specs, device, device_uuid=..., owner_uid=... (shm))



def _open_shm(layout: KvLayout, num_pages: int, specs: list[BufferSpec], device: int,
              device_uuid: str = "", owner_uid: int | None = None) -> DeviceBuffers:
    return ShmDeviceBuffers(layout, num_pages, specs, owner_uid)  # no device: shared memory is host memory


BACKENDS: dict[str, Opener] = {
    "shm": _open_shm,
    "cuda": CudaDeviceBuffers,  # imports on CPU-only machines; touches CUDA only when opened
}


def open_device_buffers(backend: str, layout: KvLayout, num_pages: int,
                        buffers: list[BufferSpec], device: int = 0, device_uuid: str = "",
                        owner_uid: int | None = None) -> DeviceBuffers:
    """Open the engine's buffers: one BufferSpec per buffer, layer-major (layer 0 K,
    layer 0 V, ...). The engine's GPU (ignored for "shm") is `device_uuid` when given,
    else the ordinal `device` (the daemon's numbering must then match the engine's).
    Raises DeviceOpenError naming what is wrong: unknown backend, wrong buffer count,
    a segment or handle that cannot be opened, a region too small; SegmentNotYours for
    a shared-memory segment not owned by `owner_uid` (when given)."""
    opener = BACKENDS.get(backend)
    if opener is None:
        raise DeviceOpenError(f"unknown device backend {backend!r}; choose one of {list(BACKENDS)}")
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise DeviceOpenError(f"num_pages must be an int >= 1, got {num_pages!r}")
    specs = [BufferSpec(bytes(b[0]), *(int(x) for x in b[1:5])) for b in buffers]
    for i, s in enumerate(specs):
        if min(s.offset, s.size, s.page_stride, s.page_bytes) < 0:
            raise DeviceOpenError(f"buffer {i} ({buffer_name(layout, i)}): negative offset, size, stride or page bytes {s}")
    chunk, strides = buffer_geometry(layout, specs)  # the count and page geometry fit the layout
    if backend == "cuda":
        return opener(cuda_layout(layout, len(specs), chunk, strides), num_pages, specs, device,
                      device_uuid=device_uuid)
    if backend == "shm":
        return opener(layout, num_pages, specs, device, device_uuid=device_uuid, owner_uid=owner_uid)
    return opener(layout, num_pages, specs, device, device_uuid=device_uuid)


def cuda_layout(layout: KvLayout, count: int, chunk: int, strides: list[int]) -> KvLayout:
    """The layout the cuda backend copies `count` buffers of contiguous `chunk`-byte pages
    with: `layout` itself for its own buffers, or, for an "mla" layout given as two
    half-page buffers per layer (vLLM's FlashAttention K and V halves), the "mha" layout
    with those halves as K and V (the same host bytes: layer 0 K, layer 0 V, ...). Raises
    DeviceOpenError for other page geometry (strided pages: 'shm' only for now)."""
    if any(s != chunk for s in strides):
        raise DeviceOpenError("backend 'cuda' copies contiguous pages only; buffers with a page_stride "
                              "other than their page_bytes are supported on 'shm' for now")
    if count == layout.num_buffers and chunk == layout.chunk_bytes:
        return layout
    halves = layout.kv_format == "mla" and count == 2 * layout.num_layers and layout.head_dim % 2 == 0
    if halves:
        mha = dataclasses.replace(layout, head_dim=layout.head_dim // 2, kv_format="mha")
        if mha.chunk_bytes == chunk:
            return mha
    raise DeviceOpenError(
        f"backend 'cuda' copies the layout's own buffers or, for an 'mla' layout, two half pages per layer; "
        f"{count} buffers of {chunk}-byte pages do not fit {layout}")


__all__ = ["BACKENDS", "cuda_layout", "open_device_buffers"]
