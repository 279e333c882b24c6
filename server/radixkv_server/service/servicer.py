"""The gRPC servicer: validate, convert, call the daemon, convert back. Nothing else.

Caller errors become status codes through `errors.status_of` (one place); anything
else is a bug, logged with its traceback and answered INTERNAL.
"""

import asyncio
import functools
import logging
import time

import grpc
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pb_grpc

from ..core.errors import CacheError
from ..datapath import BufferSpec
from ..logs import log_event
from .. import __version__
from .acks import AckStream
from .convert import layout_from_pb
from .daemon import Daemon
from .registration import Registration
from .errors import ServiceError, invalid, status_of
from .inspection import inspect_namespace, namespace_stats

log = logging.getLogger("radixkv.rpc")


def rpc(method):
    """Map caller errors to statuses; log and hide anything unexpected; count and time
    every call by method and status code."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(self, request, context):
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await method(self, request, context)
        except (CacheError, ServiceError) as e:
            code, message = status_of(e)
            log_event(log, "rpc.refused", logging.DEBUG, method=name, code=code.name, message=message)
            await context.abort(code, message)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code = grpc.StatusCode.INTERNAL
            log.exception("internal error in %s", name)
            await context.abort(code, f"internal error in {name}: {type(e).__name__}")
        finally:
            metrics = self.daemon.metrics
            if metrics is not None:
                metrics.rpc_requests.labels(name, code.name).inc()
                metrics.rpc_duration.labels(name).observe(time.perf_counter() - start)

    return handler


class RadixKVServicer(pb_grpc.RadixKVServicer):
    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    @rpc
    async def Register(self, request, context):
        if not request.HasField("layout"):
            raise invalid("layout is required")
        reg = Registration(
            namespace=request.namespace,
            layout=layout_from_pb(request.layout, self.daemon.config.page_size),
            backend=request.backend or "shm",
            device=request.device,
            buffers=[BufferSpec(b.handle, b.offset, b.size) for b in request.buffers],
            num_device_pages=request.num_device_pages,
            write_policy=request.write_policy,
            host_pool_pages=request.host_pool_pages,
            replace_existing=request.replace_existing,
            engine=request.engine,
            model=request.model,
        )
        done = await self.daemon.register(reg)
        ns = done.session.namespace
        return pb.RegisterResponse(
            session=done.session.id, host_pool_pages=ns.host_pool.num_pages,
            write_policy=ns.config.write_policy.value, warm=done.warm,
            dropped_device_tokens=done.dropped_device_tokens, daemon_instance=self.daemon.instance)

    @rpc
    async def Close(self, request, context):
        try:
            session = self.daemon.session(request.session)
        except ServiceError:
            return pb.CloseResponse()  # already closed or unknown: closing is idempotent
        await self.daemon.close_session(session, "closed by the engine")
        return pb.CloseResponse()

    @rpc
    async def Match(self, request, context):
        session = self.daemon.session(request.session)
        matched = await self.daemon.match(session, [(p.tokens, p.extra_key) for p in request.prompts],
                                          request.lease, request.include_storage)
        return pb.MatchResponse(results=[
            pb.MatchResult(
                device_pages=r.device_pages, device_tokens=r.device_tokens, host_tokens=r.host_tokens,
                device_node=r.device_node, host_node=r.host_node, depends_on=r.depends_on, lease=lease,
                storage_tokens=stored)
            for r, lease, stored in matched
        ])

    @rpc
    async def Insert(self, request, context):
        session = self.daemon.session(request.session)
        result, lease = await self.daemon.insert(
            session, request.tokens, request.device_pages, request.extra_key, request.chunked,
            request.release_lease, request.lease)
        return pb.InsertResponse(cached_tokens=result.cached_tokens, redundant_pages=result.redundant_pages,
                                 node=result.node, lease=lease)

    @rpc
    async def LoadBack(self, request, context):
        session = self.daemon.session(request.session)
        r, events = await self.daemon.load_back(session, request.node, request.device_pages)
        return pb.LoadBackResponse(
            transfer=r.transfer, device_pages=r.device_pages, device_tokens=r.device_tokens,
            loaded_tokens=r.loaded_tokens, depends_on=r.depends_on, unused_pages=r.unused_pages,
            layer_events=events)

    @rpc
    async def Release(self, request, context):
        self.daemon.release(self.daemon.session(request.session), list(request.leases))
        return pb.ReleaseResponse()

    @rpc
    async def Evict(self, request, context):
        session = self.daemon.session(request.session)
        pages, written_back = await self.daemon.evict(session, request.num_pages)
        return pb.EvictResponse(freed_pages=pages, written_back_pages=written_back)

    @rpc
    async def Prefetch(self, request, context):
        """Stream prefetch progress (see the proto); errors abort the stream with a status."""
        states = {"nothing": pb.PrefetchProgress.NOTHING, "started": pb.PrefetchProgress.STARTED,
                  "done": pb.PrefetchProgress.DONE, "waiting_ended": pb.PrefetchProgress.WAITING_ENDED}
        session = self.daemon.session(request.session)
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        async for state, transfer, storage_tokens, outcome in self.daemon.prefetch(
                session, request.tokens, request.extra_key, request.policy or "best_effort", timeout):
            await context.write(pb.PrefetchProgress(
                state=states[state], transfer=transfer, storage_tokens=storage_tokens,
                fetched_tokens=outcome.pages_read * session.namespace.layout.page_size if outcome else 0,
                host_tokens_added=outcome.added_tokens if outcome else 0))

    @rpc
    async def Stats(self, request, context):
        return pb.StatsResponse(
            namespaces=[namespace_stats(ns) for ns in self.daemon.selected(request.namespace)],
            sessions=len(self.daemon.sessions), version=__version__,
            uptime_seconds=self.daemon.uptime(), daemon_instance=self.daemon.instance)

    @rpc
    async def Inspect(self, request, context):
        if not request.namespace:
            raise invalid("namespace is required")
        return inspect_namespace(self.daemon.namespace(request.namespace), request.max_nodes or 100)

    @rpc
    async def CheckInvariants(self, request, context):
        namespaces = self.daemon.selected(request.namespace)
        violations = self.daemon.check_invariants(request.namespace)
        for name, message in violations:
            log_event(log, "invariant.violated", logging.ERROR, namespace=name, violation=message)
        return pb.CheckInvariantsResponse(
            violations=[pb.Violation(namespace=n, message=m) for n, m in violations],
            namespaces_checked=len(namespaces))

    @rpc
    async def Echo(self, request, context):
        return pb.EchoResponse(payload=request.payload)

    @rpc
    async def Acks(self, request_iterator, context):
        """Read acks until the engine half-closes (or the daemon stops); answer each
        once its transfer is finished, in completion order. The session closes when
        the stream ends, however it ends."""
        await AckStream(self.daemon, context).run()


