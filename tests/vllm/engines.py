"""vLLM engines for tests: start one (with or without radixkv), generate greedily,
shut it down so its connector closes its session.

`Result` keeps what a user of vLLM sees per request: the generated tokens, their
logprobs, and how many prompt tokens vLLM reported as cached. `vllm_metric` and
`vllm_histogram` read what an engine started with `disable_log_stats=False` shows on its
/metrics.
"""

import random
from dataclasses import dataclass

from radixkv.vllm.testing import VOCAB, engine_args


@dataclass(frozen=True)
class Result:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached_tokens: int


def prompt(n: int, seed: int) -> list[int]:
    """`n` random token ids (avoiding the special ids 0-2), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def connector_config(target: str, namespace: str = "tiny", **extra) -> dict:
    """kv_transfer_config naming radixkv.vllm, as a user passes it."""
    return {"kv_connector": "RadixKVConnector", "kv_connector_module_path": "radixkv.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"target": target, "namespace": namespace, **extra}}


class Engines:
    """Starts vLLM engines on one model; `stop_all` shuts every one down."""

    def __init__(self, model: str):
        self.model = model
        self._live = []

    def start(self, target: str | None = None, **overrides):
        """An engine (of `model=` when given, else this Engines' model); with `target`,
        connected to the radixkv daemon there."""
        from vllm import LLM
        from vllm.distributed.kv_transfer.kv_transfer_state import (ensure_kv_transfer_shutdown,
                                                                    has_kv_transfer_group)
        if target is not None:
            overrides.setdefault("kv_transfer_config", connector_config(target))
        had_connector = has_kv_transfer_group()  # a live engine's, which a failed start keeps
        try:
            llm = LLM(**engine_args(overrides.pop("model", self.model), **overrides))
        except BaseException:
            # An engine that failed to start leaves its worker's connector registered in
            # this process (vLLM's engine core runs here in tests): drop it.
            if not had_connector:
                ensure_kv_transfer_shutdown()
            raise
        self._live.append(llm)
        return llm

    def stop(self, llm) -> None:
        """Shut the engine down (its connector closes its daemon session)."""
        if llm in self._live:
            self._live.remove(llm)
            llm.llm_engine.engine_core.shutdown()

    def stop_all(self) -> None:
        for llm in list(self._live):
            self.stop(llm)


def generate(llm, prompts: list, max_tokens: int = 8, **options) -> list[Result]:
    """Greedy generation; one Result per prompt, in order. A prompt is a list of token
    ids or a vLLM prompt dict (`cache_salt`, `prompt_embeds`, ...); `options` pass on to
    `LLM.generate` (`lora_request`)."""
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
    inputs = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False, **options)
    results = []
    for out in outs:
        o = out.outputs[0]
        lps = tuple(step[tok].logprob for step, tok in zip(o.logprobs, o.token_ids))
        results.append(Result(tuple(o.token_ids), lps, out.num_cached_tokens or 0))
    return results


def vllm_metric(llm, name: str, **labels: str) -> float:
    """The sum of the series of counter or gauge `name` (a counter with or without its
    `_total`) whose labels include `labels`, in the engine's Prometheus registry."""
    name = name.removesuffix("_total")
    return sum(m.value for m in llm.get_metrics()
               if m.name.removesuffix("_total") == name and labels.items() <= m.labels.items())


def vllm_histogram(llm, name: str, **labels: str) -> tuple[int, float]:
    """(observations, their sum) of histogram `name`'s series whose labels include
    `labels`, in the engine's Prometheus registry."""
    found = [m for m in llm.get_metrics() if m.name == name and labels.items() <= m.labels.items()]
    return sum(m.count for m in found), sum(m.sum for m in found)
