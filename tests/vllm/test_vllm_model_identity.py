"""KV computed by other weights or other RoPE factors is never served (real vLLM, real
daemon), even where the model's path and name stay the same (`radixkv.vllm.config.model_identity`).

radixkv's KV outlives the engine (host tier, storage) and is shared between engines, so
the identity that salts storage keys must name everything that changes the KV bytes.
What a user notices: an engine whose KV would differ gets no hit from what another saved
and the same output as without radixkv. Each case saves through one daemon with file
storage and loads through a fresh daemon on the same storage (a daemon restarted, or
another node of the fleet sharing the store): on one live daemon the second engine's
other identity is refused at Register instead (the namespace holds another model's KV).
Found by the LMCache-migration review (docs/testing.md).
"""

import json
import os
import shutil

import pytest

from radixkv.vllm.testing import write_tiny_llama, write_tiny_lora
from tests.support.daemon import wait_for

from tests.vllm.engines import connector_config, generate, prompt
from tests.vllm.test_vllm_connector import counters

PROMPT_TOKENS = 1024
HEAD_DIM = 64
ORIGINAL_MAX = 2048


def longrope_model(path: str) -> str:
    """The tiny Llama with Phi-3's LongRoPE: short factors up to `ORIGINAL_MAX` positions,
    long ones (far from 1, so the output changes) beyond."""
    write_tiny_llama(path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    rope = {"rope_type": "longrope", "short_factor": [1.0] * (HEAD_DIM // 2),
            "long_factor": [1.0 + 3.0 * i for i in range(HEAD_DIM // 2)],
            "original_max_position_embeddings": ORIGINAL_MAX}
    config.update(rope_scaling=rope, rope_parameters={**rope, "rope_theta": config.get("rope_theta", 10000.0)},
                  original_max_position_embeddings=ORIGINAL_MAX)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


def stored_daemons(daemon_factory, tmp_path):
    """start() -> a daemon on one file store (written through), so a later daemon finds
    what an earlier one saved."""
    flags = ("--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    return lambda: daemon_factory(*flags)


def save_and_stop(engines, daemon, p: list[int], settings: dict | None = None, **engine) -> tuple[int, ...]:
    """Generate `p` on an engine with radixkv on `daemon` (extra config `settings`), wait
    until its pages are stored and stop the daemon; the tokens it generated."""
    llm = engines.start(daemon.target, kv_transfer_config=connector_config(daemon.target, **(settings or {})), **engine)
    [out] = generate(llm, [p])
    engines.stop(llm)
    wait_for(lambda: counters(daemon.target)["stored_tokens"] >= PROMPT_TOKENS, 30, "pages stored")
    assert daemon.stop() == 0
    return out.tokens


@pytest.mark.parametrize("named", [None, "phi-like@v1"])
def test_a_longrope_engine_with_another_max_model_len_is_not_served_the_others_kv(
        engines, daemon_factory, tmp_path, named):
    """vLLM picks LongRoPE's short or long factors by max_model_len: the same tokens get
    other K, so engines that differ only there must not share KV; also where the
    settings name the weights (`model`, as a fleet with them at other paths does), a
    name that once replaced the whole identity, the engine's settings included."""
    model = longrope_model(str(tmp_path / "phi-like"))
    daemons = stored_daemons(daemon_factory, tmp_path)
    settings = {"model": named} if named else {}
    p = prompt(PROMPT_TOKENS, seed=51)
    short = save_and_stop(engines, daemons(), p, settings, model=model, max_model_len=ORIGINAL_MAX)

    reference = engines.start(model=model, max_model_len=2 * ORIGINAL_MAX)  # long factors, no radixkv
    [want] = generate(reference, [p])
    engines.stop(reference)
    assert want.tokens != short  # the factors change the output (the test's premise)

    target = daemons().target
    llm = engines.start(target, kv_transfer_config=connector_config(target, **settings), model=model,
                        max_model_len=2 * ORIGINAL_MAX)
    [got] = generate(llm, [p])
    assert (got.cached_tokens, got.tokens) == (0, want.tokens)


def test_only_longrope_models_name_their_factor_set_in_the_identity():
    """The choice joins the identity of LongRoPE models only: every other model keeps
    its identity, and so the storage keys of what it saved."""
    from types import SimpleNamespace

    from radixkv.vllm.config import model_identity

    def model(rope: dict | None, max_model_len: int):
        return SimpleNamespace(model="/models/phi", revision=None, quantization=None, hf_overrides=None,
                               max_model_len=max_model_len, hf_text_config=SimpleNamespace(rope_parameters=rope))

    longrope = {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL_MAX}
    assert model_identity(model(longrope, ORIGINAL_MAX)).endswith(" rope=short")
    assert model_identity(model(longrope, ORIGINAL_MAX + 1)).endswith(" rope=long")
    per_layer_type = {"full_attention": longrope, "sliding_attention": {"rope_type": "default"}}
    assert model_identity(model(per_layer_type, 4 * ORIGINAL_MAX)).endswith(" rope=long")
    for other in (None, {"rope_type": "default", "rope_theta": 1e4}, {"rope_type": "yarn", "factor": 4.0}):
        assert "rope=" not in model_identity(model(other, 4 * ORIGINAL_MAX))


def test_a_model_replaced_at_the_same_path_is_not_served_the_old_weights_kv(engines, daemon_factory, tmp_path):
    path = str(tmp_path / "models" / "current")
    daemons = stored_daemons(daemon_factory, tmp_path)
    p = prompt(PROMPT_TOKENS, seed=42)
    write_tiny_llama(path, seed=0)
    save_and_stop(engines, daemons(), p, model=path)

    shutil.rmtree(path)
    write_tiny_llama(path, seed=5)  # new weights of the same shape, deployed at the same path
    reference = engines.start(model=path)
    [want] = generate(reference, [p])
    engines.stop(reference)

    llm = engines.start(daemons().target, model=path)
    [got] = generate(llm, [p])
    assert (got.cached_tokens, got.tokens) == (0, want.tokens)


def test_a_lora_adapter_replaced_at_the_same_path_is_not_served_the_old_adapters_kv(
        engines, daemon_factory, tmp_path):
    from vllm.lora.request import LoRARequest
    path = str(tmp_path / "adapters" / "tenant-x")
    adapter = LoRARequest("tenant-x", 1, path)
    lora_engine = dict(enable_lora=True, max_lora_rank=8, max_loras=1)
    p = prompt(PROMPT_TOKENS, seed=41)
    daemon = daemon_factory()
    write_tiny_lora(path, seed=1)
    llm = engines.start(daemon.target, **lora_engine)
    [v1] = generate(llm, [p], lora_request=adapter)
    engines.stop(llm)

    shutil.rmtree(path)
    write_tiny_lora(path, seed=2)  # retrained, copied over the same path
    llm = engines.start(daemon.target, **lora_engine)  # the same daemon: its host tier holds v1's KV
    [v2] = generate(llm, [p], lora_request=adapter)
    engines.stop(llm)
    reference = engines.start(**lora_engine)  # v2 without radixkv
    [want] = generate(reference, [p], lora_request=adapter)
    assert want.tokens != v1.tokens  # the retrained adapter changes the output (the test's premise)
    assert (v2.cached_tokens, v2.tokens) == (0, want.tokens)


def test_fingerprints_follow_content_not_paths(tmp_path):
    """Identical files at two paths (or on two nodes) fingerprint alike; other weights of
    the same shape, or an adapter retrained in place, do not."""
    from radixkv.vllm.fingerprints import adapter_fingerprint, model_fingerprint

    a, b, c = (write_tiny_llama(str(tmp_path / name), seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 5)))
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(c)
    assert model_fingerprint(str(tmp_path / "nowhere")) is None
    # a hub id: the snapshot vLLM downloaded into the hub cache
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(a, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert model_fingerprint("org/tiny", cache_dir=str(tmp_path / "hub")) == model_fingerprint(a)
    assert model_fingerprint("org/other", cache_dir=str(tmp_path / "hub")) is None
    first, second = write_tiny_lora(str(tmp_path / "l1"), seed=1), write_tiny_lora(str(tmp_path / "l2"), seed=1)
    digest = adapter_fingerprint(first)
    assert digest == adapter_fingerprint(second)
    write_tiny_lora(first, seed=2)
    assert adapter_fingerprint(first) != digest


def test_kv_cache_dtypes_stored_as_the_same_bytes_have_other_identities(tmp_path):
    """vLLM stores every quantized KV cache (fp8_e4m3, fp8_e5m2, int8 per token-head, ...)
    as uint8, so the layout the daemon salts keys with is one for all of them, and the
    layers `kv_cache_dtype_skip_layers` keeps unquantized; engines that differ there once
    shared an identity, and so each other's pages read in another number format. vLLM's
    own config objects (fp8 needs AVX-512 on CPU, not here)."""
    from vllm.config import CacheConfig, ModelConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    from radixkv.vllm.config import model_identity

    dtypes = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head")
    assert {STR_DTYPE_TO_TORCH_DTYPE[d] for d in dtypes[:3]} == {STR_DTYPE_TO_TORCH_DTYPE["fp8"]}  # the premise
    model = ModelConfig(model=write_tiny_llama(str(tmp_path / "llama")))
    caches = [CacheConfig(cache_dtype=d) for d in dtypes]
    caches.append(CacheConfig(cache_dtype="fp8_e4m3", kv_cache_dtype_skip_layers=["0"]))
    identities = [model_identity(model, cache) for cache in caches]
    assert len(set(identities)) == len(caches)
    assert model_identity(model, CacheConfig()) == model_identity(model)  # auto: as before


def test_a_config_read_from_hf_config_path_is_part_of_the_identity(tmp_path):
    """vLLM reads the model's config from `hf_config_path` when given (another RoPE base
    here: other K for the same tokens), which the weights' fingerprint never saw; the
    same config at another path (content, not path) keeps the identity."""
    from vllm.config import ModelConfig

    from radixkv.vllm.config import model_identity

    path = write_tiny_llama(str(tmp_path / "llama"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    paths = [tmp_path / "config-a", tmp_path / "config-b"]
    for directory in paths:
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
    plain, a, b = (ModelConfig(model=path, hf_config_path=str(p) if p else None) for p in (None, *paths))
    assert a.hf_config.rope_parameters["rope_theta"] != plain.hf_config.rope_parameters["rope_theta"]
    assert model_identity(plain) != model_identity(a) == model_identity(b)


def test_weights_streamed_from_object_storage_are_named_by_their_uri_and_warned_about(tmp_path, caplog):
    """vLLM streams a model given as an object-storage URI (Run:ai, `model_weights`) and
    pulls only its config files to a local directory named by the URI, its `model`: that
    was keyed as a local model, by the config files' digest alone and without a word, so
    new weights written to the URI were served the old weights' KV. The URI names them
    (the same on every node), and a warning says to name their version in `model`."""
    from vllm.config import ModelConfig

    from radixkv.vllm.config import model_identity

    pulled = write_tiny_llama(str(tmp_path / "model_streamer" / "1f2e3d4c"))
    os.remove(os.path.join(pulled, "model.safetensors"))  # the streamer pulls config files only
    with caplog.at_level("WARNING", logger="vllm.radixkv"):
        identity = model_identity(ModelConfig(model=pulled, model_weights="s3://bucket/llama"))
    assert identity.split()[0] == "s3://bucket/llama" and pulled not in identity
    assert "s3://bucket/llama are streamed" in caplog.text and "set `model`" in caplog.text
