"""Fingerprints of the files that compute the KV: a model's weights and a LoRA adapter's.

radixkv's KV outlives the engine (host tier, storage) and is shared between engines, so a
path alone cannot name weights: new weights copied to the same path would be served the
old weights' KV. A fingerprint is a digest of content only (never paths or mtimes), so
identical files on two nodes, or at two paths, give the same fingerprint:

- a model (`model_fingerprint`): every `*.json` file at the top of its directory (config,
  quantization settings, weight index) read whole, and per weight file (`WEIGHT_SUFFIXES`)
  its name, size and `SAMPLES` ranges of `SAMPLE_BYTES` spread evenly over it, first
  and last included. A retrained or fine-tuned model differs in every tensor, so in
  every sample; the cost is a few hundred KiB read per model, whatever its size;
- a LoRA adapter (`adapter_fingerprint`; small): every file of its directory read whole,
  once per version: the digest is kept per (path, each file's name, size and mtime_ns),
  so the scheduler pays a few `stat` calls per request and the read once per adapter
  written. (An adapter rewritten in place with files of the same sizes within one tick
  of the filesystem's clock, a few ms, keeps the digest read before: git's "racy" case.)

A model or adapter given as a hub id is fingerprinted in the snapshot Hugging Face's
cache holds for it (vLLM downloads there); None where there is none (the caller keeps
the path alone and warns once).
"""

import hashlib
import logging
import os

log = logging.getLogger("vllm.radixkv")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
SAMPLES = 16
SAMPLE_BYTES = 4096
DIGEST_BYTES = 8  # 16 hex digits in an identity


def model_fingerprint(model: str, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """Hex digest of the weights at `model` (a directory, one weights file, or a hub id
    resolved in the local hub cache under `cache_dir` at `revision`), or None when no
    local files are found. Reads whole JSON files and samples of each weight file."""
    path = local_path(model, revision, cache_dir, "config.json")
    if path is None:
        return None
    h = _hasher(b"model")
    if os.path.isfile(path):
        _sample(h, path)
        return h.hexdigest()
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".json"):
            _whole(h, file)
        elif name.endswith(WEIGHT_SUFFIXES):
            _sample(h, file)
    return h.hexdigest()


_adapters: dict[tuple, str | None] = {}


def adapter_fingerprint(path: str | None) -> str | None:
    """Hex digest of every file of the LoRA adapter at `path` (a directory, or a hub id
    in the local hub cache), or None when there are no local files. Cached per version
    (path, names, sizes, mtime_ns): a few `stat` calls when the adapter is unchanged."""
    local = local_path(path, None, None, "adapter_config.json") if path else None
    if local is None:
        return None
    files = _listing(local)
    version = (local, tuple((name, st.st_size, st.st_mtime_ns) for name, st in files))
    if version not in _adapters:
        h = _hasher(b"adapter")
        for name, _ in files:
            _whole(h, os.path.join(local, name), name)
        if len(_adapters) > 1024:
            _adapters.clear()
        _adapters[version] = h.hexdigest()
    return _adapters[version]


def local_path(model: str, revision: str | None, cache_dir: str | None, marker: str) -> str | None:
    """`model` if it exists here, else the directory of the hub cache's snapshot of repo
    `model` at `revision` that holds `marker` (vLLM downloads a hub id's files there);
    None when neither is found. Never reaches the network."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(model, marker, cache_dir=cache_dir, revision=revision)
    except Exception:  # not a hub id (a path that is not here), or no huggingface_hub
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def _listing(directory: str) -> list[tuple[str, os.stat_result]]:
    """(relative name, stat) of every file under `directory`, sorted by name."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            file = os.path.join(root, name)
            out.append((os.path.relpath(file, directory), os.stat(file)))
    return sorted(out, key=lambda entry: entry[0])


def _hasher(kind: bytes):
    return hashlib.blake2b(kind, digest_size=DIGEST_BYTES, person=b"radixkv-weights")


def _field(h, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little") + data)


def _whole(h, file: str, name: str | None = None) -> None:
    _field(h, (name or os.path.basename(file)).encode())
    with open(file, "rb") as f:
        _field(h, f.read())


def _sample(h, file: str) -> None:
    size = os.path.getsize(file)
    _field(h, os.path.basename(file).encode())
    _field(h, size.to_bytes(8, "little"))
    last = max(0, size - SAMPLE_BYTES)
    with open(file, "rb") as f:
        for i in range(SAMPLES):
            f.seek(last * i // (SAMPLES - 1))
            _field(h, f.read(SAMPLE_BYTES))


__all__ = ["adapter_fingerprint", "local_path", "model_fingerprint"]
