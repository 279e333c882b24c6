"""`--max-concurrent-rpcs`, counted over the cache's own RPCs only.

gRPC's `maximum_concurrent_rpcs` counts every call the server holds, health checks
included: a client that fills it with streams it never uses (or a burst of engines) had
the liveness probe refused too, and a supervisor restarted the daemon, taking every
namespace's host tier with it. `RpcLimit` counts the calls of one kind and refuses the
one past its limit with RESOURCE_EXHAUSTED before its handler runs. The daemon counts
RadixKV calls against `--max-concurrent-rpcs`, and health watches and reflection
(grpcurl) against RESERVE // 2; gRPC's own limit sits RESERVE calls above the first, so
health checks (`Health/Check`, what probes call) always keep room.

A call counts from the moment its handler runs to its end: a call held in a handler
(a stream, a Match waiting for storage) counts, a unary call answered within one loop
turn hardly does, and a unary call whose request has not arrived yet does not (gRPC reads
a unary request before the handler runs). Those are bounded by gRPC's own limit only.
"""

import inspect
from collections.abc import Callable

import grpc
from radixkv.v1 import radixkv_pb2 as pb

from . import reasons
from .errors import Refusal
from .wire import handler_kind

RADIXKV_PREFIX = f"/{pb.DESCRIPTOR.services_by_name['RadixKV'].full_name}/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
RESERVE = 64  # calls above --max-concurrent-rpcs that only health and reflection can take


def is_radixkv(method: str) -> bool:
    return method.startswith(RADIXKV_PREFIX)


def is_other_than_a_check(method: str) -> bool:
    """Health watches and reflection: what is neither RadixKV nor a health check."""
    return not method.startswith(RADIXKV_PREFIX) and method != HEALTH_CHECK


class RpcLimit(grpc.aio.ServerInterceptor):
    """At most `limit` calls of the methods `counts` names in progress; the next one is
    answered RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded: ..." naming `what` and
    `flag`. `on_refused(method)` (the short name) is told of each refusal (metrics). Runs
    on the server's event loop only."""

    def __init__(self, limit: int, on_refused: Callable[[str], None] | None = None, *,
                 counts: Callable[[str], bool] = is_radixkv, what: str = "RadixKV calls",
                 flag: str = "--max-concurrent-rpcs"):
        self.limit = limit
        self.in_flight = 0
        self._on_refused = on_refused
        self._counts = counts
        self._what, self._flag = what, flag
        self._wrapped: dict[str, tuple] = {}  # method -> (its handler, that handler counted)

    @staticmethod
    def server_limit(limit: int) -> int:
        """gRPC's own `maximum_concurrent_rpcs` for a daemon counting `limit` RadixKV calls."""
        return limit + RESERVE

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or not self._counts(method):
            return handler
        known = self._wrapped.get(method)
        if known is None or known[0] is not handler:
            known = self._wrapped[method] = (handler, self._counted(handler, method.rsplit("/", 1)[-1]))
        return known[1]

    async def _enter(self, context, method: str) -> None:
        """Take a slot, or end the call RESOURCE_EXHAUSTED (raises)."""
        if self.in_flight >= self.limit:
            if self._on_refused is not None:
                self._on_refused(method)
            flag = f" ({self._flag})" if self._flag else ""
            refusal = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"Concurrent RPC limit exceeded: {self.in_flight} {self._what} in progress, "
                              f"the limit{flag} is {self.limit}", reasons.LIMIT_REACHED, {"limit": self._flag})
            await context.abort(refusal.code, refusal.message, refusal.trailer())
        self.in_flight += 1

    def _counted(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        kind = handler_kind(handler)
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


__all__ = ["RESERVE", "RpcLimit", "is_other_than_a_check", "is_radixkv"]
