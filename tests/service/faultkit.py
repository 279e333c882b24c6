"""Helpers of the bad-input, fault and security tests: raw sessions on the generated stub
(so a test sends exactly the bytes an engine bug would), a raw ack stream, and a
snapshot of the daemon's whole observable state (digests of every namespace)."""

import queue
import threading

import grpc

from radixkv import messages as msg
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.sim.kv import KvPattern, page_keys
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
NUM_PAGES = 32
PS = LAYOUT.page_size


def stub_for(target: str, **options) -> tuple[grpc.Channel, radixkv_pb2_grpc.RadixKVStub]:
    channel = grpc.insecure_channel(target, options=list(options.items()))
    return channel, radixkv_pb2_grpc.RadixKVStub(channel)


def status(fn) -> tuple[grpc.StatusCode, str]:
    """(code, message) of a call: OK and '' when it succeeded."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


class RawAcks:
    """One Acks stream driven message by message: send() and reply()."""

    def __init__(self, stub, first: pb.AckRequest | None = None, read: bool = True):
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Acks(iter(self._out.get, None))
        if first is not None:
            self._out.put(first)
        self._reader = threading.Thread(target=self._read, daemon=True)
        if read:
            self._reader.start()

    def start_reading(self) -> None:
        """For a stream made with read=False: until now nobody read its answers."""
        self._reader.start()

    def _read(self):
        try:
            for reply in self.call:
                self._in.put(reply)
            self._in.put(("end", grpc.StatusCode.OK, ""))
        except grpc.RpcError as e:
            self._in.put(("end", e.code(), e.details() or ""))

    def send(self, transfer: int, session: str = "") -> None:
        self._out.put(pb.AckRequest(session=session, transfer=transfer))

    def reply(self, timeout: float = 10.0):
        """The next AckResponse, or ("end", code, message) once the stream ended."""
        return self._in.get(timeout=timeout)

    def close(self) -> None:
        self._out.put(None)
        if self._reader.is_alive():
            self._reader.join(10)


class RawSession:
    """A session registered with raw messages, its shm buffers, pattern KV and ack stream
    (none with `open_acks=False`: an engine that died before opening it)."""

    def __init__(self, stub, namespace: str, write_policy: str = "write_back", read_acks: bool = True,
                 open_acks: bool = True, **register):
        self.stub = stub
        self.namespace = namespace
        self.buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
        self.kv = KvPattern(LAYOUT, [self.buffers.buffer(i) for i in range(LAYOUT.num_buffers)], NUM_PAGES)
        self.register_request = self.request(write_policy=write_policy, **register)
        self.reply = reply = stub.Register(self.register_request)
        self.id = reply.session
        self.instance = reply.daemon_instance
        self.acks = RawAcks(stub, pb.AckRequest(session=self.id), read=read_acks) if open_acks else None

    def request(self, namespace: str | None = None, write_policy: str = "write_back", host_pool_pages: int = 64,
                **kw) -> pb.RegisterRequest:
        args = dict(backend="shm", device=0, write_policy=write_policy, host_pool_pages=host_pool_pages,
                    replace_existing=False, engine="faultkit", model="")
        args.update(kw)
        return msg.register_request(namespace or self.namespace, LAYOUT, self.buffers.specs(), NUM_PAGES, **args)

    def insert(self, tokens: bytes, pages: list[int]) -> pb.InsertResponse:
        self.kv.write(pages, page_keys(tokens, PS))
        return self.stub.Insert(pb.InsertRequest(session=self.id, tokens=tokens, device_pages=pack(pages)))

    def match(self, tokens: bytes, lease: bool = False) -> pb.MatchResult:
        reply = self.stub.Match(pb.MatchRequest(session=self.id, prompts=[pb.Prompt(tokens=tokens)], lease=lease))
        return reply.results[0]

    def load_back(self, node: int, pages: list[int]) -> pb.LoadBackResponse:
        return self.stub.LoadBack(pb.LoadBackRequest(session=self.id, node=node, device_pages=pack(pages)))

    def ack(self, transfer: int, timeout: float = 10.0) -> pb.AckResponse:
        self.acks.send(transfer)
        return self.acks.reply(timeout)

    def close(self) -> None:
        try:
            self.stub.Close(pb.CloseRequest(session=self.id))
        except grpc.RpcError:
            pass
        if self.acks is not None:
            self.acks.close()
        self.buffers.close()


def snapshot(stub) -> dict:
    """Everything a refused call must leave unchanged: the namespaces, each one's digest
    (tree, residency, locks, pins, transfers, pools), and the number of sessions."""
    stats = stub.Stats(pb.StatsRequest())
    out = {"sessions": stats.sessions}
    for ns in stats.namespaces:
        out[ns.namespace] = stub.Inspect(pb.InspectRequest(namespace=ns.namespace, max_nodes=1)).digest
    return out


def violations(stub) -> list[str]:
    return [f"{v.namespace}: {v.message}" for v in stub.CheckInvariants(pb.CheckInvariantsRequest()).violations]


def tokens(start: int, pages: int) -> bytes:
    return pack(range(start, start + pages * PS))
