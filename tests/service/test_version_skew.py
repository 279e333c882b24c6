"""Version skew: a client newer than its daemon (docs/operations.md, "Upgrades: daemons
first"). A client made with stream=True against a daemon without the Session stream is
told so at `register`, and leaves nothing behind; its unary calls work with that daemon."""

import asyncio
import os

import grpc
import pytest

from radixkv import errors
from radixkv.aio import AsyncClient
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.reconnect import Backoff
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import wait_for
from tests.support.engine import LAYOUT, prompt

from faultkit import status, stub_for

C = grpc.StatusCode


# A daemon as the ones before the Session stream answer: the real daemon with that one
# RPC left out (UNIMPLEMENTED "Method not found!"), the rest unchanged; WITHOUT in the
# environment names another RPC to leave out.
OLDER_DAEMON = """
import os
import sys
import grpc
from radixkv.v1 import radixkv_pb2_grpc as generated

add = generated.add_RadixKVServicer_to_server


WITHOUT = os.environ.get("WITHOUT", "Session")


class WithoutSession:
    def __init__(self, server):
        self.server = server

    def add_registered_method_handlers(self, service, handlers):
        self.server.add_registered_method_handlers(service, {k: v for k, v in handlers.items() if k != WITHOUT})

    def add_generic_rpc_handlers(self, handlers):
        self.server.add_generic_rpc_handlers(tuple(Filtered(h) for h in handlers))


class Filtered(grpc.GenericRpcHandler):
    def __init__(self, inner):
        self.inner = inner

    def service(self, details):
        return None if details.method.endswith("/" + WITHOUT) else self.inner.service(details)


generated.add_RadixKVServicer_to_server = lambda servicer, server: add(servicer, WithoutSession(server))
from radixkv_server.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("client_class", [Client, AsyncClient])
def test_a_daemon_older_than_the_stream_is_said_at_register_not_taken_for_lost_sessions(daemon_factory,
                                                                                       client_class):
    """A client made with stream=True (the vLLM connector's) against a daemon without the
    Session RPC: every call on the stream failed UNIMPLEMENTED, each taken for a lost
    session and registered again, in a loop, at a 0% hit rate. Now register says so and
    leaves no session behind; stream=False works with that daemon."""
    d = daemon_factory(launcher=("-c", OLDER_DAEMON))
    stub = stub_for(d.target)[1]
    assert status(lambda: list(stub.Session(iter([pb.SessionRequest(id=1)]))))[0] == C.UNIMPLEMENTED
    buffers = ShmKvBuffers.create(LAYOUT, 8)
    try:
        options = dict(timeout=10, stream=True, reconnect=Backoff(0.01, 0.1))

        async def register():
            async with AsyncClient(d.target, **options) as client:
                await client.register("older/a", LAYOUT, buffers.specs(), 8)

        with pytest.raises(errors.Unimplemented, match="no Session stream: it is older than this client. Upgrade "
                                                       "the daemon, or make the client with stream=False"):
            if client_class is Client:
                client = Client(d.target, **options)
                try:
                    client.register("older/a", LAYOUT, buffers.specs(), 8)
                finally:
                    client.close()
                    with pytest.raises(ValueError, match="closed channel"):  # closed with the client
                        client._channel.unary_unary("/radixkv.v1.RadixKV/Echo")(b"")
            else:
                asyncio.run(register())
        wait_for(lambda: stub.Stats(pb.StatsRequest()).sessions == 0, 10, "no session left behind")
        with Client(d.target, timeout=10, stream=False) as unary:
            unary.register("older/a", LAYOUT, buffers.specs(), 8)
            assert unary.match([pack(prompt(1, 2))])[0].device_tokens == 0
    finally:
        buffers.close()


def test_a_call_the_daemon_lacks_names_itself_and_says_to_upgrade_the_daemon(daemon_factory):
    """gRPC's own "Method not found!" named neither the call nor the versions, after
    wait_ready had succeeded (the review from a packaging seat)."""
    d = daemon_factory(launcher=("-c", OLDER_DAEMON), env={**os.environ, "WITHOUT": "Stats"})
    with Client(d.target, timeout=10) as client:
        client.wait_ready()
        with pytest.raises(errors.Unimplemented, match=r"the daemon has no Stats call: it is older than this "
                                                       r"client \(radixkv \d"):
            client.stats()
