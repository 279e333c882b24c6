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

from radixkv.vllm.testing import write_tiny_llama
from tests.support.daemon import wait_for

from tests.vllm.engines import generate, prompt
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


def save_and_stop(engines, daemon, p: list[int], **engine) -> tuple[int, ...]:
    """Generate `p` on an engine with radixkv on `daemon`, wait until its pages are
    stored and stop the daemon; the tokens it generated."""
    llm = engines.start(daemon.target, **engine)
    [out] = generate(llm, [p])
    engines.stop(llm)
    wait_for(lambda: counters(daemon.target)["stored_tokens"] >= PROMPT_TOKENS, 30, "pages stored")
    assert daemon.stop() == 0
    return out.tokens


def test_a_longrope_engine_with_another_max_model_len_is_not_served_the_others_kv(
        engines, daemon_factory, tmp_path):
    """vLLM picks LongRoPE's short or long factors by max_model_len: the same tokens get
    other K, so engines that differ only there must not share KV."""
    model = longrope_model(str(tmp_path / "phi-like"))
    daemons = stored_daemons(daemon_factory, tmp_path)
    p = prompt(PROMPT_TOKENS, seed=51)
    short = save_and_stop(engines, daemons(), p, model=model, max_model_len=ORIGINAL_MAX)

    reference = engines.start(model=model, max_model_len=2 * ORIGINAL_MAX)  # long factors, no radixkv
    [want] = generate(reference, [p])
    engines.stop(reference)
    assert want.tokens != short  # the factors change the output (the test's premise)

    llm = engines.start(daemons().target, model=model, max_model_len=2 * ORIGINAL_MAX)
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
