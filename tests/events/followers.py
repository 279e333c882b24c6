"""Routers following a real daemon's KV events: over ZMQ (`radixkv.routing.ZmqFleet`)
and over gRPC (`WatchEvents`), each rebuilding per-tier block sets in a RoutingIndex, and
the daemon's own state (Inspect, Match) to compare them with."""

import threading

import grpc

from radixkv.routing import RoutingIndex, ZmqFleet
from radixkv.routing.subscriber import Daemon
from radixkv.routing.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, watch_event_fields
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

WORKER = "w0"
_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)


class ZmqFollower:
    """A ZmqFleet of one daemon, polled on its own thread until `close`."""

    def __init__(self, page_size: int, endpoint: str, replay_endpoint: str):
        self.index = RoutingIndex(page_size)
        self.fleet = ZmqFleet(self.index, [Daemon(WORKER, endpoint, replay_endpoint)],
                              check_interval=0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.fleet.run, args=(self._stop,), daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int | None:
        return self.fleet.feeds[WORKER].last_seq

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.fleet.close()


def wire_batch(msg: pb.KvEventBatch) -> KVEventBatch:
    """A WatchEvents message as the vLLM batch it was made from."""
    classes = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
    events = []
    for e in msg.events:
        kind, fields = watch_event_fields(e)
        events.append(classes[kind](**fields))
    return KVEventBatch(ts=msg.ts, events=events)


class WatchFollower:
    """A WatchEvents reader on its own thread, from seq 0. After a broken stream it
    resumes from the next seq; a daemon that restarted meanwhile (another daemon_instance, or OUT_OF_RANGE)
    is followed again from seq 0 with the worker forgotten. With `snapshot`, every stream
    starts with the daemon's snapshot instead (a router that joins late or lost its place)."""

    def __init__(self, page_size: int, target: str, namespace: str = "", snapshot: bool = False):
        self.index = RoutingIndex(page_size)
        self.target, self.namespace, self.snapshot = target, namespace, snapshot
        self.instance: str | None = None
        self.last_seq: int | None = None
        self.codes: list[grpc.StatusCode] = []  # how each stream ended
        self._stop = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with grpc.insecure_channel(self.target) as channel:
                stub = pb_grpc.RadixKVStub(channel)
                if self.snapshot:
                    request = pb.WatchEventsRequest(namespace=self.namespace, snapshot=True)
                else:
                    start = 0 if self.last_seq is None else self.last_seq + 1
                    request = pb.WatchEventsRequest(namespace=self.namespace, from_seq=start)
                try:
                    self._call = stub.WatchEvents(request, wait_for_ready=True)
                    for msg in self._call:
                        if not self._apply(msg):
                            self._call.cancel()
                            break
                except grpc.RpcError as e:
                    self.codes.append(e.code())
                    if e.code() == grpc.StatusCode.OUT_OF_RANGE:
                        self._restart_seen()
                    elif e.code() not in _RETRY:
                        return  # a refusal that will not change: the test sees it in codes

    def _apply(self, msg: pb.KvEventBatch) -> bool:
        """Apply one batch; False when the daemon restarted and the stream must start over."""
        if msg.daemon_instance != self.instance:
            if self.instance is not None and msg.seq != 0 and not msg.snapshot:
                self._restart_seen()
                return False
            self.instance = msg.daemon_instance
        self.last_seq = msg.seq - 1 if msg.snapshot else msg.seq  # a snapshot precedes batch seq
        self.index.apply(WORKER, msg.namespace, wire_batch(msg))
        return True

    def _restart_seen(self) -> None:
        self.index.clear_worker(WORKER)
        self.instance = self.last_seq = None

    def close(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(10)


def daemon_blocks(inspect: pb.InspectResponse, page_size: int) -> tuple[int, int]:
    """(device blocks, host blocks) of a namespace, from an untruncated Inspect."""
    assert not inspect.truncated, "raise max_nodes"
    device = sum(n.tokens // page_size for n in inspect.nodes if n.on_device)
    host = sum(n.tokens // page_size for n in inspect.nodes if n.on_host)
    return device, host


def prefix_blocks(index: RoutingIndex, namespace: str, tokens, media: tuple[str, ...]) -> int:
    """How many leading blocks of `tokens` the router believes are on any of `media`."""
    held = set().union(*(index.blocks(WORKER, namespace, m) for m in media))
    n = 0
    for h in index.hashes(tokens):
        if h not in held:
            break
        n += 1
    return n
