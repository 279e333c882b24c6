"""Pinned host memory for CUDA: registering the host pool, and the device address of it.

`cudaHostRegister(portable | mapped)` page-locks the pool and maps it into the GPU's
address space. The address a kernel must use is the one the driver gives
(`cuMemHostGetDevicePointer`); it equals the host pointer only where the device says
so (`CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`). torch exposes
neither call, so they go through the driver library (`libcuda.so.1`) with ctypes; where
that fails the copies fall back to cudaMemcpyAsync, which needs no device address.

Every function touches CUDA only when called, so the module imports on CPU machines.
"""

import ctypes
import logging

log = logging.getLogger("radixkv.datapath")

_HOST_REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
ATTR_CAN_USE_HOST_POINTER = 91      # CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
_libcuda = None


def _torch():
    import torch
    return torch


def pin_host(ptr: int, nbytes: int, device: int | None = None) -> None:
    """Page-lock [ptr, ptr + nbytes) (cudaHostRegister, portable and mapped) under
    `device`'s context. Raises RuntimeError with the CUDA error code on failure."""
    torch = _torch()
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error {int(err)} ({err})")


def unpin_host(ptr: int, device: int | None = None) -> None:
    """Undo `pin_host`. Logs (does not raise) a failure: teardown must go on."""
    torch = _torch()
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(err) != 0:
        log.warning("cudaHostUnregister failed: CUDA error %s", int(err))


def pin_refused(mode: str, error: Exception, nbytes: int) -> str:
    """The decision when cudaHostRegister refused the pool: pin="always" raises
    RuntimeError (Register fails, saying why); "auto" returns the line to log before
    going on with an unpinned pool (copies then move chunk by chunk)."""
    if mode == "always":
        raise RuntimeError(f"host pool pin='always' but pinning {nbytes} bytes failed: {error}")
    return (f"host pool: pinning {nbytes / 2**30:.2f} GiB was refused ({error}); going on unpinned "
            "(CUDA copies go chunk by chunk; pin='always' would make this an error)")


def choose_device_pointer(host_ptr: int, can_use_host_pointer: int | None, driver_pointer: int | None) -> int | None:
    """The address kernels use for registered host memory at `host_ptr`: the driver's
    answer when it gave one, else the host pointer where the device attribute says it is
    valid (1), else None (no device view: copy with cudaMemcpyAsync instead)."""
    if driver_pointer:
        return driver_pointer
    if can_use_host_pointer == 1:
        return host_ptr
    return None


def mapped_pointer(host_ptr: int, device: int) -> tuple[int | None, int | None]:
    """(device attribute CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, the driver's device
    pointer for registered `host_ptr`) on CUDA device `device`; None for what could not be
    asked (no driver library, or an error code). Uses the device's primary context,
    which torch shares, pushed on this thread for the call."""
    lib = _driver()
    if lib is None:
        return None, None
    dev, attr, ctx, dptr = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), device):
        return None, None
    can = attr.value if lib.cuDeviceGetAttribute(ctypes.byref(attr), ATTR_CAN_USE_HOST_POINTER, dev) == 0 else None
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        return can, None
    try:
        if _fn(lib, "cuCtxPushCurrent")(ctx):
            return can, None
        try:
            rc = _fn(lib, "cuMemHostGetDevicePointer")(ctypes.byref(dptr), ctypes.c_void_p(host_ptr), 0)
        finally:
            _fn(lib, "cuCtxPopCurrent")(ctypes.byref(ctypes.c_void_p()))
        return can, (dptr.value if rc == 0 else None)
    finally:
        _fn(lib, "cuDevicePrimaryCtxRelease")(dev)


def can_use_host_pointer(device: int) -> int | None:
    """The device attribute alone (1, 0, or None when the driver cannot be asked)."""
    lib = _driver()
    dev, attr = ctypes.c_int(), ctypes.c_int()
    if lib is None or lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), device):
        return None
    return attr.value if lib.cuDeviceGetAttribute(ctypes.byref(attr), ATTR_CAN_USE_HOST_POINTER, dev) == 0 else None


def _driver():
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            log.warning("no CUDA driver library (%s): the host pool gets no device view", e)
            _libcuda = False
    return _libcuda or None


def _fn(lib, name: str):
    """The current (_v2) entry point of a driver call, else the original one."""
    return getattr(lib, name + "_v2", None) or getattr(lib, name)


__all__ = ["choose_device_pointer", "can_use_host_pointer", "mapped_pointer", "pin_host", "pin_refused",
           "unpin_host"]
