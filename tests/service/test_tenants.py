"""Tenants kept apart by their tokens (a real daemon with a token file).

Each token grants some namespaces (glob patterns) or all of them (an operator). An
engine cannot register into, match in, load into, evict from or ack for a namespace its
token does not grant, even holding another tenant's session id; operators' RPCs show a
tenant only what it may see, and never name another tenant's namespaces; a tenant's
WatchEvents stream carries only its namespaces' KV events.
"""

import grpc
import pytest

from radixkv import errors
from radixkv.client import Client
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.engine import EngineDouble, prompt

from faultkit import stub_for

OPERATOR, ALICE, BOB = "op-0d7e", "alice-93be", "bob-5a6f"
TOKEN_FILE = f"""# tokens for the tenant tests
{OPERATOR}
{ALICE}   alice/*  shared-?   # alice's models, and the shared pattern
{BOB}     bob/*  shared-?    # bob's, and one shared pattern
"""
C = grpc.StatusCode


def auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return C.OK, ""


@pytest.fixture
def tenants(daemon_factory, tmp_path):
    path = tmp_path / "tokens"
    path.write_text(TOKEN_FILE)
    d = daemon_factory("--auth-token-file", str(path), "--kv-events-watch", "true")
    engines, sessions = {}, {}
    for token, namespace in ((ALICE, "alice/m1"), (BOB, "bob/m1")):
        engine = EngineDouble(num_pages=32)
        reg = engine.register(Client(d.target, timeout=10, token=token), namespace, write_policy="write_back")
        engines[namespace], sessions[namespace] = engine, reg.session
    channel, stub = stub_for(d.target)
    yield dict(daemon=d, stub=stub, alice=engines["alice/m1"], bob=engines["bob/m1"],
               alice_session=sessions["alice/m1"])
    channel.close()
    for e in engines.values():
        e.close()
    log = d.log()  # whatever the test made it refuse and say: never a token
    assert all(t not in log for t in (OPERATOR, ALICE, BOB)), "a token in the daemon's log"


def test_register_only_where_granted(tenants):
    alice = tenants["alice"]
    with Client(tenants["daemon"].target, timeout=10, token=ALICE) as c:
        with pytest.raises(errors.PermissionDenied,
                           match=r"this token does not grant namespace 'bob/x' \(it grants: alice/\*, shared-\?\)"):
            c.register("bob/x", alice.layout, alice.buffers.specs, 32)
    with Client(tenants["daemon"].target, timeout=10, token=BOB) as c:
        with pytest.raises(errors.PermissionDenied, match="'shared-xy'"):
            c.register("shared-xy", alice.layout, alice.buffers.specs, 32)  # '?' is one character
    assert [ns.namespace for ns in Client(tenants["daemon"].target, token=OPERATOR).stats().namespaces] == \
        ["alice/m1", "bob/m1"]


def test_another_tenants_session_is_refused(tenants):
    """Bob holding Alice's session id gets PERMISSION_DENIED for every call, and Alice's
    namespace is untouched (her engine's pages and counters)."""
    stub, alice, bob = tenants["stub"], tenants["alice"], tenants["bob"]
    alice.prefill(prompt(1, pages=4))
    sid = tenants["alice_session"]
    before = stub.Inspect(pb.InspectRequest(namespace="alice/m1"), metadata=auth(OPERATOR)).digest
    calls = {
        "Match": lambda: stub.Match(pb.MatchRequest(session=sid, prompts=[pb.Prompt(tokens=pack(prompt(1)))]),
                                    metadata=auth(BOB)),
        "Evict": lambda: stub.Evict(pb.EvictRequest(session=sid, num_pages=4), metadata=auth(BOB)),
        "Insert": lambda: stub.Insert(pb.InsertRequest(session=sid, tokens=pack(prompt(9, 1)), device_pages=pack([30])),
                                      metadata=auth(BOB)),
        "LoadBack": lambda: stub.LoadBack(pb.LoadBackRequest(session=sid, node=1, device_pages=pack([30])),
                                          metadata=auth(BOB)),
        "Release": lambda: stub.Release(pb.ReleaseRequest(session=sid, leases=[1]), metadata=auth(BOB)),
        "Close": lambda: stub.Close(pb.CloseRequest(session=sid), metadata=auth(BOB)),
        "Prefetch": lambda: list(stub.Prefetch(pb.PrefetchRequest(session=sid, tokens=pack(prompt(1))),
                                               metadata=auth(BOB))),
        "Acks": lambda: list(stub.Acks(iter([pb.AckRequest(session=sid)]), metadata=auth(BOB))),
    }
    for name, call in calls.items():
        code, message = code_of(call)
        assert code == C.PERMISSION_DENIED and "does not grant namespace 'alice/m1'" in message, (name, code, message)
    on_stream = [  # the Session stream answers each in-band, as the unary calls above
        pb.SessionRequest(id=1, match=pb.MatchRequest(session=sid, prompts=[pb.Prompt(tokens=pack(prompt(1)))])),
        pb.SessionRequest(id=2, evict=pb.EvictRequest(session=sid, num_pages=4)),
        pb.SessionRequest(id=3, release=pb.ReleaseRequest(session=sid, leases=[1])),
    ]
    replies = list(stub.Session(iter(on_stream), metadata=auth(BOB)))
    assert [r.id for r in replies] == [1, 2, 3]
    for r in replies:
        assert r.error.code == C.PERMISSION_DENIED.value[0] and "does not grant namespace 'alice/m1'" in r.error.message
    assert stub.Inspect(pb.InspectRequest(namespace="alice/m1"), metadata=auth(OPERATOR)).digest == before
    assert alice.client.match([pack(prompt(1, pages=4))])[0].device_tokens == 16  # still hers, still working
    assert bob.client.match([pack(prompt(1, pages=4))])[0].device_tokens == 0  # namespaces are apart


def test_a_session_in_a_shared_namespace_is_its_own_tokens(tenants):
    """Both tenants' tokens grant namespace shared-a, where Alice's engine registered:
    Stats shows Bob only the first characters of her session's id, and Bob holding the
    whole id still cannot act as her engine (match, evict, close, bind its streams). An
    operator's token can still close it."""
    d, stub = tenants["daemon"], tenants["stub"]
    engine = EngineDouble(num_pages=32)
    try:
        sid = engine.register(Client(d.target, timeout=10, token=ALICE), "shared-a").session
        engine.prefill(prompt(2, pages=4))
        shown = {token: [s.session for s in stub.Stats(pb.StatsRequest(namespace="shared-a"),
                                                       metadata=auth(token)).namespaces[0].sessions]
                 for token in (ALICE, BOB, OPERATOR)}
        assert shown == {ALICE: [sid], BOB: [sid[:8]], OPERATOR: [sid]}
        calls = {
            "Match": lambda: stub.Match(pb.MatchRequest(session=sid, prompts=[pb.Prompt(tokens=pack(prompt(2)))]),
                                        metadata=auth(BOB)),
            "Evict": lambda: stub.Evict(pb.EvictRequest(session=sid, num_pages=4), metadata=auth(BOB)),
            "Close": lambda: stub.Close(pb.CloseRequest(session=sid), metadata=auth(BOB)),
            "Acks": lambda: list(stub.Acks(iter([pb.AckRequest(session=sid)]), metadata=auth(BOB))),
        }
        for name, call in calls.items():
            code, message = code_of(call)
            assert code == C.PERMISSION_DENIED and "registered with another token" in message, (name, code, message)
        [reply] = stub.Session(iter([pb.SessionRequest(id=1, evict=pb.EvictRequest(session=sid, num_pages=4))]),
                               metadata=auth(BOB))
        assert "registered with another token" in reply.error.message
        with Client(d.target, timeout=10, token=BOB) as bob:  # nor replace her engine by registering
            with pytest.raises(errors.PermissionDenied, match="registered with another token"):
                bob.register("shared-a", engine.layout, tenants["bob"].buffers.specs, 32, replace_existing=True)
        assert engine.client.match([pack(prompt(2, pages=4))])[0].device_tokens == 16  # hers, untouched
        stub.Close(pb.CloseRequest(session=sid), metadata=auth(OPERATOR))  # an operator may
        with pytest.raises(errors.RadixKVError):
            engine.client.match([pack(prompt(2, pages=4))])
    finally:
        engine.close()


def test_operator_rpcs_show_only_what_the_caller_may_see(tenants):
    stub, alice = tenants["stub"], tenants["alice"]
    stats = stub.Stats(pb.StatsRequest(), metadata=auth(ALICE))
    assert [ns.namespace for ns in stats.namespaces] == ["alice/m1"] and stats.sessions == 1
    assert stub.CheckInvariants(pb.CheckInvariantsRequest(), metadata=auth(ALICE)).namespaces_checked == 1
    assert stub.CheckInvariants(pb.CheckInvariantsRequest(), metadata=auth(OPERATOR)).namespaces_checked == 2
    for call in (lambda: stub.Stats(pb.StatsRequest(namespace="bob/m1"), metadata=auth(ALICE)),
                 lambda: stub.Inspect(pb.InspectRequest(namespace="bob/m1"), metadata=auth(ALICE)),
                 lambda: stub.CheckInvariants(pb.CheckInvariantsRequest(namespace="bob/m1"), metadata=auth(ALICE))):
        code, message = code_of(call)
        assert code == C.PERMISSION_DENIED and "'bob/m1'" in message, (code, message)
    code, message = code_of(lambda: stub.Inspect(pb.InspectRequest(namespace="alice/none"), metadata=auth(ALICE)))
    assert code == C.NOT_FOUND and message == "no namespace 'alice/none'; known: ['alice/m1']"
    # An unknown namespace of another tenant is refused the same way as a known one.
    code, _ = code_of(lambda: stub.Stats(pb.StatsRequest(namespace="bob/none"), metadata=auth(ALICE)))
    assert code == C.PERMISSION_DENIED
    # Leases show in Stats.
    alice.prefill(prompt(2, pages=2))
    [m] = alice.client.match([pack(prompt(2, pages=2))], lease=True)
    [ns] = stub.Stats(pb.StatsRequest(namespace="alice/m1"), metadata=auth(ALICE)).namespaces
    assert ns.leases == 1 and ns.oldest_lease_seconds > 0
    alice.client.release([m.lease])
    [ns] = stub.Stats(pb.StatsRequest(namespace="alice/m1"), metadata=auth(ALICE)).namespaces
    assert ns.leases == 0 and ns.oldest_lease_seconds == 0


def stored_tokens(batch: pb.KvEventBatch) -> set[int]:
    return {t for e in batch.events if e.kind == pb.KvEvent.BLOCK_STORED for t in e.token_ids}


def watch_until(stub, token: str, request: pb.WatchEventsRequest, done) -> list[pb.KvEventBatch]:
    """The batches of a WatchEvents stream up to the first one for which `done(batch)`
    (DEADLINE_EXCEEDED, failing the test, if none comes within 10 s)."""
    call = stub.WatchEvents(request, metadata=auth(token), timeout=10)
    batches = []
    for batch in call:
        batches.append(batch)
        if done(batch):
            break
    call.cancel()
    return batches


def test_watch_events_carry_only_the_tenants_namespaces(tenants):
    """Alice's WatchEvents of her namespace, replayed from seq 0, holds every batch of
    hers the operator's unscoped stream holds and none of Bob's (his token ids never
    reach her); Bob's namespace, one she could only match by pattern, and no namespace
    at all are PERMISSION_DENIED for her token."""
    stub, alice, bob = tenants["stub"], tenants["alice"], tenants["bob"]
    alice.prefill(prompt(5, pages=2))
    bob.prefill(prompt(6, pages=2))
    alice.prefill(prompt(7, pages=2))  # after Bob's: Alice's stream must pass his batches to reach it
    last = set(prompt(7, pages=2))
    everything = watch_until(stub, OPERATOR, pb.WatchEventsRequest(from_seq=0),
                             lambda b: b.namespace == "alice/m1" and last <= stored_tokens(b))
    assert {"alice/m1", "bob/m1"} <= {b.namespace for b in everything}
    hers = watch_until(stub, ALICE, pb.WatchEventsRequest(namespace="alice/m1", from_seq=0),
                       lambda b: b.seq >= everything[-1].seq)
    assert {b.namespace for b in hers} <= {"alice/m1", ""}
    assert [b.seq for b in hers if b.namespace] == [b.seq for b in everything if b.namespace == "alice/m1"]
    assert not set().union(*map(stored_tokens, hers)) & set(prompt(6, pages=2))
    for namespace, says in (("bob/m1", "does not grant namespace 'bob/m1'"),
                            ("bob/none", "does not grant namespace 'bob/none'"),
                            ("", "WatchEvents must name one")):
        code, message = code_of(lambda: watch_until(stub, ALICE, pb.WatchEventsRequest(namespace=namespace),
                                                    lambda b: True))
        assert code == C.PERMISSION_DENIED and says in message, (namespace, code, message)


def test_a_token_the_token_file_no_longer_holds_is_refused_on_streams_opened_before(tenants, tmp_path):
    """A reload (SIGHUP) that removes a token refused its unary calls at once, but the
    Session stream and WatchEvents it had opened kept their grant: the revoked engine
    went on matching and inserting, and its watcher on receiving batches. And an engine
    with nothing to send kept its session, leases and mappings (its token was checked
    on its next message only), so DropNamespace was refused (the multi-tenant operator's
    review): the reload now closes the sessions whose token no longer grants them."""
    import queue
    import signal

    from tests.support.daemon import wait_for

    d, stub, sid = tenants["daemon"], tenants["stub"], tenants["alice_session"]
    asks: queue.Queue = queue.Queue()
    calls = stub.Session(iter(asks.get, None), metadata=auth(ALICE))

    def match(i: int) -> pb.SessionResponse:
        asks.put(pb.SessionRequest(id=i, match=pb.MatchRequest(session=sid, prompts=[pb.Prompt(tokens=pack(prompt(1)))])))
        return next(calls)

    try:
        assert not match(1).error.code
        watch = stub.WatchEvents(pb.WatchEventsRequest(namespace="alice/m1"), metadata=auth(ALICE))
        (tmp_path / "tokens").write_text(TOKEN_FILE.replace(ALICE, "# alice left:"))
        d.signal(signal.SIGHUP)
        wait_for(lambda: "event=auth.reloaded" in d.log(), 10, "the token file reloaded")
        with pytest.raises(grpc.RpcError) as ended:  # nothing sent: the session is closed all the same
            next(calls)
        assert ended.value.code() == C.ABORTED and "no longer grants the namespace" in ended.value.details()
        # No operator had to find and close it: DropNamespace (refused while it was attached) goes through.
        stub.DropNamespace(pb.DropNamespaceRequest(namespace="alice/m1"), metadata=auth(OPERATOR))  # a batch for it
        assert code_of(lambda: next(watch))[0] == C.UNAUTHENTICATED
    finally:
        asks.put(None)


def test_a_rotated_operator_token_is_refused_on_its_open_streams(daemon_factory, tmp_path):
    """A file of tokens that each grant everything (the common rotation: one `*` token
    replaced by another) scopes nothing; the streams of the removed token still went on
    after the reload, as only scoped files were looked up again."""
    import queue
    import signal

    from tests.support.daemon import wait_for

    path = tmp_path / "tokens"
    path.write_text("old-token\n")
    d = daemon_factory("--auth-token-file", str(path))
    engine = EngineDouble(num_pages=32)
    try:
        sid = engine.register(Client(d.target, timeout=10, token="old-token"), "any/m").session
        channel, stub = stub_for(d.target)
        asks: queue.Queue = queue.Queue()
        calls = stub.Session(iter(asks.get, None), metadata=auth("old-token"))
        asks.put(pb.SessionRequest(id=1, evict=pb.EvictRequest(session=sid, num_pages=1)))
        assert not next(calls).error.code
        path.write_text("new-token\n")
        d.signal(signal.SIGHUP)
        wait_for(lambda: "event=auth.reloaded" in d.log(), 10, "the token file reloaded")
        with pytest.raises(grpc.RpcError) as ended:  # its session closed by the reload
            next(calls)
        assert ended.value.code() == C.ABORTED
        asks.put(None)
        channel.close()
    finally:
        engine.close()


def test_refusals_never_name_another_tenants_namespaces(tenants, daemon_factory, tmp_path):
    """DropNamespace's NOT_FOUND listed every namespace, and the host budget's refusal
    every pool with its size, whoever asked (the multi-tenant operator's review)."""
    stub = tenants["stub"]
    code, message = code_of(lambda: stub.DropNamespace(pb.DropNamespaceRequest(namespace="alice/typo"),
                                                       metadata=auth(ALICE)))
    assert (code, message) == (C.NOT_FOUND, "no namespace 'alice/typo'; known: ['alice/m1']")
    path = tmp_path / "budget-tokens"
    path.write_text(TOKEN_FILE)
    pool = 32 * tenants["alice"].layout.page_bytes
    d = daemon_factory("--auth-token-file", str(path), "--max-host-memory", str(2 * pool))
    engines = [EngineDouble(num_pages=32) for _ in range(3)]
    try:
        engines[0].register(Client(d.target, timeout=10, token=BOB), "bob/secret-model", host_pool_pages=32)
        engines[1].register(Client(d.target, timeout=10, token=ALICE), "alice/m1", host_pool_pages=32)
        with pytest.raises(errors.ResourceExhausted) as refused:
            engines[2].register(Client(d.target, timeout=10, token=ALICE), "alice/m2", host_pool_pages=32)
        assert "bob" not in refused.value.message
        assert f"pools held: alice/m1: {pool}, other namespaces (1): {pool}" in refused.value.message
    finally:
        for e in engines:
            e.close()


def test_only_an_operator_drops_a_namespace_other_tokens_share(tenants):
    """A tenant could drop a namespace it shares with another, losing the other's warm
    host tier between two of its engine's restarts."""
    stub, alice = tenants["stub"], tenants["alice"]
    for namespace in ("shared-1", "alice/m2"):
        engine = EngineDouble(num_pages=32)
        engine.register(Client(tenants["daemon"].target, timeout=10, token=ALICE), namespace)
        engine.close()
    with pytest.raises(grpc.RpcError) as refused:
        stub.DropNamespace(pb.DropNamespaceRequest(namespace="shared-1"), metadata=auth(ALICE))
    assert refused.value.code() == C.PERMISSION_DENIED and "granted to other tokens too" in refused.value.details()
    stub.DropNamespace(pb.DropNamespaceRequest(namespace="alice/m2"), metadata=auth(ALICE))  # her own alone
    stub.DropNamespace(pb.DropNamespaceRequest(namespace="shared-1"), metadata=auth(OPERATOR))
    assert [ns.namespace for ns in stub.Stats(pb.StatsRequest(), metadata=auth(OPERATOR)).namespaces] == \
        ["alice/m1", "bob/m1"]
    assert alice.client.check_invariants() == []
