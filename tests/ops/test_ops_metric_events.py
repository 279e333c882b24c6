"""The KV-event metrics of a real daemon process hold the values a known workload makes
them hold: batches published (the start's AllBlocksCleared, the namespace's own at its
registration, then one per RPC that changed residency), replay requests answered, and nothing dropped, refused or queued
once the publisher is idle. A router's side is raw ZMQ: a SUB and a DEALER.

What no healthy daemon process can be made to do is covered elsewhere: batches dropped
and a queue that stays full need a stuck publisher thread
(tests/service_inproc/test_metric_stuck_events.py); a ZMQ send is never refused by a
live peer (PUB and ROUTER drop past their high-water mark instead), so send errors are
asserted 0 and present here.
"""

import os
import tempfile

import zmq
from radixkv.routing.wire import END_SEQ
from tests.support.daemon import wait_for

from rawengine import PAGE_SIZE, RawEngine, fresh_tokens
from scrape import DEADLINE_S, series

P = 4 * PAGE_SIZE
EVENT_METRICS = ("published", "dropped", "send_errors", "replays")


def events(daemon) -> dict:
    """The daemon-wide KV-event samples, by short name."""
    got = series(daemon.scrape(), "")
    out = {k: got.get((f"radixkv_kv_event_batches_{k}_total", ())) for k in ("published", "dropped")}
    out["send_errors"] = got.get(("radixkv_kv_event_send_errors_total", ()))
    out["replays"] = got.get(("radixkv_kv_event_replays_total", ()))
    out["build_errors"] = got.get(("radixkv_kv_event_build_errors_total", ()))
    out["queue_depth"] = got.get(("radixkv_kv_event_queue_depth", ()))
    out["watchers"] = got.get(("radixkv_kv_event_watchers", ()))
    return out


def replay(dealer, from_seq: int) -> list[int]:
    """Ask the replay endpoint for every batch from `from_seq`; their seqs."""
    dealer.send_multipart((b"", from_seq.to_bytes(8, "big")))
    seqs = []
    while True:
        assert dealer.poll(10_000), "no replay answer"
        _, _topic, seq, _payload = dealer.recv_multipart()
        if seq == END_SEQ:
            return seqs
        seqs.append(int.from_bytes(seq, "big"))


def test_kv_event_counters_of_a_known_workload(daemon_factory):
    d = tempfile.mkdtemp(prefix="rkv-evm-")
    pub, rep = f"ipc://{os.path.join(d, 'pub')}", f"ipc://{os.path.join(d, 'replay')}"
    daemon = daemon_factory("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(rep)
    e = RawEngine(daemon.target, "ops/events", write_policy="write_back")
    try:
        # Published: 1 at start (AllBlocksCleared: this worker holds nothing), 1 at the
        # namespace's registration (AllBlocksCleared on its own topic).
        wait_for(lambda: events(daemon)["published"] == 2, DEADLINE_S, "the start's batches")
        for _ in range(3):
            assert e.insert(fresh_tokens(P)) == 0   # device stored: one batch per Insert
        e.match(fresh_tokens(P))                    # a miss changes nothing: no batch
        wait_for(lambda: events(daemon)["published"] == 5, DEADLINE_S, "one batch per insert")
        assert replay(dealer, 0) == [0, 1, 2, 3, 4]    # replay 1
        assert replay(dealer, 3) == [3, 4]             # replay 2
        got = events(daemon)
        assert got == {"published": 5, "dropped": 0, "send_errors": 0, "replays": 2, "build_errors": 0,
                       "queue_depth": 0, "watchers": 0}
        e.close()
    finally:
        e.release_memory()
        dealer.close(0)
        ctx.term()
