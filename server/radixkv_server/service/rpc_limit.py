"""`--max-concurrent-rpcs`, counted over the cache's own RPCs only.

gRPC's `maximum_concurrent_rpcs` counts every call the server holds, health checks
included: a client that fills it with streams it never uses (or a burst of engines) had
the liveness probe refused too, and a supervisor restarted the daemon, taking every
namespace's host tier with it. `RpcLimit` counts the RadixKV service's calls and refuses
the one past the limit with RESOURCE_EXHAUSTED; health checks and reflection (grpcurl)
are not counted, and gRPC's own limit sits `RESERVE` calls above, so they keep a share of
their own and the server as a whole stays bounded.
"""

import inspect
from collections.abc import Callable

import grpc
from radixkv.v1 import radixkv_pb2 as pb

COUNTED_PREFIX = f"/{pb.DESCRIPTOR.services_by_name['RadixKV'].full_name}/"
RESERVE = 64  # calls that only health checks and reflection can take


class RpcLimit(grpc.aio.ServerInterceptor):
    """At most `limit` RadixKV calls in progress; the next one is answered
    RESOURCE_EXHAUSTED before its handler runs. `on_refused(method)` (the short name) is
    told of each refusal (metrics). Runs on the server's event loop only."""

    def __init__(self, limit: int, on_refused: Callable[[str], None] | None = None):
        self.limit = limit
        self.in_flight = 0
        self._on_refused = on_refused

    @staticmethod
    def server_limit(limit: int) -> int:
        """gRPC's own `maximum_concurrent_rpcs` for a daemon counting `limit` calls."""
        return limit + RESERVE

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(COUNTED_PREFIX):
            return handler
        return self._counted(handler, details.method.rsplit("/", 1)[-1])

    async def _enter(self, context, method: str) -> None:
        """Take a slot, or end the call RESOURCE_EXHAUSTED (raises)."""
        if self.in_flight >= self.limit:
            if self._on_refused is not None:
                self._on_refused(method)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Concurrent RPC limit exceeded: {self.in_flight} RadixKV calls in progress, the limit "
                f"(--max-concurrent-rpcs) is {self.limit}; each engine holds its Acks and Session streams")
        self.in_flight += 1

    def _counted(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        kind = {(False, False): "unary_unary", (False, True): "unary_stream",
                (True, False): "stream_unary", (True, True): "stream_stream"}[
            (handler.request_streaming, handler.response_streaming)]
        behaviour = getattr(handler, kind)

        if inspect.isasyncgenfunction(behaviour):
            async def generate(request, context):
                await self._enter(context, method)
                try:
                    async for reply in behaviour(request, context):
                        yield reply
                finally:
                    self.in_flight -= 1
            return handler._replace(**{kind: generate})

        async def call(request, context):
            await self._enter(context, method)
            try:
                return await behaviour(request, context)
            finally:
                self.in_flight -= 1
        return handler._replace(**{kind: call})


__all__ = ["RpcLimit"]
