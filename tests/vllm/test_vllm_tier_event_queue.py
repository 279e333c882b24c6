"""`radixkv.vllm.tier_events.TierEvents` against a real daemon, without an engine that
steps: the events vLLM does not take are bounded, and what the router was told is
withdrawn and then announced again from a snapshot once vLLM takes."""

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from radixkv.routing.blockhash import block_hashes
from radixkv.vllm.tier_events import TierEvents
from tests.support.daemon import wait_for
from tests.support.engine import PS, EngineDouble

NS = "tier/tp0"


def held(events, prompts) -> tuple[set[int], set[int]]:
    """Which prompts' blocks are all on CPU after `events`, and the CPU block hashes."""
    cpu: set[int] = set()
    for e in events:
        if e.medium != "CPU":
            continue
        if isinstance(e, BlockStored):
            cpu.update(e.block_hashes)
        else:
            assert isinstance(e, BlockRemoved)
            cpu.difference_update(e.block_hashes)
    return {i for i, tokens in enumerate(prompts) if set(block_hashes(tokens, PS)) <= cpu}, cpu


def test_untaken_events_are_bounded_then_withdrawn_and_announced_again(daemon_factory):
    d = daemon_factory("--kv-events-watch", "true", "--write-policy", "write_through")
    engine = EngineDouble.connect(d.target, NS)
    tier = TierEvents(d.target, NS, max_pending=4)
    prompts = [[1000 * i + t for t in range(2 * PS)] for i in range(9)]
    try:
        engine.prefill(prompts[0])
        seen: list = []
        wait_for(lambda: seen.extend(tier.take()) or 0 in held(seen, prompts)[0], 30, "the first prompt on host")
        for p in prompts[1:]:  # vLLM takes nothing meanwhile
            engine.prefill(p)
        wait_for(lambda: tier.num_overflows == 1, 30, "the queue to overflow")
        withdrawn = tier.take()  # what the router was told goes, and nothing of the dropped events
        assert withdrawn and all(isinstance(e, BlockRemoved) for e in withdrawn)
        assert held(seen + withdrawn, prompts)[1] == set()
        after: list = []
        wait_for(lambda: after.extend(tier.take()) or held(after, prompts)[0] == set(range(9)), 30,
                 "every prompt announced again from a snapshot")
        assert tier.num_streams == 2 and tier.num_overflows == 1  # the snapshot fits whatever its size
    finally:
        tier.close()
        engine.close()


def test_a_daemon_without_events_leaves_vllms_stream_as_it_is(daemon_factory, caplog):
    d = daemon_factory()  # no --kv-events-watch
    tier = TierEvents(d.target, NS)
    try:
        tier._thread.join(30)
        assert not tier._thread.is_alive() and tier.take() == []
        assert "publishes no KV events" in caplog.text and "--kv-events-watch true" in caplog.text
    finally:
        tier.close()


def test_a_daemon_that_asks_for_a_token_gets_the_connectors(daemon_factory):
    """The connector's token (and TLS) go on the events channel as on its others (the
    connector opens its relay with `for_connector`): it once opened a plain channel
    without them, and a daemon with tokens refused the relay for good (UNAUTHENTICATED,
    warned every second)."""
    from radixkv.client import Client
    from radixkv.vllm.config import ConnectorConfig

    d = daemon_factory("--kv-events-watch", "true", "--write-policy", "write_through", "--auth-token", "s3cret")
    engine = EngineDouble()
    engine.register(Client(d.target, timeout=10, token="s3cret"), NS)
    tier = TierEvents.for_connector(ConnectorConfig(target=d.target, namespace=NS, token="s3cret"))
    prompt = [7000 + t for t in range(2 * PS)]
    try:
        engine.prefill(prompt)
        seen: list = []
        wait_for(lambda: seen.extend(tier.take()) or 0 in held(seen, [prompt])[0], 30, "the prompt on host")
    finally:
        tier.close()
        engine.close()
