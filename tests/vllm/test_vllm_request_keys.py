"""KV computed under a LoRA adapter, a cache salt, other multimodal inputs or prompt
embeddings is never served to a request without them (real vLLM, real daemon), as vLLM's
own prefix cache keys them (`radixkv.vllm.request_keys`).

What a user notices: a request under another adapter or salt gets no radixkv hit and the
same output as without radixkv; under the same adapter or salt it hits (after a daemon
restart too, from file storage); a request with prompt embeddings never reaches radixkv;
after vLLM's connector reset (a weight update) nothing saved before is served again.
Multimodal keys are checked on vLLM's own request objects (no multimodal model here).
"""

import pytest
import torch

from radixkv.vllm.request_keys import cacheable, extra_key, key_of, prompt_key
from radixkv.vllm.testing import reset_prefix_cache, write_tiny_lora
from tests.support.daemon import wait_for

from tests.vllm.engines import generate, prompt, vllm_metric
from tests.vllm.test_vllm_connector import counters

PROMPT_TOKENS = 1024
BLOCK = 128
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


def salted(tokens: list[int], salt: str | None) -> dict:
    return {"prompt_token_ids": tokens, **({"cache_salt": salt} if salt else {})}


def test_a_cache_salt_separates_what_radixkv_serves_also_from_storage(engines, daemon_factory, tmp_path):
    flags = ("--storage", f"file://{tmp_path}/pages", "--storage-policy", "write_through")
    p = prompt(PROMPT_TOKENS, seed=31)
    first = daemon_factory(*flags)
    llm = engines.start(first.target)
    [cold] = generate(llm, [salted(p, "tenant-a")])
    engines.stop(llm)
    wait_for(lambda: counters(first.target)["stored_tokens"] >= PROMPT_TOKENS, 30, "pages stored")
    assert first.stop() == 0

    second = daemon_factory(*flags)  # empty host tier: a hit has to come from storage
    llm = engines.start(second.target)
    [other] = generate(llm, [salted(p, "tenant-b")])
    [plain] = generate(llm, [p])
    assert other.cached_tokens == plain.cached_tokens == 0  # neither reads tenant-a's KV
    [same] = generate(llm, [salted(p, "tenant-a")])
    assert same.cached_tokens == CACHEABLE  # from radixkv: vLLM's own cache holds only the others
    assert cold.tokens == other.tokens == plain.tokens == same.tokens
    assert counters(second.target)["prefetched_tokens"] >= CACHEABLE


def test_kv_of_a_lora_adapter_never_serves_the_base_model_nor_the_reverse(engines, daemon, tmp_path):
    from vllm.lora.request import LoRARequest
    adapter = LoRARequest("tiny-adapter", 1, write_tiny_lora(str(tmp_path / "lora")))
    lora_engine = dict(enable_lora=True, max_lora_rank=8, max_loras=1)
    p, q = prompt(PROMPT_TOKENS, seed=32), prompt(PROMPT_TOKENS, seed=33)

    reference = engines.start(**lora_engine)  # no radixkv
    [base_p, base_q] = generate(reference, [p, q])
    [tuned_p, tuned_q] = generate(reference, [p, q], lora_request=adapter)
    engines.stop(reference)
    assert base_p.tokens != tuned_p.tokens  # the adapter changes the KV and the output

    llm = engines.start(daemon.target, **lora_engine)
    generate(llm, [p], lora_request=adapter)  # p saved under the adapter
    generate(llm, [q])                        # q saved for the base model
    engines.stop(llm)

    llm = engines.start(daemon.target, **lora_engine)  # vLLM's own cache empty
    [p_base, q_tuned] = generate(llm, [p]) + generate(llm, [q], lora_request=adapter)
    assert p_base.cached_tokens == q_tuned.cached_tokens == 0
    assert (p_base.tokens, q_tuned.tokens) == (base_p.tokens, tuned_q.tokens)
    [p_tuned, q_base] = generate(llm, [p], lora_request=adapter) + generate(llm, [q])
    assert p_tuned.cached_tokens == q_base.cached_tokens == CACHEABLE
    assert (p_tuned.tokens, q_base.tokens) == (tuned_p.tokens, base_q.tokens)


def test_a_request_with_prompt_embeddings_never_reaches_radixkv(engines, daemon):
    llm = engines.start(daemon.target, enable_prompt_embeds=True, disable_log_stats=False)
    embeds = torch.randn(PROMPT_TOKENS, 256, generator=torch.Generator().manual_seed(34))
    [first] = generate(llm, [{"prompt_embeds": embeds}])
    [again] = generate(llm, [{"prompt_embeds": embeds}])
    assert first.tokens == again.tokens
    assert vllm_metric(llm, "vllm:radixkv_lookups_total") == 0
    assert vllm_metric(llm, "vllm:radixkv_save_blocks_total") == 0
    assert counters(daemon.target)["inserted_tokens"] == 0


def test_a_router_merges_vllms_own_events_with_the_daemons_for_lora_and_salted_requests(
        engines, daemon_factory, tmp_path):
    """vLLM's own KV events (its GPU blocks) and the daemon's (CPU) name a LoRA request's
    blocks under a cache salt by the same hashes, so a router following both streams of
    the worker (radixkv.routing over ZMQ) sees one prefix on both tiers; it scores the
    request with `key_of(lora_name=, lora_path=, cache_salt=)` and finds nothing under
    another salt or without the adapter."""
    from vllm.config import KVEventsConfig
    from vllm.lora.request import LoRARequest

    from radixkv.routing import Daemon, RoutingIndex, ZmqFleet
    from tests.events.helpers import ipc_endpoints
    pub, replay = ipc_endpoints("tuned-daemon")
    engine_pub, engine_replay = ipc_endpoints("tuned-engine")
    daemon = daemon_factory("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)
    index = RoutingIndex(BLOCK)
    fleet = ZmqFleet(index, [Daemon("w0", pub, replay),
                             Daemon("w0", engine_pub, engine_replay, stream="engine", topic="",
                                    namespace="tiny", media=("GPU",))], check_interval=0.2)
    try:
        adapter = LoRARequest("tiny-adapter", 1, write_tiny_lora(str(tmp_path / "lora")))
        llm = engines.start(daemon.target, enable_lora=True, max_lora_rank=8, max_loras=1,
                            prefix_caching_hash_algo="sha256_cbor",
                            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                            endpoint=engine_pub, replay_endpoint=engine_replay,
                                                            topic=""))
        p = prompt(PROMPT_TOKENS, seed=36)
        generate(llm, [salted(p, "tenant-a")], lora_request=adapter)
        key = key_of(lora_name=adapter.lora_name, lora_path=adapter.lora_path, cache_salt="tenant-a")
        hashes = index.hashes(p, key)
        assert len(hashes) == PROMPT_TOKENS // BLOCK
        wait_for(lambda: fleet.poll(0.02) >= 0 and set(hashes) <= index.blocks("w0", "tiny", "GPU")
                 and set(hashes) <= index.blocks("w0", "tiny", "CPU"), 30,
                 "vLLM's GPU events and the daemon's CPU events of the tuned, salted prompt")
        assert index.best(p, namespace="tiny", extra_key=key).device_blocks == len(hashes)
        for other in (key_of(lora_name=adapter.lora_name, lora_path=adapter.lora_path, cache_salt="tenant-b"),
                      key_of(cache_salt="tenant-a"), b""):
            assert index.best(p, namespace="tiny", extra_key=other).prefix_blocks == 0
    finally:
        fleet.close()


def test_after_a_connector_reset_nothing_saved_before_is_served_to_that_engine(engines, daemon):
    """RL frameworks update vLLM's weights in place, then reset_prefix_cache(reset_connector=True):
    KV saved under the old weights must not come back; what is saved after the reset does."""
    p = prompt(PROMPT_TOKENS, seed=35)
    llm = engines.start(daemon.target)
    generate(llm, [p])
    reset_prefix_cache(llm, reset_connector=True)
    [after] = generate(llm, [p])
    assert after.cached_tokens == 0  # neither vLLM's cache nor radixkv's old KV
    reset_prefix_cache(llm)  # vLLM's own cache only
    [again] = generate(llm, [p])
    assert again.cached_tokens == CACHEABLE  # what was saved after the reset
    engines.stop(llm)
    fresh = engines.start(daemon.target)  # loads the weights from the model's path again
    [first] = generate(fresh, [p])
    assert first.cached_tokens == CACHEABLE


# -- keys on vLLM's own request objects ----------------------------------------------------

def request(tokens: list[int], **fields):
    from vllm import SamplingParams
    from vllm.v1.request import Request
    return Request("r", tokens, SamplingParams(max_tokens=1), None, **fields)


def image(identifier: str, offset: int, length: int):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def packed(tokens: list[int]) -> bytes:
    return torch.tensor(tokens, dtype=torch.int32).numpy().tobytes()


def test_multimodal_inputs_key_the_tokens_from_where_each_input_starts():
    tokens = [7] * 100 + [9] * 50 + [7] * 100  # 50 placeholder tokens at 100
    plain = packed(tokens)
    cat = prompt_key(plain, request(tokens, mm_features=[image("cat", 100, 50)]))
    dog = prompt_key(plain, request(tokens, mm_features=[image("dog", 100, 50)]))
    cat_again = prompt_key(plain, request(tokens, mm_features=[image("cat", 100, 50)]))
    assert cat == cat_again  # the same input at the same place: the same key
    assert cat.tokens[:400] == dog.tokens[:400] == plain[:400]  # the text before it is shared
    assert cat.tokens[400:600] != dog.tokens[400:600] and cat.tokens[400:600] != plain[400:600]
    assert cat.tokens[600:] == plain[600:]  # tokens after it keep their ids (the prefix differs)
    assert prompt_key(plain[:400], request(tokens, mm_features=[image("cat", 100, 50)])).tokens == plain[:400]


@pytest.mark.parametrize("fields", [{"cache_salt": "a"}, {"lora_request": ("x", "/a")}])
def test_extra_keys_differ_by_salt_and_adapter_and_are_empty_without(fields):
    from vllm.lora.request import LoRARequest

    def fields_of(f: dict) -> dict:
        if "lora_request" in f:
            name, path = f["lora_request"]
            return {"lora_request": LoRARequest(name, 1, path)}
        return f

    tokens = [5] * 16
    key = extra_key(request(tokens, **fields_of(fields)))
    assert key and extra_key(request(tokens)) == b""
    other = {"cache_salt": "b"} if "cache_salt" in fields else {"lora_request": ("x", "/b")}
    assert extra_key(request(tokens, **fields_of(other))) != key
    assert cacheable(request(tokens, **fields_of(fields)))
    plain = {"cache_salt": fields.get("cache_salt")} if "cache_salt" in fields else {
        "lora_name": fields["lora_request"][0], "lora_path": fields["lora_request"][1]}
    assert key_of(**plain) == key  # what a router computes without vLLM's objects


def test_a_key_longer_than_the_vllm_form_allows_is_sent_hashed_and_stays_apart():
    """An end user's cache_salt has no bound in vLLM, nor has an adapter's path: keys past
    1 KiB are hashed to 16 bytes (the daemon refuses keys past --max-extra-key-bytes, and
    one refused key failed the whole step's lookups); different salts stay apart."""
    from radixkv.vllm.request_keys import MAX_VLLM_FORM_BYTES

    short = key_of(cache_salt="s" * 100)
    assert len(short) > 100  # the vLLM form, as before
    long_keys = {key_of(cache_salt="s" * 5000), key_of(cache_salt="s" * 5001),
                 key_of(lora_name="adapter", lora_path="/" + "p" * 4094)}
    assert len(long_keys) == 3 and all(len(k) == 16 for k in long_keys)
    assert len(key_of(cache_salt="s" * (MAX_VLLM_FORM_BYTES - 20))) <= MAX_VLLM_FORM_BYTES


def test_a_streaming_sessions_later_chunk_keys_its_own_multimodal_inputs():
    """A streaming-input session (vLLM's resumable request: the realtime API) grows with
    each chunk through vLLM's own `_update_request_as_session`. Two sessions whose first
    chunks match and whose second chunks carry other audio behind the same placeholders
    must not be looked up under one key: one would be served the other's KV."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import StreamingUpdate

    from radixkv.vllm.scheduler import SchedulerSide

    class RecordedLookups:
        """Stands in for the connector's Lookups: keeps the key each lookup would send."""
        sent: dict = {}

        def poll(self, req_id, tokens):
            self.sent[req_id] = tokens()
            return None  # in flight

    bs = 16
    init_none_hash(sha256)
    side = SchedulerSide(bs, 1, RecordedLookups(), lambda: None)
    vllm_scheduler = SimpleNamespace(hash_block_size=bs, log_stats=False, num_waiting_for_streaming_input=0)
    first_chunk = [5] * 40 + [9] * 32
    for session, audio in (("alice", "audio-of-alice"), ("bob", "audio-of-bob")):
        r = request(list(first_chunk), mm_features=[image("same-first-chunk", 40, 32)], resumable=True,
                    block_hasher=get_request_block_hasher(bs, sha256))
        r.request_id = session
        side.matched(r, 0)  # the first chunk's lookup
        r.num_computed_tokens = len(first_chunk)
        r.append_output_token_ids(11)
        Scheduler._update_request_as_session(vllm_scheduler, r, StreamingUpdate(
            mm_features=[image(audio, 8, 64)], prompt_token_ids=[6] * 8 + [9] * 64 + [6] * 20, max_tokens=4,
            arrival_time=0.0, sampling_params=SamplingParams(max_tokens=4)))
        side.matched(r, r.num_computed_tokens)  # the next chunk's lookup
    alice, bob = RecordedLookups.sent["alice"], RecordedLookups.sent["bob"]
    assert len(alice.tokens) == len(bob.tokens) == 160 * 4  # the whole blocks before the last token
    assert alice.tokens[:72 * 4] == bob.tokens[:72 * 4]  # the first chunk is shared
    assert alice.tokens != bob.tokens, "the sessions with other audio in their second chunk share a key"
