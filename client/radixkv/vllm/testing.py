"""A tiny Llama with random weights, and the settings that run it on vLLM's CPU build.

No model hub is reachable from tests, CI or benchmarks, so they build a model locally:
`write_tiny_llama(dir)` saves a 2-layer Llama (head_dim 64, vocab 1024) with weights drawn
from a fixed seed, in `save_pretrained` format, and `write_tiny_lora(dir)` a random LoRA
adapter for it. The same arguments give the same bytes, so two vLLM instances (or a
restarted one) load the same model and compute the same KV.

vLLM runs it without a tokenizer: pass `skip_tokenizer_init=True` and prompts as
`{"prompt_token_ids": [...]}`. `CPU_ENV` holds the environment that starts a CPU engine in
seconds; set it before vLLM is imported (vLLM reads some of it at import).
"""

import os

# vLLM's CPU engine: OpenMP threads not pinned to cores (the machine is shared), and the
# engine core in this process (tests can then look at it). The KV cache size comes from
# `kv_cache_memory_bytes` (VLLM_CPU_KVCACHE_SPACE, if set, wins over it).
CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

VOCAB = 1024
HEAD_DIM = 64


def apply_cpu_env(env: dict[str, str] | None = None) -> None:
    """Set CPU_ENV (and `env`) in os.environ where not set already."""
    for key, value in {**CPU_ENV, **(env or {})}.items():
        os.environ.setdefault(key, value)


def write_tiny_llama(path: str, *, seed: int = 0, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, dtype: str = "float32",
                     max_positions: int = 8192, init_std: float = 0.2, sliding_window: int | None = None) -> str:
    """Write a random-weight Llama to directory `path` (created if missing) and return it.

    hidden size = num_heads * 64. `init_std` well above Llama's 0.02 makes the logits
    peaked, so greedy decoding does not hinge on rounding: outputs compare exactly
    between runs that compute the same values in a different order. Deterministic for
    equal arguments (torch's CPU generator seeded with `seed`). With `sliding_window`,
    every layer attends to that many tokens back (vLLM's `layer_types`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    window = {} if sliding_window is None else {
        "sliding_window": sliding_window, "layer_types": ["sliding_attention"] * num_layers}
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=num_heads * HEAD_DIM, intermediate_size=2 * num_heads * HEAD_DIM,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=HEAD_DIM, max_position_embeddings=max_positions, initializer_range=init_std,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype=dtype, **window)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_tiny_lora(path: str, *, seed: int = 1, rank: int = 8, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, scale: float = 0.5) -> str:
    """Write a random LoRA adapter (PEFT format: q, k, v and o projections) for the tiny
    Llama of the same shape to directory `path` and return it. Its K and V differ from the
    base model's, so KV computed with it must never serve the base model (or the reverse).
    Deterministic for equal arguments."""
    import json

    import torch
    from safetensors.torch import save_file

    hidden, kv = num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(num_layers):
        for proj, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv), ("o_proj", hidden)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * scale
            weights[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g) * scale
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}, f)
    return path


def engine_args(model: str, **overrides) -> dict:
    """Keyword arguments for `vllm.LLM` that run the tiny model on CPU quickly: no
    tokenizer, eager mode, a small KV cache, block size 128 (CPU needs a multiple of 32)."""
    args = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                max_model_len=4096, block_size=128, kv_cache_memory_bytes=64 << 20,
                seed=0, max_num_seqs=8)
    args.update(overrides)
    return args


def reset_prefix_cache(llm, *, reset_connector: bool = False, max_steps: int = 100_000) -> None:
    """Empty an `LLM`'s own prefix cache (and with `reset_connector`, radixkv's epoch for
    it). The blocks of a finished request whose saves are still in flight stay held until
    the engine step that reports the daemon's copy done, and vLLM refuses the reset while
    any block is held: so step the idle engine until it succeeds. RuntimeError if it never
    does."""
    if llm.reset_prefix_cache(reset_connector=reset_connector):  # the connector's reset runs either way
        return
    for _ in range(max_steps):
        llm.llm_engine.step()
        if llm.reset_prefix_cache():
            return
    raise RuntimeError("vLLM's prefix cache could not be reset: blocks never freed")


__all__ = ["CPU_ENV", "HEAD_DIM", "VOCAB", "apply_cpu_env", "engine_args", "reset_prefix_cache", "write_tiny_llama",
           "write_tiny_lora"]
