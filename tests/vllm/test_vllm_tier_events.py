"""vLLM's own KV events name radixkv's host tier too (`radixkv.vllm.tier_events`), with
real vLLM and a real daemon: a router that follows only the engines' streams (as Dynamo
and llm-d do) sees a prompt's blocks on the GPU of the engine that computed it and on the
CPU of every engine that can load it, also of an engine started later; when the daemon
dies the CPU blocks are withdrawn (the GPU blocks stay), and once it is back new blocks
are announced again. Events reach the router when the engine steps (vLLM takes them once
per step), so each check runs a request first.
"""

from radixkv.routing import Daemon, RoutingIndex, ZmqFleet
from tests.events.helpers import ipc_endpoints
from tests.support.daemon import wait_for

from tests.vllm.engines import generate, prompt

PROMPT_TOKENS = 1024
BLOCK = 128
BLOCKS = PROMPT_TOKENS // BLOCK
SETTLE_S = 30


class Router:
    """radixkv.routing following vLLM engines' own event streams only (one per worker)."""

    def __init__(self):
        self.index = RoutingIndex(BLOCK)
        self.fleet = ZmqFleet(self.index, [], check_interval=0.2)

    def follow(self, worker: str, endpoints: tuple[str, str]) -> None:
        self.fleet.add(Daemon(worker, *endpoints, stream="engine", topic="", namespace="tiny",
                              media=("GPU", "CPU", "STORAGE")))

    def held(self, worker: str, medium: str, tokens) -> int:
        """How many of `tokens`' blocks the router believes `worker` holds on `medium`."""
        self.fleet.poll(0.02)
        return len(set(self.index.hashes(tokens)) & self.index.blocks(worker, "tiny", medium))

    def close(self) -> None:
        self.fleet.close()


def start_engine(engines, daemon, name: str):
    from vllm.config import KVEventsConfig
    endpoints = ipc_endpoints(name)
    llm = engines.start(daemon.target, prefix_caching_hash_algo="sha256_cbor",
                        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                        endpoint=endpoints[0], replay_endpoint=endpoints[1],
                                                        topic=""))
    return llm, endpoints


def test_engines_streams_name_the_daemons_host_blocks_and_withdraw_them_when_it_dies(engines, daemon_factory,
                                                                                   monkeypatch):
    # Two engines at once: each engine core (with its worker connector) in a process of its
    # own, as vLLM runs by default; one process takes one engine with a connector.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    daemon = daemon_factory("--kv-events-watch", "true")
    router = Router()
    try:
        first, endpoints = start_engine(engines, daemon, "tier-first")
        router.follow("w0", endpoints)
        p = prompt(PROMPT_TOKENS, seed=41)
        generate(first, [p])
        generate(first, [prompt(PROMPT_TOKENS, seed=42)])  # a step after p's save was answered
        wait_for(lambda: router.held("w0", "GPU", p) == BLOCKS and router.held("w0", "CPU", p) == BLOCKS,
                 SETTLE_S, "the engine's stream to name p on its GPU and on radixkv's host tier")

        second, endpoints = start_engine(engines, daemon, "tier-second")  # never computed p
        router.follow("w1", endpoints)
        generate(second, [prompt(PROMPT_TOKENS, seed=43)])
        wait_for(lambda: router.held("w1", "CPU", p) == BLOCKS, SETTLE_S,
                 "the later engine's stream to name p on the host tier (from the daemon's snapshot)")
        assert router.held("w1", "GPU", p) == 0
        assert router.index.best(p, namespace="tiny").worker == "w0"  # GPU outweighs host

        daemon.kill()
        for n, llm in enumerate((first, second)):  # vLLM keeps serving without the daemon
            generate(llm, [prompt(PROMPT_TOKENS, seed=44 + n)])
        wait_for(lambda: router.held("w0", "CPU", p) == router.held("w1", "CPU", p) == 0, SETTLE_S,
                 "both engines to withdraw the host tier of the dead daemon")
        assert router.held("w0", "GPU", p) == BLOCKS  # what vLLM itself holds stays

        daemon.restart()
        q = prompt(PROMPT_TOKENS, seed=46)

        def announced_again() -> bool:
            generate(first, [q])  # saved once the connector is registered again, announced on a later step
            return router.held("w0", "CPU", q) == BLOCKS

        wait_for(announced_again, SETTLE_S, "the engine to follow the restarted daemon")
    finally:
        router.close()
