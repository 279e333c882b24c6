"""`open_device_buffers`: the one place that knows every device backend.

`BACKENDS` maps a backend name (the `backend` of a Register) to the function opening
the engine's buffers with it. The backends import `device`, never this module.
"""

from collections.abc import Callable

from radixkv.layout import KvLayout

from .cuda import CudaDeviceBuffers
from .device import BufferSpec, DeviceBuffers, DeviceOpenError, buffer_geometry, buffer_name
from .shm import ShmDeviceBuffers

Opener = Callable[..., DeviceBuffers]  # (layout, num_pages, specs, device, device_uuid=...)



def _open_shm(layout: KvLayout, num_pages: int, specs: list[BufferSpec], device: int,
              device_uuid: str = "") -> DeviceBuffers:
    return ShmDeviceBuffers(layout, num_pages, specs)  # no device: shared memory is host memory


BACKENDS: dict[str, Opener] = {
    "shm": _open_shm,
    "cuda": CudaDeviceBuffers,  # imports on CPU-only machines; touches CUDA only when opened
}


def open_device_buffers(backend: str, layout: KvLayout, num_pages: int,
                        buffers: list[BufferSpec], device: int = 0, device_uuid: str = "") -> DeviceBuffers:
    """Open the engine's buffers: one BufferSpec per buffer, layer-major (layer 0 K,
    layer 0 V, ...). The engine's GPU (ignored for "shm") is `device_uuid` when given,
    else the ordinal `device` (the daemon's numbering must then match the engine's).
    Raises DeviceOpenError naming what is wrong: unknown backend, wrong buffer count,
    a segment or handle that cannot be opened, a region too small."""
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
    if backend == "cuda" and (chunk != layout.chunk_bytes or any(s != chunk for s in strides)):
        raise DeviceOpenError(
            "backend 'cuda' copies the layout's own buffers only (one per layer and K/V, contiguous "
            "pages); buffers with their own page_stride/page_bytes are supported on 'shm' for now")
    return opener(layout, num_pages, specs, device, device_uuid=device_uuid)


__all__ = ["BACKENDS", "open_device_buffers"]
