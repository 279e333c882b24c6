"""Refusals an engine must tell apart within one status code carry a reason: a unary
call's `google.rpc.ErrorInfo` in its status details (read here with grpc_status, as any
gRPC library's rich-error reader does), a Session stream call's `CallStatus.reason`, a
stream's own end too. Before, an engine written from the .proto alone told "register
again" from "fix your configuration" by matching message text (the proto-only
integrator's review)."""

import re
import threading
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from radixkv import errors
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc
from radixkv_server.service import reasons

from tests.support.engine import LAYOUT

REPO = Path(__file__).resolve().parents[2]
NUM_PAGES = 16  # conftest's `buffers`
NAMESPACE = "reasons/ns"


@pytest.fixture
def stub(daemon):
    channel = grpc.insecure_channel(daemon)
    yield pb_grpc.RadixKVStub(channel)
    channel.close()


def info_of(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo of a failed call's status details (fails the test without)."""
    status = rpc_status.from_call(err)
    assert status is not None, f"no status details in {err.code()}: {err.details()}"
    assert status.code == err.code().value[0] and status.message == err.details()
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    assert info.domain == "radixkv"
    return info


def raw_register(stub, buffers, **fields) -> str:
    layout = pb.KvLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                         head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, page_size=LAYOUT.page_size)
    request = pb.RegisterRequest(
        namespace=NAMESPACE, backend="shm", num_device_pages=NUM_PAGES, layout=layout, host_pool_pages=16,
        buffers=[pb.DeviceBuffer(handle=s.handle, offset=s.offset, size=s.size) for s in buffers.specs()], **fields)
    return stub.Register(request, timeout=10).session


def test_session_refusals_say_which_and_name_the_session(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Match(pb.MatchRequest(session="gone-1234"), timeout=10)
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    info = info_of(e.value)
    assert (info.reason, dict(info.metadata)) == ("SESSION_UNKNOWN", {"session": "gone-1234"})
    with pytest.raises(grpc.RpcError) as e:
        stub.Match(pb.MatchRequest(), timeout=10)
    assert info_of(e.value).reason == "SESSION_REQUIRED"


def test_registration_refusals_of_one_code_are_told_apart(daemon, stub, buffers):
    """FAILED_PRECONDITION means "pass replace_existing" for one and "use another
    namespace name" for the other: the reason (and the field that differs) says which."""
    session = raw_register(stub, buffers[0])
    with pytest.raises(grpc.RpcError) as e:
        raw_register(stub, buffers[1])
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert info_of(e.value).reason == "NAMESPACE_ATTACHED"
    with pytest.raises(grpc.RpcError) as e:
        raw_register(stub, buffers[1], replace_existing=True, model="another-model")
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    info = info_of(e.value)
    assert (info.reason, dict(info.metadata)) == ("NAMESPACE_MISMATCH", {"field": "model"})
    # The Python client raises them with `reason` and `metadata`.
    with Client(daemon, timeout=10) as kv:
        with pytest.raises(errors.FailedPrecondition) as refused:
            kv.register(NAMESPACE, LAYOUT, buffers[1].specs(), NUM_PAGES, host_pool_pages=16,
                        replace_existing=True, write_policy="write_back")
        assert (refused.value.reason, refused.value.metadata) == ("NAMESPACE_MISMATCH", {"field": "write_policy"})
    stub.Close(pb.CloseRequest(session=session), timeout=10)


def test_a_stream_call_and_a_stream_end_carry_reasons(stub, buffers):
    """A Release of leases no session holds, on the Session stream, says LEASE_UNKNOWN and
    which; a second Acks stream of the session is STREAM_EXISTS; the session's streams,
    once another engine's Register replaced it, end SESSION_REPLACED."""
    session = raw_register(stub, buffers[0])
    done = threading.Event()

    def held(requests):
        yield from requests
        done.wait(60)

    try:
        acks = stub.Acks(held([pb.AckRequest(session=session), pb.AckRequest(session=session, transfer=77)]),
                         timeout=10)
        assert next(acks).transfer == 77  # bound
        calls = stub.Session(held([pb.SessionRequest(id=1, release=pb.ReleaseRequest(session=session,
                                                                                     leases=[5, 6]))]), timeout=10)
        error = next(calls).error
        assert error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert (error.reason, dict(error.metadata)) == ("LEASE_UNKNOWN", {"leases": "5,6"})
        second = stub.Acks(iter([pb.AckRequest(session=session)]), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            next(second)
        assert info_of(e.value).reason == "STREAM_EXISTS"
        raw_register(stub, buffers[1], replace_existing=True)
        with pytest.raises(grpc.RpcError) as e:
            next(acks)
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert info_of(e.value).reason == "SESSION_REPLACED"
    finally:
        done.set()


def test_limits_name_the_flag_that_sets_them(daemon_factory):
    d = daemon_factory("--max-namespaces", "1")
    made = [ShmKvBuffers.create(LAYOUT, NUM_PAGES) for _ in range(2)]
    try:
        with Client(d.target, timeout=10) as first, Client(d.target, timeout=10) as second:
            first.register("limits/a", LAYOUT, made[0].specs(), NUM_PAGES, host_pool_pages=16)
            with pytest.raises(errors.ResourceExhausted) as e:
                second.register("limits/b", LAYOUT, made[1].specs(), NUM_PAGES, host_pool_pages=16)
            assert (e.value.reason, e.value.metadata) == ("LIMIT_REACHED", {"limit": "--max-namespaces"})
    finally:
        for b in made:
            b.close()


def test_every_reason_is_in_the_contract_and_the_engines_guide():
    """The proto's wire conventions list every reason, and docs/engines.md says what each
    asks of an engine: a reason added in the code alone is one no engine knows of."""
    proto = (REPO / "proto/radixkv/v1/radixkv.proto").read_text()
    listed = set(re.findall(r"\b[A-Z]+(?:_[A-Z]+)+\b", proto.split("Reasons:")[1].split("(docs/engines.md")[0]))
    assert listed == set(reasons.ALL)
    guide = (REPO / "docs/engines.md").read_text()
    assert [r for r in reasons.ALL if f"`{r}`" not in guide] == []
