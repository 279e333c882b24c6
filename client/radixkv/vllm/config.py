"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

    --kv-transfer-config '{"kv_connector": "RadixKVConnector",
                           "kv_connector_module_path": "radixkv.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"target": "unix:///run/radixkv/radixkv.sock",
                                                         "namespace": "llama3-8b"}}'

Keys (all optional): `target` (the daemon's address), `namespace` (one per model and KV
layout; default "vllm/<vLLM's model path or hub id>", `default_namespace`: not the served model name, which
names an endpoint, so engines of one model served under other names share their KV, and
engines of other models served under one name are not refused), `model` (identity of the
weights: the daemon refuses a namespace that holds another model's KV, and salts storage
keys with it; default vLLM's model path or hub id with a digest of its files and its
revision; set the same string where the same weights sit at other paths, and name there
whatever else changes the KV bytes: weights updated in place, KV scales, docs/fleet.md; the
connector appends to either the engine's settings that change the KV, `engine_settings`
(quantization, `hf_overrides`, `hf_config_path`, a KV cache dtype, the LongRoPE factor
set), and the device type and layout, `on_device`), `timeout_s` (deadline of each daemon call),
`connect_timeout_s` (how long startup waits for the daemon before failing),
`host_pool_pages` (0: the daemon's default), `replace_existing` (take over the namespace
from a session that is still registered, e.g. of an engine that was killed),
`async_loads` (load hits while vLLM runs other requests' forwards: vLLM parks the request
until the worker reports the load in `get_finished`; default False, loads finish before the
forward that reads them), `tier_events` (when vLLM publishes KV events, add the daemon's host
and storage blocks of this namespace to them, `radixkv.vllm.tier_events`; default True).
For a daemon that requires them (docs/reliability.md, "Security"): `token_file` (a file
holding the token, read at startup; sent as `authorization: Bearer`) or `token` (warned
against: vLLM logs its whole extra config at startup, "non-default args", token
included), else the `RADIXKV_TOKEN` environment variable (TOKEN_ENV), and TLS over
TCP: `tls_ca` (PEM roots that signed the daemon's certificate; "" with `tls` true: the
system's), `tls_cert` and `tls_key` (this engine's, for mutual TLS), `tls_server_name`.
An unknown key is an error: a typo must not silently fall back to a default.
"""

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, fields

from radixkv.channel import Tls
from radixkv.client import DEFAULT_TARGET

from .fingerprints import model_fingerprint

log = logging.getLogger("vllm.radixkv")

TOKEN_ENV = "RADIXKV_TOKEN"  # the token when neither `token` nor `token_file` is set
INLINE_TOKEN = ("radixkv: `token` is in kv_connector_extra_config, which vLLM prints in its startup log "
                "(\"non-default args\"): the token is in vLLM's log; give `token_file` or the "
                f"{TOKEN_ENV} environment variable instead")


# The daemon's rule for namespace names (the RPC contract: Register refuses others).
_NAME_CHARS = "A-Za-z0-9._:/@+-"
_NAMESPACE = re.compile(rf"^[A-Za-z0-9][{_NAME_CHARS}]{{0,127}}$")
_DIGEST_HEX = 8


def default_namespace(model_path: str) -> str:
    """"vllm/<model_path>" when the daemon takes that as a namespace name (1-128
    characters of A-Z a-z 0-9 . _ : / @ + -). Else (a hub cache's snapshot path runs past
    128 characters; a space) the path's end in those characters, then 8 hex digits of
    the whole path's digest: still one name per model path, readable, and never
    refused by Register. Pure."""
    name = f"vllm/{model_path}"
    if _NAMESPACE.fullmatch(name):
        return name
    digest = hashlib.sha256(model_path.encode()).hexdigest()[:_DIGEST_HEX]
    room = 128 - len("vllm/") - 1 - _DIGEST_HEX
    tail = re.sub(rf"[^{_NAME_CHARS}]", "_", model_path)[-room:]
    return f"vllm/{tail}-{digest}"


@dataclass(frozen=True)
class ConnectorConfig:
    target: str = DEFAULT_TARGET
    namespace: str = ""
    model: str = ""
    timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    host_pool_pages: int = 0
    replace_existing: bool = False
    async_loads: bool = False
    tier_events: bool = True
    token: str = ""
    token_file: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""

    @classmethod
    def from_extra(cls, extra: dict | None, model_path: str, model: str = "") -> "ConnectorConfig":
        """Settings from `kv_connector_extra_config` (`model_path`: vLLM's model, which
        names the default namespace; `model`: the default of `model`).
        Raises ValueError naming an unknown key or a value of the wrong type."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"radixkv: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        values = {}
        for key, value in extra.items():
            kind = type(getattr(cls, key))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"radixkv: kv_connector_extra_config[{key!r}] must be "
                                 f"{kind.__name__}, got {value!r}")
            values[key] = value
        values.setdefault("model", model)
        if not values.get("namespace"):
            values["namespace"] = default_namespace(model_path)
        config = cls(**values)
        if config.timeout_s <= 0 or config.connect_timeout_s <= 0:
            raise ValueError("radixkv: timeout_s and connect_timeout_s must be > 0")
        if config.token and config.token_file:
            raise ValueError("radixkv: give token or token_file, not both")
        if config.token:
            log.warning(INLINE_TOKEN)
        if bool(config.tls_cert) != bool(config.tls_key):
            raise ValueError("radixkv: tls_cert and tls_key go together")
        config.channel()  # a token file or a certificate that cannot be read fails vLLM's start
        return config

    def channel(self) -> dict:
        """The `tls` and `token` keywords of a radixkv Client for these settings (the token
        from `token_file`, `token`, else the TOKEN_ENV environment variable). Raises
        ValueError for a token file that cannot be read or is empty."""
        token = self.token or os.environ.get(TOKEN_ENV) or None
        if self.token_file:
            try:
                with open(self.token_file) as f:
                    token = f.read().strip()
            except OSError as e:
                raise ValueError(f"radixkv: token_file {self.token_file}: {e.strerror}") from None
            if not token:
                raise ValueError(f"radixkv: token_file {self.token_file} is empty")
        tls = None
        if self.tls or self.tls_ca or self.tls_cert:
            tls = Tls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)
        return {"tls": tls, "token": token}


_unresolved: set[str] = set()  # models (paths, ids, URIs) warned about: weights not fingerprinted


def model_identity(model_config, cache_config=None, download_dir: str | None = None, model: str = "") -> str:
    """What computes the KV, from vLLM's ModelConfig and CacheConfig: the weights, then
    the engine's settings that change the KV of the same weights.

    The weights: `model` (the settings' `model`) when given, else the model (path or hub
    id) and a digest of its files (`fingerprints.model_fingerprint`, of the hub cache's
    snapshot under `download_dir` for a hub id; left out, with a warning, where no local
    files are found) and its revision when set; for weights vLLM streams from object
    storage, their URI (`streamed_weights`). The settings, appended whatever names the
    weights (`engine_settings`)."""
    if model:
        return " ".join([model, *engine_settings(model_config, cache_config, download_dir)])
    streamed = getattr(model_config, "model_weights", "")
    if streamed and str(streamed) != str(model_config.model):
        return " ".join([*streamed_weights(model_config, download_dir),
                         *engine_settings(model_config, cache_config, download_dir)])
    parts = [str(model_config.model)]
    weights = model_fingerprint(str(model_config.model), getattr(model_config, "revision", None), download_dir)
    if weights:
        parts.append(f"weights={weights}")
    elif str(model_config.model) not in _unresolved:
        _unresolved.add(str(model_config.model))
        log.warning("radixkv: no local files for model %s: its KV is keyed by its name alone, so new weights "
                    "under that name would be served the old weights' KV (set `model` to name them)",
                    model_config.model)
    revision = getattr(model_config, "revision", None)
    if revision:
        parts.append(f"revision={revision}")
    return " ".join(parts + engine_settings(model_config, cache_config, download_dir))


def streamed_weights(model_config, download_dir: str | None = None) -> list[str]:
    """The weights' fields of the identity of a model vLLM streams from object storage
    (`model_weights`, e.g. an s3:// URI, while `model` is the local directory vLLM pulled
    the config files to): the URI, and a digest of those files (`files=`; the weights
    themselves are never here to fingerprint). Warns once per URI: new weights written
    to it are served the old weights' KV unless `model` names their version."""
    uri = str(model_config.model_weights)
    if uri not in _unresolved:
        _unresolved.add(uri)
        log.warning("radixkv: the weights of model %s are streamed, not read from local files, so radixkv cannot "
                    "fingerprint them: their KV is keyed by the URI and the config files alone, and new weights "
                    "written there would be served the old weights' KV (set `model` to name their version)", uri)
    files = model_fingerprint(str(model_config.model), None, download_dir)
    return [uri] + ([f"files={files}"] if files else [])


def engine_settings(model_config, cache_config=None, download_dir: str | None = None) -> list[str]:
    """The fields of the identity that an engine's settings give the same weights, none
    for the usual engine: its quantization when set; `hf_overrides` when given (they
    change the model's config, RoPE scaling included: a digest of them, or the function's
    name); a digest of the config files `hf_config_path` names where vLLM reads the
    model's config from there (`config=`, the path where none are found here); for a KV
    cache stored in another dtype than the model's (`cache_config.cache_dtype` not
    "auto") that dtype and the layers it skips (every quantized one, fp8_e4m3 and
    fp8_e5m2 alike, is uint8 in the layout) and the dtype the model computes in; and
    for a LongRoPE model the factor set `max_model_len` selects (`long_rope_choice`)."""
    parts = []
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        parts.append(f"quantization={quantization}")
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        parts.append(f"hf_overrides={getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', '?')}")
    elif overrides:
        parts.append(f"hf_overrides={_digest(overrides)}")
    config_path = getattr(model_config, "hf_config_path", None)
    if config_path and str(config_path) != str(model_config.model):
        revision = getattr(model_config, "_hf_config_revision", None) or getattr(model_config, "revision", None)
        parts.append(f"config={model_fingerprint(str(config_path), revision, download_dir) or config_path}")
    cache_dtype = getattr(cache_config, "cache_dtype", "auto") if cache_config is not None else "auto"
    if cache_dtype not in ("auto", None):
        parts.append(f"kv_cache_dtype={cache_dtype}")
        skipped = getattr(cache_config, "kv_cache_dtype_skip_layers", None)
        if skipped:
            parts.append(f"skip_layers={_digest(sorted(map(str, skipped)))}")
        parts.append(f"dtype={str(getattr(model_config, 'dtype', '?')).removeprefix('torch.')}")
    rope = long_rope_choice(model_config)
    if rope:
        parts.append(f"rope={rope}")
    return parts


def _digest(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def long_rope_choice(model_config) -> str | None:
    """"long" or "short": the RoPE factors vLLM computes a LongRoPE model's KV with (Phi-3
    128k and its kin: the long ones iff `max_model_len` passes the
    `original_max_position_embeddings` of its `rope_type` "longrope" parameters, vLLM's
    `Phi3LongRoPEScaledRotaryEmbedding`), so engines of one checkpoint started with
    another `max_model_len` never share KV; None for every other model (no RoPE
    variant but LongRoPE reads the engine's settings), whose identity stays as it was."""
    config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    # one dict, or one per layer type (vLLM's iter_rope_parameters)
    sets = [params] if "rope_type" in params else [p for p in params.values() if isinstance(p, dict)]
    limits = [p.get("original_max_position_embeddings") for p in sets if p.get("rope_type") == "longrope"]
    if not limits:
        return None
    max_model_len = getattr(model_config, "max_model_len", 0)
    return "long" if any(max_model_len > (limit or 0) for limit in limits) else "short"


def on_device(model: str, device: str, kv_cache_layout: str | None = None) -> str:
    """The identity registered for `model`'s KV computed on a `device` type ("cpu",
    "cuda") in vLLM's `kv_cache_layout` (resolved once per engine, e.g. NHD or HND by
    backend and GPU generation; None where vLLM names none), whatever `model` says: they
    order a block's bytes differently (CPU attention interleaves K and V per head, GPU
    backends hold K then V, HND puts heads before tokens), and the daemon sees them all
    as whole pages of one size, so a fleet mixing them on one store would load pages in
    another's order."""
    return f"{model} device={device}" + (f" kv_layout={kv_cache_layout}" if kv_cache_layout else "")


__all__ = ["INLINE_TOKEN", "TOKEN_ENV", "ConnectorConfig", "engine_settings", "long_rope_choice", "model_identity",
           "on_device", "streamed_weights"]
