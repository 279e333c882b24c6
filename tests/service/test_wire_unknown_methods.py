"""Callers may name any method: the daemon's guarded generic handlers keep an entry per
method that exists, never one per name a caller tried (a month of probes, scanners or
misconfigured clients would otherwise grow the table without end)."""

from types import SimpleNamespace

import grpc

from radixkv_server.service.wire import guarded


class Service(grpc.GenericRpcHandler):
    """A generic handler (as reflection and health are) knowing one method."""

    def __init__(self):
        async def echo(request, context):
            return request

        self.handler = grpc.unary_unary_rpc_method_handler(echo, request_deserializer=bytes)

    def service(self, details):
        return self.handler if details.method == "/svc/Echo" else None


class Server:
    def add_generic_rpc_handlers(self, handlers):
        self.handlers = handlers


def test_unknown_method_names_are_answered_unimplemented_and_not_kept():
    server = Server()
    guarded(server).add_generic_rpc_handlers([Service()])
    [generic] = server.handlers
    for i in range(2000):
        assert generic.service(SimpleNamespace(method=f"/svc/Probe{i}")) is None  # grpc: UNIMPLEMENTED
    echo = generic.service(SimpleNamespace(method="/svc/Echo"))
    assert echo is not None and echo is generic.service(SimpleNamespace(method="/svc/Echo"))  # guarded once
    assert len(generic._cache) == 1, f"{len(generic._cache)} method names kept"
