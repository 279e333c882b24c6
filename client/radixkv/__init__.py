"""radixkv: what engines import to talk to the radixkv daemon.

`KvLayout` describes the engine's paged KV cache; `radixkv.kvbuffers` exports the
engine's KV buffers to the daemon (shared memory on CPU, CUDA IPC on GPU).
"""

from .layout import KvLayout

__all__ = ["KvLayout"]
