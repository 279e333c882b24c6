"""vLLM's KV memory as the daemon sees it: where it lives and how its pages are laid out.

vLLM 0.32 allocates a worker's whole KV cache as one flat int8 tensor
(`vllm.v1.worker.utils.allocate_kv_cache`: `torch.zeros(size, dtype=torch.int8)`) inside
the context the KV connector returns from `get_mem_pool_context()`, then views it per
layer as `[num_blocks, heads, block_size, content]`. `ShmAllocation` is that context on
CPU: the one allocation lands in a POSIX shared-memory segment (`/dev/shm/<name>`) that
the daemon maps, so it copies vLLM's blocks in place, with no staging copy.

`describe(kv_caches, base)` turns vLLM's per-layer views into what Register takes: per
layer a buffer (segment, byte offset of block 0, size) and one page geometry shared by
all layers. A page is one vLLM block of one layer, copied as opaque bytes, so the daemon
does not need to know the attention backend's interior layout (CPU attention keeps K and
V of a block together; the daemon never looks inside).
"""

import atexit
import mmap
import os
import secrets

import torch
from torch.overrides import TorchFunctionMode

from radixkv.layout import KvLayout

from .layouts import KvMemory, describe_views

SHM_DIR = "/dev/shm"
PREFIX = "radixkv_vllm_"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


class ShmSegment:
    """One POSIX shared-memory segment this process created and owns (unlinks).

    `tensor` is a flat int8 view of the whole segment (zero-filled), mapped MAP_SHARED so
    the daemon's mapping sees the same bytes, and populated: this process's page tables
    for the whole segment are made here, as vLLM's own `torch.zeros` makes them by
    writing, not by page faults in the first forward that reads each block the daemon
    loaded. The mapping lives as long as the tensor and its views do; `unlink` removes
    the name (a daemon that mapped it keeps its map)."""

    def __init__(self, size: int, name: str | None = None):
        if size < 1:
            raise ValueError(f"a shared-memory segment needs at least 1 byte, got {size}")
        self.name = name or f"{PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED | _MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.size = size
        self.tensor = torch.frombuffer(self._map, dtype=torch.int8, count=size)
        atexit.register(self.unlink)  # an engine that exits without shutdown()

    def unlink(self) -> None:
        """Remove the segment's name. Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ShmAllocation(TorchFunctionMode):
    """Context manager: the first `torch.zeros(n, dtype=torch.int8)` on CPU inside it
    returns a shared-memory segment's tensor instead (vLLM's KV cache allocation). Every
    other call runs unchanged. After the block, `segment` is the segment (None when vLLM
    allocated nothing there, e.g. a model without KV cache)."""

    def __init__(self):
        super().__init__()
        self.segment: ShmSegment | None = None
        remove_orphans()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and self.segment is None and _is_flat_int8_cpu(args, kwargs):
            size = args[0] if isinstance(args[0], int) else args[0][0]
            self.segment = ShmSegment(int(size))
            return self.segment.tensor
        return func(*args, **kwargs)


def remove_orphans() -> list[str]:
    """Unlink segments of engines that died without cleaning up (their pid is gone);
    returns their names. A daemon that still maps one keeps its mapping."""
    removed = []
    for name in os.listdir(SHM_DIR):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("_", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_flat_int8_cpu(args, kwargs) -> bool:
    if kwargs.get("dtype") is not torch.int8 or len(args) != 1:
        return False
    size = args[0]
    if isinstance(size, (tuple, list, torch.Size)):
        if len(size) != 1:
            return False
        size = size[0]
    device = kwargs.get("device")
    return isinstance(size, int) and (device is None or torch.device(device).type == "cpu")


def describe(kv_caches: dict[str, torch.Tensor], base: torch.Tensor, handle: bytes,
             block_size: int, num_blocks: int | None = None) -> KvMemory:
    """Describe vLLM's per-layer KV views (`register_kv_caches`' argument), all views of
    `base` (the shared-memory allocation, named `handle` for the daemon): see
    `layouts.describe_views`. Raises ValueError, naming the layer, when a layer is not a
    view of `base`, its blocks are not dense pages, or the layers disagree on shape or
    dtype (one full-attention group is supported)."""
    base_ptr = base.data_ptr()
    end = base_ptr + base.numel() * base.element_size()

    def locate(name: str, t: torch.Tensor) -> tuple[bytes, int]:
        if not base_ptr <= t.data_ptr() < end:
            raise ValueError(f"layer {name}: its KV cache is not in the shared-memory allocation")
        return handle, t.data_ptr() - base_ptr

    return describe_views(kv_caches, block_size, locate, num_blocks)


def layout_from_spec(kv_cache_config) -> KvLayout:
    """The layout `describe` gives a worker, from vLLM's `KVCacheConfig` alone (what the
    scheduler process has): every layer of every group, group 0's attention spec (heads of
    one rank, block size, dtype, bytes of a block of one layer). Raises ValueError for a
    config without an attention group."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not groups:
        raise ValueError("vLLM's KV cache config has no KV cache group")
    spec = groups[0].kv_cache_spec
    heads, tokens = getattr(spec, "num_kv_heads", 0), spec.block_size
    if not heads:
        raise ValueError(f"radixkv supports attention KV caches, not {type(spec).__name__}")
    item = torch.empty((), dtype=spec.dtype).element_size()
    return KvLayout(num_layers=sum(len(g.layer_names) for g in groups), num_kv_heads=heads,
                    head_dim=spec.page_size_bytes // (heads * tokens * item),
                    dtype=str(spec.dtype).removeprefix("torch."), page_size=tokens, kv_format="mla")


__all__ = ["KvMemory", "PREFIX", "ShmAllocation", "ShmSegment", "describe", "layout_from_spec",
           "remove_orphans"]
