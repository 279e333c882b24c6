"""What the connector can serve, checked once when vLLM builds it: a clear refusal at
startup instead of wrong KV later.

radixkv keys a page by the tokens of the prefix up to it, and copies block i of a request
as page i of the prompt. That holds for vLLM's full-attention KV cache on one pipeline
stage with one block per `block_size` tokens. It does not hold for:

- pipeline parallelism: each stage holds other layers under the same page keys, and
  every stage would register as the same rank of one namespace;
- decode or prefill context parallelism: a block holds `block_size` x the context
  ranks' tokens, interleaved over the ranks;
- sliding-window or chunked-local KV caches (a model whose layers are all such; in a
  hybrid model vLLM gives them full-attention blocks): vLLM frees the blocks outside
  the window while the request runs and names its null block in their place, so loads
  and saves would copy into and out of blocks that are not the request's;
- non-causal attention (prefix LMs): a prefix's KV depends on the tokens after it;
- MLA (DeepSeek-style) caches, whose layout the worker side does not describe yet.
"""

import logging

import vllm
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

TESTED_VLLM = (0, 32)  # the vLLM minor release the connector is tested with (pyproject's `vllm` extra)
log = logging.getLogger("vllm.radixkv")


def check_supported(vllm_config, kv_cache_config) -> None:
    """ValueError naming the first thing in vLLM's parallel or KV cache configuration the
    connector cannot serve (module docstring). `kv_cache_config` may be None (nothing to
    check of it)."""
    parallel = vllm_config.parallel_config
    for name, what in (("pipeline_parallel_size", "pipeline parallelism"),
                       ("decode_context_parallel_size", "decode context parallelism"),
                       ("prefill_context_parallel_size", "prefill context parallelism")):
        size = getattr(parallel, name, 1)
        if size > 1:
            raise ValueError(f"radixkv: {name} is {size}; the radixkv connector supports tensor parallelism "
                             f"only, not {what} (every stage's or rank's KV would be keyed as one): run "
                             f"without it, or without the connector")
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if isinstance(spec, MLAAttentionSpec):
            raise ValueError("radixkv: this model's KV cache is MLA (DeepSeek-style latent attention), which "
                             "the radixkv connector does not support yet")
        if not isinstance(spec, FullAttentionSpec):
            raise ValueError(f"radixkv: the KV cache group of layers {_names(group)} is {kind}; the radixkv "
                             "connector supports full-attention KV caches only (vLLM frees a sliding window's "
                             "or local chunk's blocks while the request runs)")
        if getattr(spec, "non_causal", False):
            raise ValueError(f"radixkv: layers {_names(group)} attend non-causally; a prefix's KV then depends "
                             "on the tokens after it and cannot be reused by prefix")


def check_version(version: str | None = None) -> bool:
    """Warn (once per connector) when vLLM is another release than the one the connector
    is tested with: it builds on vLLM's KV connector API and its scheduler's internals,
    which change between releases. True when it is that release."""
    version = vllm.__version__ if version is None else version
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:  # a source build ("dev", "0.32.1rc1+g...") parses far enough, or not at all
        release = None
    if release == TESTED_VLLM:
        return True
    log.warning("radixkv: the connector is tested with vLLM %d.%d, this is vLLM %s: its KV connector API may "
                "differ (a failure at startup or at the first request says where)", *TESTED_VLLM, version)
    return False


def _names(group) -> str:
    names = list(group.layer_names)
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


__all__ = ["TESTED_VLLM", "check_supported", "check_version"]
