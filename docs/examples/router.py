"""A KV-aware router in ~100 lines: follow N radixkv daemons' KV events and send each
prompt to the worker with the best weighted cached prefix (ties: the least loaded).

Against running daemons (started with --kv-events-endpoint / --kv-events-replay-endpoint),
prompts as JSON token-id lists on stdin, one per line:

    python docs/examples/router.py --namespace llama3-8b/tp0 --block-size 16 \\
        --daemon w0=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 \\
        --daemon w1=tcp://10.0.0.6:5557,tcp://10.0.0.6:5558 < prompts.jsonl

Self-contained demo (three in-process daemons on ipc:// sockets, each holding a different
prefix on a different tier):

    python docs/examples/router.py --demo
"""

import argparse
import json
import random
import sys
import tempfile
import threading
import time

from radixkv.routing import RoutingIndex, TierWeights, ZmqFleet
from radixkv.routing.subscriber import Daemon


class Router:
    def __init__(self, daemons: list[Daemon], namespace: str, block_size: int, weights: TierWeights):
        self.namespace = namespace
        self.index = RoutingIndex(block_size, weights)
        self.fleet = ZmqFleet(self.index, daemons)
        self.load = {d.name: 0 for d in daemons}  # requests in flight, as a real router counts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.fleet.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def route(self, tokens: list[int]):
        scores = self.index.score(tokens, namespace=self.namespace, workers=list(self.load))
        top = scores[0].score
        best = min((s for s in scores if s.score == top), key=lambda s: self.load[s.worker])
        return best, scores

    def close(self):
        self._stop.set()
        self._thread.join()
        self.fleet.close()


def parse_daemon(text: str) -> Daemon:
    name, _, addrs = text.partition("=")
    pub, _, replay = addrs.partition(",")
    if not name or not pub:
        raise argparse.ArgumentTypeError(f"--daemon NAME=PUB[,REPLAY], got {text!r}")
    return Daemon(name, pub, replay)


def demo() -> None:
    """Three simulated daemons: w0 holds prompt A on GPU, w1 prompt B on CPU, w2 prompt C
    in storage; w1 also holds the first half of A on GPU."""
    from radixkv_server.core.tree import RadixTree
    from radixkv_server.events import EventHub, EventsConfig

    page, ns = 16, "demo/tp0"
    rng = random.Random(0)
    prompts = {name: [rng.randrange(50_000) for _ in range(8 * page)] for name in "ABC"}
    placements = {"w0": [("device", "A", 8)], "w1": [("host", "B", 8), ("device", "A", 4)],
                  "w2": [("storage", "C", 8)]}
    tmp = tempfile.mkdtemp(prefix="rkv-router-demo-")
    hubs, daemons = [], []
    for name, places in placements.items():
        pub, rep = f"ipc://{tmp}/{name}-pub", f"ipc://{tmp}/{name}-replay"
        hub = EventHub(EventsConfig(endpoint=pub, replay_endpoint=rep))
        listen, tree = hub.attach(ns, page), RadixTree(page)
        for tier, prompt, pages in places:
            tokens = b"".join(t.to_bytes(4, "little") for t in prompts[prompt][:pages * page])
            listen(tier, "stored", tree.add_child(tree.root(b""), tokens))
        hub.flush()
        hubs.append(hub)
        daemons.append(Daemon(name, pub, rep))
    router = Router(daemons, ns, page, TierWeights())
    deadline = time.monotonic() + 10
    while (any(router.index.best(p, namespace=ns).score == 0 for p in prompts.values())
           and time.monotonic() < deadline):
        time.sleep(0.01)  # a demo's patience; a real router serves meanwhile
    for name in "ABC":
        best, scores = router.route(prompts[name] + [1, 2, 3])
        detail = ", ".join(f"{s.worker}={s.score:.1f}" for s in scores)
        print(f"prompt {name} -> {best.worker} (gpu {best.device_blocks}, cpu {best.host_blocks}, "
              f"storage {best.storage_blocks} blocks; scores {detail})")
    router.close()
    for hub in hubs:
        hub.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--daemon", action="append", type=parse_daemon, default=[])
    ap.add_argument("--namespace", default="")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--weights", default="1.0,0.6,0.3", help="device,host,storage")
    ap.add_argument("--demo", action="store_true")
    args = ap.parse_args(argv)
    if args.demo:
        return demo()
    if not args.daemon:
        ap.error("give --daemon NAME=PUB[,REPLAY] at least once, or --demo")
    weights = TierWeights(*(float(w) for w in args.weights.split(",")))
    router = Router(args.daemon, args.namespace, args.block_size, weights)
    try:
        for line in sys.stdin:
            best, _ = router.route(json.loads(line))
            print(json.dumps({"worker": best.worker, "score": best.score,
                              "blocks": [best.device_blocks, best.host_blocks, best.storage_blocks]}))
    finally:
        router.close()


if __name__ == "__main__":
    main()
