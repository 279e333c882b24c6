"""The data path: moves KV bytes between the engine's device buffers and the host pool.

`HostPool` owns the daemon's host pages; `open_device_buffers` opens the engine's
buffers (`shm` or `cuda` backend); `CopyEngine` is the core's `Copier`, running copies
on worker threads and reporting completions on the event loop.
"""

from .copy_engine import CopyEngine
from .device import BufferSpec, CopyError, CopyJob, DeviceBuffers, DeviceOpenError, SegmentNotYours
from .host_pool import HostPool
from .host_shard import HostShard
from .open import BACKENDS, open_device_buffers
from .ranked_buffers import RankedBuffers

__all__ = [
    "BACKENDS", "BufferSpec", "CopyEngine", "CopyError", "CopyJob", "DeviceBuffers",
    "DeviceOpenError", "HostPool", "HostShard", "RankedBuffers", "SegmentNotYours", "open_device_buffers",
]
