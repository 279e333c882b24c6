"""What vLLM's scheduler learns from the connector about blocks that come back later
(real vLLM, real daemon whose copies start late).

A request that finishes while its saves still read its blocks keeps them until every
worker reports the saves over. Meanwhile `has_pending_block_frees` tells vLLM's
scheduler that blocks are on their way, so under memory pressure it waits a step rather
than preempting a running request; and radixkv, a cache rather than a hand-off, does
not ask vLLM to drop a preempted request's sampled tokens (`requires_kv_delivery`).
"""

from vllm import SamplingParams

from tests.support.daemon import wait_for
from tests.vllm.engines import connector_config, prompt

PROMPT_TOKENS = 1024


def test_a_finished_request_whose_saves_are_in_flight_tells_vllm_its_blocks_are_coming(engines, daemon_factory):
    daemon = daemon_factory("--fault-copy-delay", "0.5")  # each copy starts 0.5 s late
    llm = engines.start(kv_transfer_config=connector_config(daemon.target))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # vLLM's engine core runs in this process here
    connector = scheduler.connector
    assert connector.requires_kv_delivery is False
    assert not connector.has_pending_block_frees()

    rid = engine.add_request("r", {"prompt_token_ids": prompt(PROMPT_TOKENS, seed=71)}, SamplingParams(max_tokens=1))
    finished = []
    wait_for(lambda: finished.extend(o for o in engine.step() if o.finished) or finished, 30, "the request finished")
    assert rid in scheduler.requests  # its blocks stay while the daemon copies out of them
    assert connector.has_pending_block_frees()
    wait_for(lambda: engine.step() is not None and rid not in scheduler.requests, 30, "its blocks freed")
    assert not connector.has_pending_block_frees()
