"""The daemon's gRPC health service (grpc.health.v1): readiness ("radixkv.v1.RadixKV")
and liveness (""), answered by grpc's own aio servicer with two additions below."""

import asyncio

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    """grpc's health servicer, with List, and Watch streams that end once shutdown has
    begun, after telling the watcher NOT_SERVING. Otherwise a single watcher (grpc client-side
    health checking, a proxy) would hold server.stop() for the whole grace period."""

    def __init__(self):
        super().__init__()
        self._shutting_down = asyncio.Event()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._shutting_down.set()

    async def List(self, request, context):
        """Every service's status (grpc's aio servicer leaves List to a base method that
        raises NotImplementedError, logged with a traceback)."""
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()})

    async def Watch(self, request, context):
        sent = []

        class Writer:  # the base Watch only writes to its context
            @staticmethod
            async def write(reply):
                sent.append(reply.status)
                await context.write(reply)

        watch = asyncio.ensure_future(super().Watch(request, Writer()))
        stop = asyncio.ensure_future(self._shutting_down.wait())
        try:
            await asyncio.wait({watch, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            stop.cancel()
            await asyncio.gather(watch, stop, return_exceptions=True)
        if not sent or sent[-1] != health_pb2.HealthCheckResponse.NOT_SERVING:
            await context.write(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING))


__all__ = ["HealthServicer"]
