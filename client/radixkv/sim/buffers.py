"""SimBuffers: the simulated engine's device KV pool, on either backend.

- "shm" (any machine): one POSIX shared-memory segment (`ShmKvBuffers`).
- "cuda": one torch CUDA tensor per buffer on cuda:N, layer-major (layer 0 K, layer 0
  V, ...), exported through CUDA IPC (`CudaKvBuffers.export`), and a CUDA stream the
  engine does all its KV work on.

Nothing here touches CUDA unless the "cuda" backend is asked for, so the simulator
imports and runs on machines without a GPU.
"""

import torch

from ..kvbuffers import BufferSpec, CudaKvBuffers, ShmKvBuffers, torch_dtype
from ..layout import KvLayout

SIM_BACKENDS = ("shm", "cuda")


class SimBuffers:
    """`tensors` (one per buffer, layer-major) and the `specs` to Register them with.
    `stream` is the CUDA stream for the engine's KV work (None on shm). Call `close`
    once the client is closed (the daemon no longer copies)."""

    def __init__(self, layout: KvLayout, num_pages: int, backend: str, device: int,
                 tensors: list[torch.Tensor], specs: list[BufferSpec], stream=None, shm=None):
        self.layout = layout
        self.num_pages = num_pages
        self.backend = backend
        self.device = device
        self.tensors = tensors
        self.specs = specs
        self.stream = stream
        self._shm = shm

    @classmethod
    def create(cls, layout: KvLayout, num_pages: int, backend: str = "shm", device: int = 0) -> "SimBuffers":
        """Allocate zeroed buffers for `num_pages` pages. Raises ValueError on an unknown
        backend, or "cuda" without a visible GPU `device`."""
        if backend == "shm":
            shm = ShmKvBuffers.create(layout, num_pages)
            return cls(layout, num_pages, backend, 0, [shm.buffer(i) for i in range(layout.num_buffers)],
                       shm.specs(), shm=shm)
        if backend != "cuda":
            raise ValueError(f"backend {backend!r}: use one of {list(SIM_BACKENDS)}")
        if not torch.cuda.is_available():
            raise ValueError("backend 'cuda' needs torch with CUDA and a visible GPU; use --backend shm")
        if not 0 <= device < torch.cuda.device_count():
            raise ValueError(f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)")
        shape = (num_pages * layout.page_size, layout.num_kv_heads, layout.head_dim)
        with torch.cuda.device(device):
            tensors = [torch.zeros(shape, dtype=torch_dtype(layout), device=device)
                       for _ in range(layout.num_buffers)]
            stream = torch.cuda.Stream(device)
            torch.cuda.synchronize(device)  # zeroed before the daemon may read them
            specs = CudaKvBuffers.export(layout, tensors, device)
        CudaKvBuffers.forget_events()  # these buffers go to a (possibly new) daemon
        return cls(layout, num_pages, backend, device, tensors, specs, stream=stream)

    def close(self) -> None:
        """Release the buffers: unlink the segment (shm), drop the tensors after the
        device is idle (cuda). Idempotent."""
        if self.backend == "cuda" and self.tensors:
            torch.cuda.synchronize(self.device)
        self.tensors = []  # first: views of the segment keep its mapping alive
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def __repr__(self) -> str:
        where = f"cuda:{self.device}" if self.backend == "cuda" else "shm"
        return f"SimBuffers({where}, pages={self.num_pages}, buffers={self.layout.num_buffers})"


__all__ = ["SIM_BACKENDS", "SimBuffers"]
