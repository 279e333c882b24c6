"""Bad input, every RPC: what an engine bug could send, and the precise answer it gets.

Each row of TABLE is one call with one defect. It must get exactly the status code and a message matching the
pattern, and leave the daemon as it was: CheckInvariants clean, the same digest of every namespace (tree, residency,
locks, pins, transfers, pools) and sessions. STATEFUL rows are legal-but-odd calls whose documented answer changes
state (checked in order, invariants after each). No traceback is logged for any of it.

Setup (write_back, page size 4): bad/a holds P (4 pages, on device: pages 0-3) and its extension Q (4 pages, written
back to host only), leased; bad/b was re-attached (its node R is stale); bad/tmp's session was closed.
"""

import re
import time
from dataclasses import dataclass

import grpc
import pytest

from radixkv.sim.kv import page_keys
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import DaemonProcess, stop_all

from faultkit import NUM_PAGES, RawAcks, RawSession, snapshot, status, stub_for, tokens, violations

C = grpc.StatusCode
MAX_MESSAGE = 1 << 20
COPY_DELAY = 0.3
FLAGS = ("--max-message-size", str(MAX_MESSAGE), "--max-prompts-per-match", "64",
         "--max-extra-key-bytes", "64", "--fault-copy-delay", str(COPY_DELAY))


@pytest.fixture(scope="module")
def ctx():
    d = DaemonProcess(*FLAGS)
    d.start()
    channel, stub = stub_for(d.target, **{"grpc.max_send_message_length": 8 * MAX_MESSAGE})
    a = RawSession(stub, "bad/a")
    p, pq = tokens(0, 4), tokens(0, 8)
    a.insert(p, [0, 1, 2, 3])
    a.insert(pq, list(range(8)))
    assert stub.Evict(pb.EvictRequest(session=a.id, num_pages=4)).freed_pages == pack([4, 5, 6, 7])
    m = a.match(pq, lease=True)
    assert (m.device_tokens, m.host_tokens) == (16, 16) and m.lease
    b_old = RawSession(stub, "bad/b")
    stale = b_old.insert(tokens(1000, 2), [0, 1]).node
    b_old.close()
    b = RawSession(stub, "bad/b", replace_existing=True)  # re-attach: R (device only) is dropped
    tmp = RawSession(stub, "bad/tmp")
    tmp.close()
    a_nodes = {n.id for n in stub.Inspect(pb.InspectRequest(namespace="bad/a")).nodes}
    b_nodes = {n.id for n in stub.Inspect(pb.InspectRequest(namespace="bad/b")).nodes}
    foreign = max(a_nodes - b_nodes)  # a node of bad/a that bad/b does not have
    ctx = dict(daemon=d, stub=stub, a=a, b=b, p=p, pq=pq, host_node=m.host_node, lease=m.lease,
               stale=stale, foreign=foreign, closed=tmp.id)
    yield ctx
    for s in (a, b):
        s.close()
    channel.close()
    stop_all([d])


@dataclass(frozen=True)
class Row:
    rpc: str
    case: str
    call: object  # ctx -> (code, message)
    code: grpc.StatusCode
    message: str  # regex the message must match ('' for OK)

    def __str__(self):
        return f"{self.rpc}: {self.case}"


def unary(rpc: str, build):
    """A row call: send the request `build(ctx)` builds on the raw stub."""
    return lambda c: status(lambda: getattr(c["stub"], rpc)(build(c)))


def streamed(build):
    return lambda c: status(lambda: list(c["stub"].Prefetch(build(c))))


def session_stream(build):
    """Send one SessionRequest on a new Session stream (never bound: these calls name no
    usable session); its in-band error, or how the stream ended."""
    def call(c):
        try:
            [reply] = list(c["stub"].Session(iter([build(c)]), timeout=10))
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        if reply.WhichOneof("result") != "error":
            return C.OK, ""
        return next(code for code in C if code.value[0] == reply.error.code), reply.error.message
    return call


def ack_reply(build):
    """Send one ack on bad/a's own stream; the reply's code and message."""
    def call(c):
        transfer, session = build(c)
        c["a"].acks.send(transfer, session)
        reply = c["a"].acks.reply()
        return next(code for code in C if code.value[0] == reply.code), reply.message
    return call


def new_stream(first):
    """Open another Acks stream whose first message is `first(ctx)`; how it ended."""
    def call(c):
        acks = RawAcks(c["stub"], first(c))
        end = acks.reply()
        acks.close()
        return end[1], end[2]
    return call


def layout(**kw) -> pb.KvLayout:
    base = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
    base.update(kw)
    return pb.KvLayout(**base)


def reg(**kw):
    """A Register built from bad/a's valid request with fields overridden."""
    def build(c):
        r = pb.RegisterRequest()
        r.CopyFrom(c["a"].request(namespace=kw.get("namespace", "bad/new")))
        for k, v in kw.items():
            if k == "namespace":
                continue
            if k == "layout":
                r.layout.CopyFrom(v)
            elif k == "buffers":
                given = v(list(r.buffers))
                del r.buffers[:]
                r.buffers.extend(given)
            else:
                setattr(r, k, v)
        return r
    return lambda c: status(lambda: c["stub"].Register(build(dict(c))))


A = lambda c: c["a"].id  # noqa: E731
B = lambda c: c["b"].id  # noqa: E731
HUGE = pack(range(2 * MAX_MESSAGE // 4))  # 8 MiB of tokens: over the 1 MiB message limit
BIG = pack(range(200_000))  # 800 KB: under the limit, a miss
NOT_HELD = "is not held by this session"

TABLE = [
    # -- Register: layouts, buffers, limits ------------------------------------------
    Row("Register", "no layout", reg(layout=pb.KvLayout()), C.INVALID_ARGUMENT, r"layout: .*num_layers must be >= 1"),
    Row("Register", "unknown dtype", reg(layout=layout(dtype="fp13")), C.INVALID_ARGUMENT, r"dtype 'fp13' is not one of"),
    Row("Register", "layout says 3 layers, 4 buffers given", reg(layout=layout(num_layers=3)), C.INVALID_ARGUMENT,
        r"buffers: 4 buffers given, layout needs 6 \(3 layers x 2 "),
    Row("Register", "buffers' page_bytes do not add up to the layout's page", reg(buffers=lambda bs: [
        pb.DeviceBuffer(handle=b.handle, offset=b.offset, size=b.size, page_bytes=100) for b in bs]),
        C.INVALID_ARGUMENT, r"4 buffers x page_bytes 100 = 400 bytes per page, but the layout's page is"),
    Row("Register", "page_stride below page_bytes", reg(buffers=lambda bs: [
        pb.DeviceBuffer(handle=b.handle, offset=b.offset, size=b.size, page_stride=8) for b in bs]),
        C.INVALID_ARGUMENT, r"page_stride 8 is less than its page_bytes"),
    Row("Register", "page_stride past any buffer (one page: no size check sees it)", reg(num_device_pages=1, buffers=lambda bs: [
        pb.DeviceBuffer(handle=b.handle, offset=b.offset, size=b.size, page_stride=2**64 - 1) for b in bs]),
        C.INVALID_ARGUMENT, r"buffer 0: page_stride 18446744073709551615 is past any buffer"),
    Row("Register", "more device pages than int32 page ids name", reg(num_device_pages=2**31),
        C.INVALID_ARGUMENT, r"num_device_pages 2147483648: page ids are int32, at most 2147483647 pages"),
    Row("Register", "scheduler role on a managed-device namespace", reg(role=pb.SCHEDULER), C.INVALID_ARGUMENT,
        r"role is for engine-managed namespaces"),
    Row("Register", "tp_rank past tp_size on a managed-device namespace", reg(tp_size=2, tp_rank=3),
        C.INVALID_ARGUMENT, r"tp_rank 3 out of range 0..1"),
    Row("Register", "tensor-parallel rank with no instance", reg(tp_size=2, tp_rank=1), C.INVALID_ARGUMENT,
        r"names its engine in `instance`"),
    Row("Register", "tp_rank past tp_size", reg(device_tier=pb.ENGINE_MANAGED, tp_size=2, tp_rank=2),
        C.INVALID_ARGUMENT, r"tp_rank 2 out of range 0..1"),
    Row("Register", "scheduler session with buffers", reg(device_tier=pb.ENGINE_MANAGED, role=pb.SCHEDULER),
        C.INVALID_ARGUMENT, r"a SCHEDULER session sends no buffers"),
    Row("Register", "unknown device tier", reg(device_tier=7), C.INVALID_ARGUMENT, r"device_tier 7 / role 0: unknown value"),
    Row("Register", "engine-managed session on a managed-device namespace",
        reg(namespace="bad/a", device_tier=pb.ENGINE_MANAGED), C.FAILED_PRECONDITION, r"has the other device tier"),
    Row("Register", "handle that cannot be opened", reg(buffers=lambda bs: [pb.DeviceBuffer(handle=b"no-such-seg", size=b.size) for b in bs]),
        C.INVALID_ARGUMENT, r"cannot open the engine's device buffers: shared-memory segment 'no-such-seg' not found"),
    Row("Register", "handle not a segment name", reg(buffers=lambda bs: [pb.DeviceBuffer(handle=b"../etc/passwd", size=b.size) for b in bs]),
        C.INVALID_ARGUMENT, r"is not a shared-memory segment name"),
    Row("Register", "more device pages than the buffers hold", reg(num_device_pages=NUM_PAGES * 1000),
        C.INVALID_ARGUMENT, r"spec size \d+ bytes, need \d+ \(32000 pages"),
    Row("Register", "no device pages", reg(num_device_pages=0), C.INVALID_ARGUMENT, r"num_device_pages must be >= 1"),
    Row("Register", "bad namespace name", reg(namespace="bad name!"), C.INVALID_ARGUMENT, r"namespace 'bad name!': use 1-128"),
    Row("Register", "unknown backend", reg(backend="tpu"), C.INVALID_ARGUMENT, r"backend 'tpu': use one of"),
    Row("Register", "unknown write policy", reg(write_policy="sometimes"), C.INVALID_ARGUMENT, r"sometimes"),
    Row("Register", "host pool over the limit", reg(host_pool_pages=10**9), C.RESOURCE_EXHAUSTED,
        r"exceeds the per-namespace limit"),
    Row("Register", "another layout on an existing namespace", reg(namespace="bad/a", layout=layout(head_dim=32)),
        C.FAILED_PRECONDITION, r"another layout \(KvLayout\(.*head_dim=16.*\), not this registration's \(KvLayout\(.*head_dim=32"),
    Row("Register", "another model on an existing namespace", reg(namespace="bad/a", model="a-fine-tune"),
        C.FAILED_PRECONDITION, r"holds KV of model 'bad/a', not 'a-fine-tune'"),
    Row("Register", "another write policy on an existing namespace", reg(namespace="bad/a", write_policy="write_through"),
        C.FAILED_PRECONDITION, r"uses write policy write_back, not write_through"),
    Row("Register", "namespace attached to a live session", reg(namespace="bad/a"), C.FAILED_PRECONDITION,
        r"attached to a live session .* pass replace_existing"),
    # -- Close: idempotent -------------------------------------------------------------
    Row("Close", "unknown session (idempotent)", unary("Close", lambda c: pb.CloseRequest(session="nobody")), C.OK, ""),
    # -- Match -------------------------------------------------------------------------
    Row("Match", "a session id of 20k characters (quoted, cut)", unary("Match", lambda c: pb.MatchRequest(session="s" * 20_000)),
        C.UNAUTHENTICATED, r"^unknown session 's{100}.*\.\.\. \(cut: 200\d\d characters\)$"),
    Row("Match", "a session id of 20k 4-byte characters (cut by bytes)", unary("Match", lambda c: pb.MatchRequest(
        session="\U0001F600" * 20_000)), C.UNAUTHENTICATED, r"^unknown session '\U0001F600{100}.*\(cut: 200\d\d characters\)$"),
    Row("Match", "no session", unary("Match", lambda c: pb.MatchRequest(prompts=[pb.Prompt(tokens=c["p"])])),
        C.UNAUTHENTICATED, r"no session given: call Register"),
    Row("Match", "unknown session", unary("Match", lambda c: pb.MatchRequest(session="f" * 32)),
        C.UNAUTHENTICATED, r"unknown session 'f+'; register again"),
    Row("Match", "closed session", unary("Match", lambda c: pb.MatchRequest(session=c["closed"])),
        C.UNAUTHENTICATED, r"was closed \(closed by a Close call\); register again"),
    Row("Match", "token bytes not a multiple of 4", unary("Match", lambda c: pb.MatchRequest(
        session=A(c), prompts=[pb.Prompt(tokens=c["p"]), pb.Prompt(tokens=b"\1\2\3\4\5\6\7")])),
        C.INVALID_ARGUMENT, r"prompt 1: token bytes \(7\) are not a multiple of 4"),
    Row("Match", "empty prompt (a miss)", unary("Match", lambda c: pb.MatchRequest(session=A(c), prompts=[pb.Prompt()])), C.OK, ""),
    Row("Match", "huge prompt under the limit (a miss)", unary("Match", lambda c: pb.MatchRequest(
        session=A(c), prompts=[pb.Prompt(tokens=BIG)])), C.OK, ""),
    Row("Match", "message over the size limit", unary("Match", lambda c: pb.MatchRequest(
        session=A(c), prompts=[pb.Prompt(tokens=HUGE)])), C.RESOURCE_EXHAUSTED, r"larger than max \(\d+ vs\. 1048576\)"),
    Row("Match", "too many prompts", unary("Match", lambda c: pb.MatchRequest(
        session=A(c), prompts=[pb.Prompt(tokens=c["p"])] * 65)), C.RESOURCE_EXHAUSTED, r"65 prompts in one Match; the limit is 64"),
    Row("Match", "extra_key at the limit (a miss)", unary("Match", lambda c: pb.MatchRequest(
        session=A(c), prompts=[pb.Prompt(tokens=c["p"], extra_key=b"k" * 64)])), C.OK, ""),
    Row("Match", "extra_key past the limit", unary("Match", lambda c: pb.MatchRequest(
        session=A(c), prompts=[pb.Prompt(tokens=c["p"]), pb.Prompt(tokens=c["p"], extra_key=b"k" * 65)])),
        C.INVALID_ARGUMENT, r"prompt 1: extra_key is 65 bytes; the limit is 64 \(--max-extra-key-bytes\)"),
    # -- Insert ------------------------------------------------------------------------
    Row("Insert", "no session", unary("Insert", lambda c: pb.InsertRequest(tokens=tokens(50, 1), device_pages=pack([9]))),
        C.UNAUTHENTICATED, r"no session given"),
    Row("Insert", "token bytes not a multiple of 4", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 1)[:-1], device_pages=pack([9]))), C.INVALID_ARGUMENT, r"token bytes \(15\)"),
    Row("Insert", "empty", unary("Insert", lambda c: pb.InsertRequest(session=A(c))), C.INVALID_ARGUMENT, r"no tokens given"),
    Row("Insert", "partial page", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=pack(range(50, 56)), device_pages=pack([9, 10]))), C.INVALID_ARGUMENT,
        r"6 tokens is not a whole number of pages"),
    Row("Insert", "too few pages", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 2), device_pages=pack([9]))), C.INVALID_ARGUMENT, r"need 2 device pages, got 1"),
    Row("Insert", "too many pages", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 2), device_pages=pack([9, 10, 11]))), C.INVALID_ARGUMENT, r"need 2 device pages, got 3"),
    Row("Insert", "page bytes not a multiple of 4", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 1), device_pages=pack([9])[:3])), C.INVALID_ARGUMENT,
        r"device page bytes \(3\) are not a multiple of 4"),
    Row("Insert", "less than a page", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=pack(range(50, 53)), device_pages=b"")), C.INVALID_ARGUMENT,
        r"3 tokens is less than one page \(page_size 4\); only whole pages are cached"),
    Row("Insert", "page out of range", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 1), device_pages=pack([NUM_PAGES]))), C.INVALID_ARGUMENT, r"device page 32 is out of range \[0, 32\)"),
    Row("Insert", "negative page", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 1), device_pages=pack([-5]))), C.INVALID_ARGUMENT, r"device page -5 is out of range"),
    Row("Insert", "duplicated page", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 2), device_pages=pack([9, 9]))), C.INVALID_ARGUMENT, r"device page 9 is listed twice"),
    Row("Insert", "tree-owned page", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 1), device_pages=pack([2]))), C.INVALID_ARGUMENT, r"device page 2 is already held by the cache"),
    Row("Insert", "release an unknown lease", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(50, 1), device_pages=pack([9]), release_lease=987654)), C.NOT_FOUND, r"lease 987654 " + NOT_HELD),
    Row("Insert", "release another session's lease", unary("Insert", lambda c: pb.InsertRequest(
        session=B(c), tokens=tokens(50, 1), device_pages=pack([9]), release_lease=c["lease"])), C.PERMISSION_DENIED, r"belongs to another session"),
    Row("Insert", "extra_key past the limit", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=tokens(60, 1), device_pages=pack([9]), extra_key=b"k" * 65)),
        C.INVALID_ARGUMENT, r"^extra_key is 65 bytes; the limit is 64 \(--max-extra-key-bytes\)"),
    Row("Insert", "message over the size limit", unary("Insert", lambda c: pb.InsertRequest(
        session=A(c), tokens=HUGE, device_pages=pack([9]))), C.RESOURCE_EXHAUSTED, r"larger than max"),
    # -- LoadBack ----------------------------------------------------------------------
    Row("LoadBack", "no session", unary("LoadBack", lambda c: pb.LoadBackRequest(node=c["host_node"], device_pages=pack([8, 9, 10, 11]))),
        C.UNAUTHENTICATED, r"no session given"),
    Row("LoadBack", "unknown node", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=10**12, device_pages=pack([8, 9, 10, 11]))), C.NOT_FOUND, r"node 1000000000000 is not in the cache"),
    Row("LoadBack", "node 0", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=0, device_pages=pack([8]))), C.NOT_FOUND, r"node 0 is not in the cache"),
    Row("LoadBack", "stale node (dropped with its engine)", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=B(c), node=c["stale"], device_pages=pack([8, 9]))), C.NOT_FOUND, r"is not in the cache \(evicted or never existed\)"),
    Row("LoadBack", "node of another namespace", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=B(c), node=c["foreign"], device_pages=pack([8, 9, 10, 11]))), C.NOT_FOUND, r"is not in the cache"),
    Row("LoadBack", "lease and start_page on a managed-device namespace", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=c["host_node"], device_pages=pack([8]), lease=1, start_page=1)), C.INVALID_ARGUMENT,
        r"lease, start_page and wait are for engine-managed namespaces"),
    Row("LoadBack", "wait on a managed-device namespace", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=c["host_node"], device_pages=pack([8]), wait=True)), C.INVALID_ARGUMENT,
        r"wait are for engine-managed namespaces; .* is acknowledged"),
    Row("LoadBack", "page out of range", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=c["host_node"], device_pages=pack([8, 9, 10, 99]))), C.INVALID_ARGUMENT, r"device page 99 is out of range"),
    Row("LoadBack", "negative page", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=c["host_node"], device_pages=pack([-1, 9, 10, 11]))), C.INVALID_ARGUMENT, r"device page -1 is out of range"),
    Row("LoadBack", "duplicated page", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=c["host_node"], device_pages=pack([8, 9, 9, 11]))), C.INVALID_ARGUMENT, r"device page 9 is listed twice"),
    Row("LoadBack", "tree-owned page", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=c["host_node"], device_pages=pack([8, 9, 10, 3]))), C.INVALID_ARGUMENT, r"device page 3 is already held"),
    Row("LoadBack", "page bytes not a multiple of 4", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=c["host_node"], device_pages=b"\0" * 7)), C.INVALID_ARGUMENT, r"page list bytes \(7\) are not a multiple of 4"),
    # Documented, not an error: only whole nodes that fit are loaded; the rest come back unused.
    Row("LoadBack", "too few pages (nothing fits: transfer 0, all unused)", unary("LoadBack", lambda c: pb.LoadBackRequest(
        session=A(c), node=c["host_node"], device_pages=pack([8, 9, 10]))), C.OK, ""),
    # -- Acks (answers on the stream, per ack) -----------------------------------------
    Row("Acks", "unknown transfer", ack_reply(lambda c: (424242, "")), C.NOT_FOUND, r"transfer 424242 is not a load-back in flight"),
    Row("Acks", "ack naming another session", ack_reply(lambda c: (1, B(c))), C.PERMISSION_DENIED,
        r"this ack stream belongs to session"),
    Row("Acks", "first message without a session", new_stream(lambda c: pb.AckRequest(transfer=1)),
        C.UNAUTHENTICATED, r"no session given"),
    Row("Acks", "first message with an unknown session", new_stream(lambda c: pb.AckRequest(session="x" * 32, transfer=1)),
        C.UNAUTHENTICATED, r"unknown session"),
    Row("Acks", "second stream for a session", new_stream(lambda c: pb.AckRequest(session=A(c))),
        C.FAILED_PRECONDITION, r"already has an ack stream"),
    # -- Release -----------------------------------------------------------------------
    Row("Release", "no session", unary("Release", lambda c: pb.ReleaseRequest(leases=[c["lease"]])), C.UNAUTHENTICATED, r"no session"),
    Row("Release", "unknown lease", unary("Release", lambda c: pb.ReleaseRequest(session=A(c), leases=[555])),
        C.NOT_FOUND, r"lease 555 " + NOT_HELD),
    Row("Release", "another session's lease", unary("Release", lambda c: pb.ReleaseRequest(session=B(c), leases=[c["lease"]])),
        C.PERMISSION_DENIED, r"belongs to another session"),
    Row("Release", "lease listed twice", unary("Release", lambda c: pb.ReleaseRequest(session=A(c), leases=[c["lease"]] * 2)),
        C.INVALID_ARGUMENT, r"leases \[\d+\] are listed twice"),
    # -- Evict -------------------------------------------------------------------------
    Row("Evict", "no session", unary("Evict", lambda c: pb.EvictRequest(num_pages=4)), C.UNAUTHENTICATED, r"no session"),
    Row("Evict", "zero pages (frees nothing)", unary("Evict", lambda c: pb.EvictRequest(session=A(c))), C.OK, ""),
    # -- Prefetch ----------------------------------------------------------------------
    Row("Prefetch", "no session", streamed(lambda c: pb.PrefetchRequest(tokens=c["p"])), C.UNAUTHENTICATED, r"no session"),
    Row("Prefetch", "token bytes not a multiple of 4", streamed(lambda c: pb.PrefetchRequest(session=A(c), tokens=b"\0" * 5)),
        C.INVALID_ARGUMENT, r"token bytes \(5\)"),
    Row("Prefetch", "unknown policy", streamed(lambda c: pb.PrefetchRequest(session=A(c), tokens=c["p"], policy="eager")),
        C.INVALID_ARGUMENT, r"prefetch policy 'eager'"),
    Row("Prefetch", "timeout policy without a timeout", streamed(lambda c: pb.PrefetchRequest(
        session=A(c), tokens=c["p"], policy="timeout")), C.INVALID_ARGUMENT, r"'timeout' needs timeout_ms > 0"),
    Row("Prefetch", "extra_key past the limit", streamed(lambda c: pb.PrefetchRequest(
        session=A(c), tokens=c["p"], extra_key=b"k" * 65)), C.INVALID_ARGUMENT, r"^extra_key is 65 bytes; the limit is 64"),
    Row("Prefetch", "no storage tier", streamed(lambda c: pb.PrefetchRequest(session=A(c), tokens=c["p"])),
        C.FAILED_PRECONDITION, r"no storage tier is configured"),
    # -- operators ---------------------------------------------------------------------
    Row("Stats", "unknown namespace", unary("Stats", lambda c: pb.StatsRequest(namespace="nope")), C.NOT_FOUND, r"no namespace 'nope'"),
    Row("Stats", "a namespace of 20k characters (quoted, cut)", unary("Stats", lambda c: pb.StatsRequest(namespace="n" * 20_000)),
        C.NOT_FOUND, r"^no namespace 'n{100}.*\(cut: \d+ characters\)$"),
    Row("Inspect", "no namespace", unary("Inspect", lambda c: pb.InspectRequest()), C.INVALID_ARGUMENT, r"namespace is required"),
    Row("Inspect", "unknown namespace", unary("Inspect", lambda c: pb.InspectRequest(namespace="nope")), C.NOT_FOUND, r"no namespace"),
    Row("DropNamespace", "no namespace", unary("DropNamespace", lambda c: pb.DropNamespaceRequest()),
        C.INVALID_ARGUMENT, r"needs the namespace"),
    Row("DropNamespace", "unknown namespace", unary("DropNamespace", lambda c: pb.DropNamespaceRequest(namespace="nope")),
        C.NOT_FOUND, r"no namespace 'nope'"),
    Row("DropNamespace", "an engine attached", unary("DropNamespace", lambda c: pb.DropNamespaceRequest(namespace="bad/a")),
        C.FAILED_PRECONDITION, r"bad/a has 1 live session"),
    Row("CheckInvariants", "unknown namespace", unary("CheckInvariants", lambda c: pb.CheckInvariantsRequest(namespace="nope")),
        C.NOT_FOUND, r"no namespace"),
    Row("WatchEvents", "KV events off (no --kv-events-watch or endpoint)",
        lambda c: status(lambda: list(c["stub"].WatchEvents(pb.WatchEventsRequest(from_seq=0)))),
        C.FAILED_PRECONDITION, r"KV events are off: start the daemon with --kv-events-watch"),
    # -- Session (in-band answers; bound-session errors: tests/service/test_session_stream.py)
    Row("Session", "no call set", session_stream(lambda c: pb.SessionRequest(id=1)), C.INVALID_ARGUMENT,
        r"^a SessionRequest must set one call$"),
    Row("Session", "unknown session", session_stream(
        lambda c: pb.SessionRequest(id=1, match=pb.MatchRequest(session="x" * 32))), C.UNAUTHENTICATED,
        r"unknown session 'xxxx"),
    Row("Session", "closed session", session_stream(
        lambda c: pb.SessionRequest(id=1, evict=pb.EvictRequest(session=c["closed"], num_pages=1))),
        C.UNAUTHENTICATED, r"was closed \(closed by a Close call\); register again"),
    Row("Session", "no session", session_stream(
        lambda c: pb.SessionRequest(id=1, release=pb.ReleaseRequest(leases=[1]))), C.UNAUTHENTICATED,
        r"no session given"),
    Row("Session", "message over the size limit", session_stream(
        lambda c: pb.SessionRequest(id=1, echo=pb.EchoRequest(payload=HUGE))), C.RESOURCE_EXHAUSTED,
        r"larger than max"),
    Row("Echo", "message over the size limit", unary("Echo", lambda c: pb.EchoRequest(payload=HUGE)), C.RESOURCE_EXHAUSTED,
        r"larger than max"),
]


@pytest.mark.parametrize("row", TABLE, ids=str)
def test_bad_input(ctx, row):
    before = snapshot(ctx["stub"])
    code, message = row.call(ctx)
    assert code == row.code, f"{row}: got {code.name}: {message}"
    assert re.search(row.message, message) if row.message else message == "", f"{row}: message {message!r}"
    assert violations(ctx["stub"]) == []
    assert snapshot(ctx["stub"]) == before, f"{row} changed the daemon's state"


def test_every_rpc_has_rows():
    rpcs = {m.name for m in pb.DESCRIPTOR.services_by_name["RadixKV"].methods}
    assert rpcs == {r.rpc for r in TABLE}


def test_stateful_rows_in_order(ctx):
    """LoadBack with too many pages loads and returns the extra one unused; an ack sent
    while that copy runs is answered once the copy completed (the bytes are there);
    acking the same transfer again is NOT_FOUND."""
    a, stub = ctx["a"], ctx["stub"]
    lb = a.load_back(ctx["host_node"], [8, 9, 10, 11, 12])
    sent = time.monotonic()
    assert lb.transfer and lb.loaded_tokens == 16 and lb.unused_pages == pack([12])
    reply = a.ack(lb.transfer)
    waited = time.monotonic() - sent
    assert (reply.transfer, reply.code, reply.load_failed) == (lb.transfer, 0, False), reply
    assert waited > COPY_DELAY / 2, f"answered after {waited:.3f}s, before the copy ({COPY_DELAY}s) could finish"
    assert a.kv.mismatches([8, 9, 10, 11], page_keys(ctx["pq"], 4)[4:]) == (0, 0)
    assert violations(stub) == []
    again = a.ack(lb.transfer)
    assert again.code == C.NOT_FOUND.value[0] and "not a load-back in flight" in again.message
    assert violations(stub) == []


def test_no_traceback_for_caller_errors(ctx):
    log = ctx["daemon"].log()
    assert "Traceback" not in log and "level=error" not in log, log[-4000:]
