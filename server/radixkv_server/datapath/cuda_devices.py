"""Which GPU: the engine names its device by UUID, the daemon finds its own ordinal.

Ordinals depend on each process's CUDA_VISIBLE_DEVICES (and CUDA_DEVICE_ORDER): the
engine's cuda:0 may be the daemon's cuda:3. A UUID names one GPU everywhere. torch
prints it without nvidia-smi's "GPU-" prefix; both spellings are accepted.
"""

from .device import DeviceOpenError


def normalize_uuid(uuid: str) -> str:
    """Lower case, without the "GPU-" prefix nvidia-smi writes."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def ordinal_for_uuid(uuid: str, visible: list[str]) -> int:
    """The index in `visible` (this process's devices' UUIDs, by ordinal) of the GPU
    named `uuid`. Raises DeviceOpenError listing the visible GPUs when it is not one of
    them (hidden by this process's CUDA_VISIBLE_DEVICES, or another machine's)."""
    want = normalize_uuid(uuid)
    for i, u in enumerate(visible):
        if normalize_uuid(u) == want:
            return i
    seen = ", ".join(f"cuda:{i}=GPU-{normalize_uuid(u)}" for i, u in enumerate(visible)) or "none"
    raise DeviceOpenError(
        f"GPU {uuid!r} is not visible to the daemon (visible: {seen}); check the daemon's "
        "CUDA_VISIBLE_DEVICES and that engine and daemon run on one machine")


def visible_uuids() -> list[str]:
    """UUIDs of this process's CUDA devices, by ordinal (no context is created)."""
    import torch
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def device_uuid(ordinal: int) -> str:
    """"GPU-<uuid>" of this process's CUDA device `ordinal`."""
    import torch
    return "GPU-" + normalize_uuid(str(torch.cuda.get_device_properties(ordinal).uuid))


__all__ = ["device_uuid", "normalize_uuid", "ordinal_for_uuid", "visible_uuids"]
