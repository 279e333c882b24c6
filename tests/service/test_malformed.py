"""Bytes that are not a valid request, on every method of every service the daemon
serves (found from the descriptors, so a new RPC or stream is covered without a new
row): garbage, a truncated message, invalid UTF-8 in a string field. Each is answered
INVALID_ARGUMENT naming the method, logged once at warning, never with a traceback, and
leaves the daemon as it was. On the ack stream, a malformed message after a valid
first one ends the stream (and with it the session) the same way.
"""

import re

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2  # noqa: F401  (registers the health descriptors)

from radixkv import messages as msg
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import DaemonProcess, stop_all, wait_for

from faultkit import LAYOUT, NUM_PAGES, RawSession, snapshot, stub_for, tokens, violations

C = grpc.StatusCode
SERVICES = ("radixkv.v1.RadixKV", "grpc.health.v1.Health")


def methods():
    pool = descriptor_pool.Default()
    for service in SERVICES:
        for m in pool.FindServiceByName(service).methods:
            yield m


def request_class(method):
    return message_factory.GetMessageClass(method.input_type)


def valid_bytes(method) -> bytes:
    """A valid request whose first string/bytes field holds 'abcd' ('' if it has none)."""
    msg = request_class(method)()
    for f in method.input_type.fields:
        if f.type in (f.TYPE_STRING, f.TYPE_BYTES) and not f.is_repeated:
            setattr(msg, f.name, "abcd" if f.type == f.TYPE_STRING else b"abcd")
            break
    return msg.SerializeToString()


def first_string_field(method):
    return next((f for f in method.input_type.fields
                 if f.type == f.TYPE_STRING and not f.is_repeated), None)


def cases(method):
    yield "garbage", b"\xff\xff\xff\xff"
    raw = valid_bytes(method)
    if raw:
        yield "truncated", raw[:-1]
    f = first_string_field(method)
    if f is not None and f.number < 16:
        yield "invalid utf-8 in a string field", bytes([(f.number << 3) | 2, 2, 0xff, 0xfe])


def call_raw(channel, method, raw: bytes) -> tuple[grpc.StatusCode, str]:
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.client_streaming and method.server_streaming:
        call = channel.stream_stream(path)(iter([raw]), timeout=10)
    elif method.client_streaming:
        call = channel.stream_unary(path)
        return _status(lambda: call(iter([raw]), timeout=10))
    elif method.server_streaming:
        call = channel.unary_stream(path)(raw, timeout=10)
    else:
        return _status(lambda: channel.unary_unary(path)(raw, timeout=10))
    return _status(lambda: list(call))


def _status(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return C.OK, ""


@pytest.fixture(scope="module")
def ctx():
    d = DaemonProcess()
    d.start()
    channel, stub = stub_for(d.target)
    a = RawSession(stub, "wire/a")
    a.insert(tokens(0, 2), [0, 1])
    yield dict(daemon=d, channel=channel, stub=stub, a=a)
    a.close()
    channel.close()
    stop_all([d])


ROWS = [(m, name, raw) for m in methods() for name, raw in cases(m)]


@pytest.mark.parametrize("method,case,raw", ROWS, ids=[f"{m.name}: {c}" for m, c, _ in ROWS])
def test_malformed_request(ctx, method, case, raw):
    before = snapshot(ctx["stub"])
    logged = ctx["daemon"].log().count("event=rpc.malformed")
    code, message = call_raw(ctx["channel"], method, raw)
    assert code == C.INVALID_ARGUMENT, f"{method.name} ({case}): {code.name}: {message}"
    assert message.startswith(f"{method.name}: the request ({len(raw)} bytes) is not a valid protobuf message")
    wait_for(lambda: ctx["daemon"].log().count("event=rpc.malformed") == logged + 1, 10,
             "one rpc.malformed warning")
    assert violations(ctx["stub"]) == []
    assert snapshot(ctx["stub"]) == before


def test_every_request_stream_is_covered():
    streams = {m.name for m in methods() if m.client_streaming}
    assert "Acks" in streams and streams <= {m.name for m, _, _ in ROWS}


def test_malformed_ack_after_a_valid_one_ends_the_stream(ctx):
    """The stream ends INVALID_ARGUMENT and its session is closed, as whenever its ack
    stream ends; the daemon serves on."""
    stub = ctx["stub"]
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    try:
        session = stub.Register(msg.register_request(
            "wire/acks", LAYOUT, buffers.specs(), NUM_PAGES, backend="shm", device=0, write_policy="write_back",
            host_pool_pages=64, replace_existing=False, engine="test", model="")).session
        first = pb.AckRequest(session=session).SerializeToString()
        code, message = call_stream(ctx["channel"], "/radixkv.v1.RadixKV/Acks", [first, b"\x10\xff"])
        assert code == C.INVALID_ARGUMENT and message.startswith("Acks: the request (2 bytes)"), (code, message)
        closed = wait_for(lambda: _status(lambda: stub.Match(pb.MatchRequest(session=session)))[1], 10,
                          "the session to close")
        assert "was closed (ack stream ended)" in closed
        assert violations(stub) == []
    finally:
        buffers.close()


def call_stream(channel, path, messages) -> tuple[grpc.StatusCode, str]:
    return _status(lambda: list(channel.stream_stream(path)(iter(messages), timeout=10)))


def test_no_traceback_and_no_error_line(ctx):
    log = ctx["daemon"].log()
    assert "Traceback" not in log and "level=error" not in log, log[-4000:]
    assert not re.search(r"UNKNOWN|Unexpected", log)


def test_oversized_messages_on_the_streams(daemon_factory):
    """Over --max-message-size, on both streams: RESOURCE_EXHAUSTED from gRPC itself
    (before the daemon reads it; not logged), and the daemon serves on."""
    d = daemon_factory("--max-message-size", "1MiB")
    channel, stub = stub_for(d.target, **{"grpc.max_send_message_length": 8 << 20})
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    try:
        session = stub.Register(msg.register_request(
            "wire/big", LAYOUT, buffers.specs(), NUM_PAGES, backend="shm", device=0, write_policy="write_back",
            host_pool_pages=64, replace_existing=False, engine="test", model="")).session
        big = pb.AckRequest(session="x" * (2 << 20)).SerializeToString()
        code, message = call_stream(channel, "/radixkv.v1.RadixKV/Acks",
                                    [pb.AckRequest(session=session).SerializeToString(), big])
        assert code == C.RESOURCE_EXHAUSTED and "larger than max" in message, (code, message)
        code, message = _status(lambda: list(channel.unary_stream("/radixkv.v1.RadixKV/Prefetch")(big, timeout=10)))
        assert code == C.RESOURCE_EXHAUSTED and "larger than max" in message, (code, message)
        assert violations(stub) == []
    finally:
        channel.close()
        buffers.close()
