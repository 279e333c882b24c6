"""The CUDA IPC handle a Register's `DeviceBuffer.handle` carries (backend "cuda"): the
eight values torch's `UntypedStorage._share_cuda_()` gives for the storage holding the
buffer, as versioned JSON (bytes fields base64), so any engine can write one
(docs/engines.md, "CUDA"). The daemon decodes it and opens the storage with torch's
`_new_shared_cuda`; decoding refuses values that are not what torch's export gives,
since torch acts on them when the storage is freed.
"""

import base64
import json
import re

_CUDA_FIELDS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event_handle", "event_sync")
_CUDA_BYTES = ("handle", "ref_handle", "event_handle")
CUDA_HANDLE_VERSION = 1


def encode_cuda_handle(shared: tuple) -> bytes:
    """Encode the tuple of `UntypedStorage._share_cuda_()` as the BufferSpec handle
    (versioned json, bytes fields base64)."""
    if len(shared) != len(_CUDA_FIELDS):
        raise ValueError(f"_share_cuda_ returned {len(shared)} fields, expected {len(_CUDA_FIELDS)}: torch changed its IPC format")
    doc = {"v": CUDA_HANDLE_VERSION}
    for key, value in zip(_CUDA_FIELDS, shared):
        if key in _CUDA_BYTES:
            value = None if value is None else base64.b64encode(bytes(value)).decode()
        elif key == "event_sync":
            value = bool(value)
        else:
            value = int(value)
        doc[key] = value
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_cuda_handle(handle: bytes) -> tuple:
    """Inverse of `encode_cuda_handle`: the argument tuple of
    `UntypedStorage._new_shared_cuda`. Raises ValueError on a malformed handle."""
    try:
        doc = json.loads(bytes(handle).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a radixkv CUDA handle (json expected): {e}") from None
    if not isinstance(doc, dict) or doc.get("v") != CUDA_HANDLE_VERSION:
        raise ValueError(f"unsupported CUDA handle version {doc.get('v') if isinstance(doc, dict) else doc!r}; expected {CUDA_HANDLE_VERSION}")
    missing = [k for k in _CUDA_FIELDS if k not in doc]
    if missing:
        raise ValueError(f"CUDA handle lacks {missing}")
    out = {}
    for key in _CUDA_FIELDS:
        value = doc[key]
        if key in _CUDA_BYTES and value is not None:
            try:
                value = base64.b64decode(value, validate=True)
            except (TypeError, ValueError):
                raise ValueError(f"CUDA handle field {key} is not base64") from None
        out[key] = value
    _check_cuda_fields(out)
    return tuple(out[k] for k in _CUDA_FIELDS)


# torch names a CUDA IPC export's reference counter file as its process-wide shared
# memory handles, "/torch_<pid>_<random>_<n>", and the export's slot in it is below
# CUDA_IPC_REF_COUNTER_FILE_SIZE (torch/csrc/CudaIPCTypes.h).
_REF_COUNTER_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
REF_COUNTER_SLOTS = 10_000


def _check_cuda_fields(f: dict) -> None:
    """ValueError unless every field is what torch's export gives. The opener hands them
    to torch, which, when the storage is freed, opens the shared-memory file `ref_handle`
    names, grows it, and decrements the slot `ref_offset` names, then unlinks the file at
    zero: a forged name or slot would have the opener change or remove another
    process's file, or write outside the mapping."""
    if not all(type(f[k]) is int for k in ("device", "size", "offset", "ref_offset")):
        raise ValueError("CUDA handle fields device, size, offset and ref_offset must be integers")
    if f["device"] < 0 or f["size"] <= 0 or f["offset"] < 0:
        raise ValueError(f"CUDA handle: device {f['device']}, size {f['size']}, offset {f['offset']}: "
                         "device and offset must be >= 0 and size > 0")
    if not isinstance(f["handle"], bytes) or not f["handle"]:
        raise ValueError("CUDA handle: handle (the CUDA IPC memory handle) is missing")
    if f["ref_handle"] is not None and not _REF_COUNTER_NAME.fullmatch(f["ref_handle"]):
        raise ValueError(f"CUDA handle: ref_handle {f['ref_handle'][:64]!r} is not a torch reference counter "
                         "(/torch_<pid>_<n>_<n>)")
    if not 0 <= f["ref_offset"] < REF_COUNTER_SLOTS:
        raise ValueError(f"CUDA handle: ref_offset {f['ref_offset']} outside torch's reference counter "
                         f"(0..{REF_COUNTER_SLOTS - 1})")
    if type(f["event_sync"]) is not bool:
        raise ValueError("CUDA handle: event_sync must be true or false")


__all__ = ["CUDA_HANDLE_VERSION", "REF_COUNTER_SLOTS", "decode_cuda_handle", "encode_cuda_handle"]
