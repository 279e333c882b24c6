"""radixkv.routing fed by 4 daemons' real event streams (ZMQ, replay on) picks the worker
with the best weighted cached prefix for every request of a trace, including host-only
and storage-only hits, and follows evictions."""

import random

import pytest

from radixkv.routing import RoutingIndex, TierWeights, ZmqFleet
from radixkv.routing.blockhash import block_hashes
from radixkv.routing.subscriber import Daemon
from radixkv_server.core.tree import RadixTree
from radixkv_server.events import EventHub, EventsConfig

from .helpers import PAGE, ipc_endpoints, packed, wait_for

NS = "llama/tp0"
WEIGHTS = TierWeights(device=1.0, host=0.6, storage=0.3)
RNG = random.Random(13)
FAMILY = {name: [RNG.randrange(100_000) for _ in range(16 * PAGE)] for name in "ABCDEG"}


class SimDaemon:
    """A daemon's event side: a real tree and hub; `place` stores a run of pages on a tier."""

    def __init__(self, name):
        self.name = name
        self.pub, self.rep = ipc_endpoints(name)
        self.hub = EventHub(EventsConfig(endpoint=self.pub, replay_endpoint=self.rep))
        self.tree = RadixTree(PAGE)
        self.listen = self.hub.attach(NS, PAGE)
        self.model = {"GPU": set(), "CPU": set(), "STORAGE": set()}  # what it holds
        self.nodes = {}

    def place(self, tier, family, first_page, last_page):
        """Store pages [first_page, last_page) of `family` (its earlier pages must be placed)."""
        tokens = FAMILY[family]
        parent = self.nodes.get((family, first_page), self.tree.root(b""))
        node = self.tree.add_child(parent, packed(tokens[first_page * PAGE:last_page * PAGE]))
        self.nodes[(family, last_page)] = node
        self.nodes[(family, first_page, last_page)] = node
        self.listen(tier, "stored", node)
        medium = {"device": "GPU", "host": "CPU", "storage": "STORAGE"}[tier]
        self.model[medium].update(block_hashes(tokens[:last_page * PAGE], PAGE)[first_page:])
        self.hub.flush()

    def remove(self, tier, family, first_page, last_page):
        node = self.nodes[(family, first_page, last_page)]
        self.listen(tier, "removed", node)
        medium = {"device": "GPU", "host": "CPU", "storage": "STORAGE"}[tier]
        self.model[medium].difference_update(block_hashes(FAMILY[family][:last_page * PAGE], PAGE)[first_page:])
        self.hub.flush()


@pytest.fixture
def fleet():
    daemons = [SimDaemon(f"w{i}") for i in range(4)]
    index = RoutingIndex(PAGE, WEIGHTS)
    zfleet = ZmqFleet(index, [Daemon(d.name, d.pub, d.rep) for d in daemons], check_interval=0.2)
    yield daemons, index, zfleet
    zfleet.close()
    for d in daemons:
        d.hub.close()


def sync(daemons, zfleet):
    """Poll until every feed applied everything its daemon published."""
    def caught_up():
        zfleet.poll(0.02)
        feeds = zfleet.feeds
        return all(d.hub.drained and feeds[d.name].last_seq == d.hub.next_seq - 1
                   and feeds[d.name].replay_from is None for d in daemons)
    wait_for(caught_up, 20, "routers caught up")


def reference_scores(daemons, tokens):
    """Brute force: per worker, walk blocks while it holds them anywhere, weigh the best tier."""
    out = {}
    for d in daemons:
        score = 0.0
        for h in block_hashes(tokens, PAGE):
            if h in d.model["GPU"]:
                score += WEIGHTS.device
            elif h in d.model["CPU"]:
                score += WEIGHTS.host
            elif h in d.model["STORAGE"]:
                score += WEIGHTS.storage
            else:
                break
        out[d.name] = score
    return out


def request(family, pages):
    return FAMILY[family][:pages * PAGE] + [RNG.randrange(100_000) for _ in range(RNG.randrange(1, 40))]


def test_picks_the_right_worker_for_every_request(fleet):
    daemons, index, zfleet = fleet
    w0, w1, w2, w3 = daemons
    w0.place("device", "A", 0, 16)            # A: device hit on w0
    w1.place("host", "B", 0, 12)              # B: host-only hit on w1
    w2.place("storage", "C", 0, 16)           # C: storage-only hit on w2
    w3.place("device", "D", 0, 2)             # D: 2 device blocks (2.0) lose to ...
    w1.place("host", "D", 0, 8)               # ... 8 host blocks (4.8)
    w0.place("device", "E", 0, 10)            # E: 10 device blocks (10) beat ...
    w2.place("storage", "E", 0, 16)           # ... 16 storage blocks (4.8)
    w3.place("device", "G", 0, 4)             # G: 4 device + 4 host on w3 (6.4) beat ...
    w3.place("host", "G", 4, 8)
    w0.place("device", "G", 0, 6)             # ... 6 device blocks on w0 (6.0)
    sync(daemons, zfleet)

    expected = {"A": "w0", "B": "w1", "C": "w2", "D": "w1", "E": "w0", "G": "w3"}
    trace = [(f, RNG.randrange(1, 17)) for f in RNG.choices(list(expected), k=120)]
    for family, pages in trace:
        tokens = request(family, pages)
        ref = reference_scores(daemons, tokens)
        got = index.score(tokens, namespace=NS)
        assert {s.worker: pytest.approx(s.score) for s in got} == ref, (family, pages)
        assert got[0].score == pytest.approx(max(ref.values()))
    for family, worker in expected.items():
        best = index.best(FAMILY[family], namespace=NS)
        assert best.worker == worker, family
    b = index.best(FAMILY["B"], namespace=NS)
    assert (b.device_blocks, b.host_blocks, b.storage_blocks) == (0, 12, 0)
    c = index.best(FAMILY["C"], namespace=NS)
    assert (c.device_blocks, c.host_blocks, c.storage_blocks) == (0, 0, 16)
    assert index.best(request("A", 0), namespace=NS).score == 0
    assert index.best(FAMILY["A"], namespace="other-model").score == 0
    assert index.num_blocks("w3", NS) == (2 + 4, 4, 0)  # D and G on GPU, G on CPU

    # evictions move the answer: B leaves w1's host; G's device copy leaves w3
    w1.remove("host", "B", 0, 12)
    w3.remove("device", "G", 0, 4)
    w3.place("storage", "G", 0, 4)            # written to storage on its way out
    sync(daemons, zfleet)
    assert index.best(FAMILY["B"], namespace=NS).score == 0
    g = index.score(FAMILY["G"], namespace=NS)
    assert g[0].worker == "w0" and g[0].score == 6.0
    assert {s.worker: s.score for s in g}["w3"] == pytest.approx(4 * 0.3 + 4 * 0.6)


def test_a_restarted_daemon_is_forgotten(fleet):
    daemons, index, zfleet = fleet
    daemons[0].place("device", "A", 0, 16)
    sync(daemons, zfleet)
    assert index.best(FAMILY["A"], namespace=NS).worker == "w0"
    old = daemons[0]
    old.hub.close()
    daemons[0] = SimDaemon.__new__(SimDaemon)
    daemons[0].__dict__.update(old.__dict__)
    daemons[0].hub = EventHub(EventsConfig(endpoint=old.pub, replay_endpoint=old.rep))
    daemons[0].listen = daemons[0].hub.attach(NS, PAGE)
    daemons[0].tree = RadixTree(PAGE)
    daemons[0].nodes, daemons[0].model = {}, {"GPU": set(), "CPU": set(), "STORAGE": set()}
    daemons[0].place("host", "C", 0, 4)      # new incarnation: seq restarts at 0
    wait_for(lambda: zfleet.poll(0.02) >= 0 and index.best(FAMILY["C"], namespace=NS).score > 0,
             20, "the new incarnation's events")
    assert index.best(FAMILY["C"], namespace=NS).worker == "w0"
    assert index.best(FAMILY["A"], namespace=NS).score == 0
    assert zfleet.feeds["w0"].num_restarts == 1


def test_a_silent_replay_endpoint_is_given_up_on_and_live_events_still_apply():
    pub, rep = ipc_endpoints("silent")
    hub = EventHub(EventsConfig(endpoint=pub))  # no replay served at `rep`
    index = RoutingIndex(PAGE, WEIGHTS)
    zfleet = ZmqFleet(index, [Daemon("w0", pub, rep)], replay_timeout=0.2, check_interval=0)
    try:
        tree = RadixTree(PAGE)
        listen = hub.attach(NS, PAGE)
        for i in range(50):  # until the SUB is connected and the replay was given up on
            node = tree.add_child(tree.root(b""), packed(FAMILY["A"][:PAGE]) if i == 0 else
                                  packed([i] * PAGE))
            listen("device", "stored", node)
            hub.flush()
            zfleet.poll(0.02)
        feed = zfleet.feeds["w0"]
        wait_for(lambda: zfleet.poll(0.02) >= 0 and feed.replay_from is None and hub.drained
                 and feed.last_seq == hub.next_seq - 1, 20, "live events applied")
        assert index.num_blocks("w0", NS)[0] > 0 and feed.num_applied > 0
    finally:
        zfleet.close()
        hub.close()


def test_a_replay_request_lost_on_its_way_is_asked_again_and_repairs_the_stream():
    """A daemon that restarts or dies just as a router asks for a replay loses the
    request. The router asks again on a fresh socket instead of going on without it, so
    the batches it had missed (here: all it published before the router connected)
    reach the index and nothing is reset."""
    import zmq
    pub, rep = ipc_endpoints("lossy")
    _, served = ipc_endpoints("lossy-served")
    hub = EventHub(EventsConfig(endpoint=pub, replay_endpoint=served))
    ctx = zmq.Context.instance()
    front = ctx.socket(zmq.ROUTER)  # the router's replay endpoint: drops the first request
    front.bind(rep)
    back = ctx.socket(zmq.DEALER)  # ... and relays the later ones to the daemon's
    back.connect(served)
    tree, listen = RadixTree(PAGE), hub.attach(NS, PAGE)
    parent = tree.root(b"")
    stored = []
    for i in range(10):  # published before any router listens: only a replay has them
        tokens = FAMILY["A"][i * PAGE:(i + 1) * PAGE]
        parent = tree.add_child(parent, packed(tokens))
        listen("host", "stored", parent)
        hub.flush()
        stored.append(i)
    index = RoutingIndex(PAGE, WEIGHTS)
    zfleet = ZmqFleet(index, [Daemon("w0", pub, rep)], replay_timeout=0.3, check_interval=0)
    dropped, relayed, peer = [], 0, []
    try:
        feed = zfleet.feeds["w0"]

        def relay() -> bool:
            nonlocal relayed
            zfleet.poll(0.01)
            while front.poll(0):
                frames = front.recv_multipart()
                if not dropped:
                    dropped.append(frames)
                    continue
                peer[:] = frames[:1]  # the asking socket (a fresh one after a drop)
                back.send_multipart(frames[1:])
                relayed += 1
            while back.poll(0):
                front.send_multipart(peer + back.recv_multipart())
            return feed.replay_from is None and feed.last_seq == hub.next_seq - 1

        wait_for(relay, 20, "the stream repaired by a replay asked again")
        assert dropped and relayed >= 1
        assert index.best(FAMILY["A"][:10 * PAGE], namespace=NS).score > 0
        assert index.num_blocks("w0", NS)[1] == 10  # every host block, the missed ones too
        assert feed.num_resets == 0
    finally:
        zfleet.close()
        front.close(0)
        back.close(0)
        hub.close()
