"""Section `routing`: the routing index at fleet scale, update rate and query time at 1M
blocks across 16 workers.

    .venv/bin/python -m bench --quick --only routing   # the section (1M x 16; tiny: 20k)
    .venv/bin/python -m bench.routing                  # the same, plus the daemon's side
    .venv/bin/python -m bench.routing --blocks 100000 --json out.json

Conversations of 2k tokens (block size 16, 128 blocks) in groups that share a 64-block
system prompt; each conversation lives on one worker, on GPU, CPU or STORAGE (50/30/20),
and every system prompt is also held by 3 more workers. Updates are applied as the
decoded msgpack batches a feed receives (one BlockStored per 64-block node); queries are
2k-token prompts (a cached conversation plus a fresh turn) scored across all workers.
Times are CPU time of this thread (`time.thread_time`), so a busy machine stretches the
wall clock but not the figures. The daemon-side figures (`publisher_side`, `hot_path`) run
only from `python -m bench.routing`: the engine path with events on is section `events`.
"""

import argparse
import json
import random
import resource
import statistics
import time

import numpy as np

from radixkv.routing import RoutingIndex
from radixkv.routing.blockhash import block_digests, external_hash
from radixkv.routing.wire import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

from .figures import Figure, Section, Table, fmt
from .timing import progress

BLOCK = 16
HALF = 64            # blocks per node: system prompt, then the conversation's own part
GROUP = 8            # conversations per system prompt
MEDIA = ("GPU", "CPU", "STORAGE")
BLOCKS = {"tiny": 20_000, "quick": 1_000_000, "full": 1_000_000}  # block entries in the index
QUERIES = {"tiny": 50, "quick": 500, "full": 2000}
WORKERS = 16
SMALL = 64  # the query-flatness baseline: an index this many times smaller


def build_fleet(num_blocks: int, workers: int, rng: random.Random):
    """Payloads per worker and the conversations' tokens (for queries)."""
    # entries per conversation: its own 64 blocks + a share of a system prompt held by 4
    conversations = max(1, num_blocks // (HALF + 4 * HALF // GROUP))
    payloads: dict[str, list[bytes]] = {f"w{i}": [] for i in range(workers)}
    convs = []
    np_rng = np.random.default_rng(rng.randrange(2**32))
    for g in range(0, conversations, GROUP):
        system = np_rng.integers(0, 150_000, HALF * BLOCK)
        sys_digests = block_digests(system, BLOCK)
        sys_hashes = [external_hash(d) for d in sys_digests]
        holders = rng.sample(range(workers), min(4, workers))
        for w in holders:
            payloads[f"w{w}"].append(_stored(sys_hashes, None, system, "GPU"))
        for c in range(g, min(g + GROUP, conversations)):
            own = np_rng.integers(0, 150_000, HALF * BLOCK)
            hashes = [external_hash(d) for d in block_digests(own, BLOCK, parent=sys_digests[-1])]
            medium = rng.choices(MEDIA, weights=(5, 3, 2))[0]
            payloads[f"w{holders[0]}"].append(_stored(hashes, sys_hashes[-1], own, medium))
            convs.append((np.concatenate([system, own]), hashes, holders[0], medium))
    return payloads, convs


def _stored(hashes, parent, tokens, medium) -> bytes:
    event = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens.tolist(),
                        block_size=BLOCK, lora_id=None, medium=medium, lora_name=None)
    return encode_batch(KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=0))


clock = time.thread_time


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def apply_all(index: RoutingIndex, payloads: dict[str, list[bytes]]) -> dict:
    """Decode and apply every worker's batches, as feeds do."""
    rss0 = rss_mib()
    blocks = events = 0
    t0 = clock()
    for name, batches in payloads.items():
        for payload in batches:
            batch = decode_batch(payload)
            index.apply(name, "m", batch)
            events += 1
            blocks += len(batch.events[0].block_hashes)
    elapsed = clock() - t0
    return {"blocks": blocks, "distinct_blocks": sum(len(d) for d in index._tiers["m"]),
            "events": events, "apply_blocks_per_s": round(blocks / elapsed),
            "apply_events_per_s": round(events / elapsed), "index_rss_mib": round(rss_mib() - rss0, 1)}


def query_all(index: RoutingIndex, convs, queries: int, rng: random.Random) -> dict:
    """Score 2k-token prompts (a cached conversation plus a fresh turn) across all workers."""
    hash_us, lookup_us, correct = [], [], 0
    for _ in range(queries):
        tokens, _, holder, _ = rng.choice(convs)
        prompt = np.concatenate([tokens, np.arange(BLOCK * 4) + 7])
        t0 = clock()
        hashes = index.hashes(prompt)
        t1 = clock()
        best = index.score(hashes=hashes, namespace="m")[0]
        t2 = clock()
        hash_us.append((t1 - t0) * 1e6)
        lookup_us.append((t2 - t1) * 1e6)
        correct += best.worker == f"w{holder}"
    total = [a + b for a, b in zip(hash_us, lookup_us)]
    p99 = statistics.quantiles(total, n=100)[98] if len(total) > 1 else total[0]
    return {"query_blocks": len(hashes), "query_hash_us_p50": round(statistics.median(hash_us), 1),
            "query_lookup_us_p50": round(statistics.median(lookup_us), 1),
            "query_total_us_p50": round(statistics.median(total), 1), "query_total_us_p99": round(p99, 1),
            "queries_routed_to_holder": f"{correct}/{queries}"}


def remove_some(index: RoutingIndex, convs) -> dict:
    """Remove a tenth of the conversations, then forget one worker (one that holds a
    conversation, so a small fleet has it too) entirely."""
    removes = [(f"w{h}", KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=hs, medium=m)]))
               for _, hs, h, m in convs[: max(1, len(convs) // 10)]]
    t0 = clock()
    for name, batch in removes:
        index.apply(name, "m", batch)
    remove_s = clock() - t0
    t0 = clock()
    index.clear_worker(f"w{convs[-1][2]}", "m")
    return {"remove_blocks_per_s": round(sum(len(b.events[0].block_hashes) for _, b in removes) / remove_s),
            "clear_worker_ms": round((clock() - t0) * 1e3, 1)}


def decode_only(payloads: dict[str, list[bytes]]) -> dict:
    """Decode every batch without applying it: the floor of what a feed does per update."""
    blocks = 0
    t0 = clock()
    for batches in payloads.values():
        for payload in batches:
            blocks += len(decode_batch(payload).events[0].block_hashes)
    return {"decode_blocks_per_s": round(blocks / (clock() - t0))}


def fleet(num_blocks: int, workers: int, queries: int, seed: int) -> dict:
    rng = random.Random(seed)
    t0 = clock()
    payloads, convs = build_fleet(num_blocks, workers, rng)
    result = {"workers": workers, "build_s": round(clock() - t0, 2)}
    index = RoutingIndex(BLOCK)
    result.update(apply_all(index, payloads))
    result.update(decode_only(payloads))
    result.update(query_all(index, convs, queries, rng))
    result.update(remove_some(index, convs))
    return result


def _size(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:g}M"
    return f"{round(n / 1e3)}k" if n >= 1000 else str(n)


def run(mode: str, plot_dir=None, profiler=None) -> Section:
    """The bench section: one fleet of BLOCKS[mode] entries over 16 workers, and one 64x
    smaller, same seed, as the baseline that shows query time flat in the index size."""
    sec = Section("routing", "Routing index (radixkv.routing at fleet scale)",
                  intro=" ".join(__doc__.split("\n\n")[2].split()))
    n, queries = BLOCKS[mode], QUERIES[mode]
    progress(f"routing: {n} blocks over {WORKERS} workers, {queries} queries")
    big = fleet(n, WORKERS, queries, seed=1)
    progress(f"routing: baseline index of {n // SMALL} blocks")
    small = fleet(n // SMALL, WORKERS, queries, seed=1)
    _report(sec, big, small, n)
    return sec


def _report(sec: Section, big: dict, small: dict, n: int) -> None:
    at = _size(n)
    sec.add(Figure(f"routing.apply.blocks_per_s@{at}", big["apply_blocks_per_s"], "blocks/s",
                   "decode_only", big["decode_blocks_per_s"]))
    sec.add(Figure(f"routing.query.p50@{at}", big["query_total_us_p50"], "us",
                   f"at-{_size(small['blocks'])}", small["query_total_us_p50"]))
    sec.add(Figure(f"routing.query.p99@{at}", big["query_total_us_p99"], "us", "p50", big["query_total_us_p50"]))
    routed, asked = (int(x) for x in big["queries_routed_to_holder"].split("/"))
    sec.add(Figure(f"routing.routed_to_holder@{at}", routed, "queries", "asked", asked))
    rows = [
        ["block entries (distinct) over workers", f"{big['blocks']:,} ({big['distinct_blocks']:,}) over {big['workers']}"],
        ["apply decoded batches (one BlockStored of 64 blocks each)",
         f"{fmt(big['apply_blocks_per_s'] / 1e6)}M blocks/s ({fmt(big['apply_events_per_s'] / 1e3)}k events/s)"],
        ["msgpack decode alone, same batches", f"{fmt(big['decode_blocks_per_s'] / 1e6)}M blocks/s"],
        ["apply BlockRemoved (a tenth of the conversations)", f"{fmt(big['remove_blocks_per_s'] / 1e6)}M blocks/s"],
        [f"query: hash {big['query_blocks']} blocks (vLLM sha256_cbor chain)", f"{fmt(big['query_hash_us_p50'])} us p50"],
        [f"query: score {big['workers']} workers across 3 tiers", f"{fmt(big['query_lookup_us_p50'])} us p50"],
        ["query total", f"{fmt(big['query_total_us_p50'])} us p50, {fmt(big['query_total_us_p99'])} us p99"],
        [f"query total, index of {small['blocks']:,} entries", f"{fmt(small['query_total_us_p50'])} us p50"],
        ["forget one worker (`clear_worker`)", f"{fmt(big['clear_worker_ms'])} ms"],
        ["index memory (peak RSS growth while applying)", f"~{fmt(big['index_rss_mib'])} MiB"],
        ["queries routed to the worker holding the prompt", big["queries_routed_to_holder"]],
    ]
    sec.tables.append(Table(f"Routing index, {at} block entries across {big['workers']} workers", ["", ""], rows,
                            "CPU time of the measuring thread. Queries: a cached 2k-token conversation plus a fresh "
                            "turn (132 blocks), hashed and scored across every worker."))


def publisher_side(nodes: int, seed: int) -> dict:
    """The daemon's side: what the core's listener and a flush cost on the event loop, and
    how fast the publisher thread turns records into sent batches (ZMQ PUB on ipc)."""
    import tempfile

    from radixkv_server.core.tree import RadixTree
    from radixkv_server.events import EventHub, EventsConfig

    rng = np.random.default_rng(seed)
    tree = RadixTree(BLOCK)
    batch = [tree.add_child(tree.root(b""), rng.integers(0, 150_000, 8 * BLOCK, dtype="<i4").tobytes())
             for _ in range(nodes)]
    tmp = tempfile.mkdtemp(prefix="rkv-bench-ev-")
    hub = EventHub(EventsConfig(endpoint=f"ipc://{tmp}/pub", queue_size=nodes + 8))
    listen = hub.attach("m", BLOCK)
    t0 = clock()
    for node in batch:
        listen("device", "stored", node)
    listen_us = (clock() - t0) / nodes * 1e6
    hub.flush()  # one big batch, not timed
    while hub.next_seq < 2:
        time.sleep(0.001)
    wall = time.perf_counter()
    t0 = clock()
    for node in batch:
        listen("host", "stored", node)
        hub.flush()
    change_us = (clock() - t0) / nodes * 1e6
    while hub.next_seq < nodes + 2:
        time.sleep(0.001)
    elapsed = time.perf_counter() - wall
    hub.close()
    return {"loop_listener_us_per_change": round(listen_us, 2),
            "loop_change_and_flush_us": round(change_us, 2),
            "published_batches_per_s_wall": round(nodes / elapsed),
            "published_blocks_per_s_wall": round(nodes * 8 / elapsed)}


def hot_path(convs: int, seed: int) -> dict:
    """The issue's figure in-process: insert (with its write-through backup settled) and
    Match of 2k-token prompts on the real core, events off vs on (PUB on ipc), same run.
    Each insert stores one 128-page node on device, then on host: two residency changes."""
    import tempfile

    from radixkv_server.core import CacheConfig, HierarchicalCache
    from radixkv_server.core.pages import pack
    from radixkv_server.events import EventHub, EventsConfig

    from .core import SettlingCopier

    rng = np.random.default_rng(seed)
    hub = EventHub(EventsConfig(endpoint=f"ipc://{tempfile.mkdtemp(prefix='rkv-bench-hot-')}/pub",
                                queue_size=4 * convs + 8))
    out = {}
    for mode in ("off", "on"):
        copier = SettlingCopier()
        cache = HierarchicalCache(CacheConfig(page_size=BLOCK, write_policy="write_through"), copier,
                                  num_device_pages=convs * 128, host_pages=convs * 128)
        if mode == "on":
            cache.residency_listener = hub.attach(f"hot-{seed}", BLOCK)
        prompts = [rng.integers(1, 1 << 30, size=128 * BLOCK, dtype=np.int32).tobytes() for _ in range(convs)]
        t0 = clock()
        for i, p in enumerate(prompts):
            cache.insert(p, pack(range(i * 128, (i + 1) * 128)))
            copier.settle(cache)
            hub.flush()
        insert_us = (clock() - t0) / convs * 1e6
        t0 = clock()
        for p in prompts:
            cache.match(p)
            hub.flush()
        out[f"hot_insert_us_events_{mode}"] = round(insert_us, 1)
        out[f"hot_match_us_events_{mode}"] = round((clock() - t0) / convs * 1e6, 1)
    wall = time.perf_counter()
    while not hub.drained:
        time.sleep(0.001)
    hub.close()
    out["hot_insert_ratio_on_off"] = round(out["hot_insert_us_events_on"] / out["hot_insert_us_events_off"], 2)
    out["hot_match_ratio_on_off"] = round(out["hot_match_us_events_on"] / out["hot_match_us_events_off"], 2)
    out["hot_publish_backlog_s_after_run"] = round(time.perf_counter() - wall, 2)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--hot-convs", type=int, default=2000,
                    help="2k-token conversations for the events-on/off hot-path figure (0: skip)")
    ap.add_argument("--publisher-nodes", type=int, default=5000,
                    help="nodes (8 blocks each) for the daemon-side figures (0: skip)")
    args = ap.parse_args(argv)
    result = fleet(args.blocks, args.workers, args.queries, args.seed)
    if args.publisher_nodes:
        result.update(publisher_side(args.publisher_nodes, args.seed))
    if args.hot_convs:
        result.update(hot_path(args.hot_convs, args.seed))
    for key, value in result.items():
        print(f"{key:28} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
