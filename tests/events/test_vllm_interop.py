"""radixkv.routing reads a real vLLM publisher (vLLM's own ZmqEventPublisher and hashes)
beside a radixkv daemon of the same worker, and merges them by block hash: the engine's
GPU blocks and the daemon's CPU blocks form one prefix."""

import time

from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
from vllm.distributed.kv_events import BlockStored as VllmStored
from vllm.distributed.kv_events import KVEventBatch as VllmBatch
from vllm.distributed.kv_events import ZmqEventPublisher
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as vllm_utils

from radixkv.routing import Daemon, RoutingIndex, TierWeights, ZmqFleet
from radixkv_server.core.tree import RadixTree
from radixkv_server.events import EventHub, EventsConfig

from .helpers import PAGE, ipc_endpoints, packed, wait_for

NS = "llama/tp0"
PROMPT = list(range(5000, 5000 + 8 * PAGE))


def vllm_hashes(tokens):
    vllm_utils.init_none_hash(sha256_cbor)
    parent, out = None, []
    for i in range(len(tokens) // PAGE):
        parent = vllm_utils.hash_block_tokens(sha256_cbor, parent, tokens[i * PAGE:(i + 1) * PAGE])
        out.append(vllm_utils.maybe_convert_block_hash(parent))
    return out


def radixkv_daemon(name, first_page, last_page):
    """A daemon holding PROMPT's pages [first_page, last_page) on host (CPU)."""
    pub, rep = ipc_endpoints(name)
    hub = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep))
    tree = RadixTree(PAGE)
    parent = tree.root(b"")
    if first_page:
        parent = tree.add_child(parent, packed(PROMPT[:first_page * PAGE]))
    node = tree.add_child(parent, packed(PROMPT[first_page * PAGE:last_page * PAGE]))
    hub.attach(NS, PAGE)("host", "stored", node)
    hub.flush()
    return hub, Daemon(name, pub, rep)


def test_engine_gpu_events_and_daemon_cpu_events_merge_by_hash():
    engine_pub, engine_rep = ipc_endpoints("engine")
    engine = ZmqEventPublisher(0, endpoint=engine_pub, replay_endpoint=engine_rep, topic="")
    hub0, d0 = radixkv_daemon("w0", 4, 8)   # w0: blocks 4..7 on CPU (0..3 on its engine's GPU)
    hub1, d1 = radixkv_daemon("w1", 0, 6)   # w1: blocks 0..5 on CPU
    hashes = vllm_hashes(PROMPT)
    engine.publish(VllmBatch(ts=time.time(), events=[VllmStored(
        block_hashes=hashes[:4], parent_block_hash=None, token_ids=PROMPT[:4 * PAGE], block_size=PAGE,
        lora_id=None, medium="GPU", lora_name=None)]))
    index = RoutingIndex(PAGE, TierWeights(device=1.0, host=0.6, storage=0.3))
    fleet = ZmqFleet(index, [d0, d1, Daemon("w0", engine_pub, engine_rep, stream="engine", topic="",
                                             namespace=NS, media=("GPU",))], check_interval=0.2)
    try:
        wait_for(lambda: fleet.poll(0.02) >= 0 and index.num_blocks("w0", NS) == (4, 4, 0)
                 and index.num_blocks("w1", NS) == (0, 6, 0), 30, "both streams of w0 and w1")
        best = index.best(PROMPT, namespace=NS)
        assert (best.worker, best.device_blocks, best.host_blocks) == ("w0", 4, 4)
        assert best.score == 4 + 4 * 0.6

        # The engine resets its prefix cache: only w0's GPU blocks go, its CPU blocks stay.
        engine.publish(VllmBatch(ts=time.time(), events=[VllmCleared()]))
        wait_for(lambda: fleet.poll(0.02) >= 0 and index.num_blocks("w0", NS) == (0, 4, 0),
                 30, "the engine's clear")
        assert index.best(PROMPT, namespace=NS).worker == "w1"
        assert fleet.feeds["w0/engine"].num_resets == 0
    finally:
        fleet.close()
        engine.shutdown()
        hub0.close()
        hub1.close()


def test_daemon_restart_announcement_keeps_the_engine_gpu_blocks_seen_before_it():
    """The daemon's startup AllBlocksCleared arriving after the engine's GPU blocks (the
    order of two replays is a race) forgets only the tiers the daemon speaks for."""
    engine_pub, engine_rep = ipc_endpoints("engine")
    engine = ZmqEventPublisher(0, endpoint=engine_pub, replay_endpoint=engine_rep, topic="")
    hub0, d0 = radixkv_daemon("w0", 4, 8)
    engine.publish(VllmBatch(ts=time.time(), events=[VllmStored(
        block_hashes=vllm_hashes(PROMPT)[:4], parent_block_hash=None, token_ids=PROMPT[:4 * PAGE],
        block_size=PAGE, lora_id=None, medium="GPU", lora_name=None)]))
    index = RoutingIndex(PAGE)
    fleet = ZmqFleet(index, [Daemon("w0", engine_pub, engine_rep, stream="engine", topic="",
                                    namespace=NS, media=("GPU",))], check_interval=0.2)
    try:
        wait_for(lambda: fleet.poll(0.02) >= 0 and index.num_blocks("w0", NS) == (4, 0, 0),
                 30, "the engine's GPU blocks")
        fleet.add(d0)
        wait_for(lambda: fleet.poll(0.02) >= 0 and fleet.feeds["w0"].last_seq == 2, 30,
                 "the daemon's clear and CPU blocks")
        assert index.num_blocks("w0", NS) == (4, 4, 0)
    finally:
        fleet.close()
        engine.shutdown()
        hub0.close()
