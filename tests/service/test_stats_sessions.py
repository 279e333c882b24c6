"""Stats lists each namespace's live sessions, so an operator can end one that no engine
will close (registered by hand, without an Acks stream) and free its namespace."""

import grpc
import pytest

from radixkv import Client
from radixkv import messages as msg
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc
from tests.support.daemon import wait_for

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", page_size=4)


def test_a_session_left_by_hand_is_listed_and_closed_by_its_id(daemon):
    buffers = ShmKvBuffers.create(LAYOUT, 16)
    engine = Client(daemon)
    channel = grpc.insecure_channel(daemon)
    stub = radixkv_pb2_grpc.RadixKVStub(channel)
    try:
        engine.register("ops/live", LAYOUT, buffers.specs(), 16, engine="live-engine")
        by_hand = stub.Register(msg.register_request(  # as from grpcurl: no Acks stream ever opens
            "ops/stuck", LAYOUT, buffers.specs(), 16, backend="shm", device=0, write_policy="",
            host_pool_pages=8, replace_existing=False, engine="by-hand", model="")).session
        def stats():
            return {ns.namespace: ns for ns in stub.Stats(pb.StatsRequest()).namespaces}
        # The client opens its Acks stream right after Register, without waiting for it.
        wait_for(lambda: stats()["ops/live"].sessions[0].streams_open, 10, "the engine's Acks stream open")
        [live] = stats()["ops/live"].sessions
        assert (live.session, live.engine) == (engine.registration.session, "live-engine")
        [stuck] = stats()["ops/stuck"].sessions
        assert (stuck.session, stuck.engine, stuck.streams_open) == (by_hand, "by-hand", False)
        assert stuck.leases == 0
        wait_for(lambda: stats()["ops/stuck"].sessions[0].age_seconds > stuck.age_seconds, 10,
                 "the stuck session's age to grow")  # how long it has been left: what the operator reads

        with pytest.raises(grpc.RpcError) as refused:
            stub.DropNamespace(pb.DropNamespaceRequest(namespace="ops/stuck"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stub.Close(pb.CloseRequest(session=stuck.session))  # what the operator does with the id
        assert stub.Stats(pb.StatsRequest(namespace="ops/stuck")).namespaces[0].sessions == []
        stub.DropNamespace(pb.DropNamespaceRequest(namespace="ops/stuck"))
    finally:
        engine.close()
        channel.close()
        buffers.close()
