"""Bytes from the wire that are not a valid request, refused in one place.

gRPC hands each request's bytes to the method's deserializer before any handler runs;
when parsing fails grpc.aio answers `UNKNOWN: Unexpected <class 'DecodeError'>` and
logs a traceback at level error. `guarded(server)` is the server as the generated
`add_*Servicer_to_server` functions see it: every method handler they add gets a
deserializer that never raises (it returns a `Malformed` in place of the request) and a
behaviour that refuses a `Malformed` with INVALID_ARGUMENT and one warning line
(`rpc.malformed`), before the servicer sees it. On the request streams (Acks, Session,
and any later one) a malformed message ends the stream the same way, whether the
servicer reads it with `context.read()` or from the request iterator.

Messages over `--max-message-size` never reach Python: gRPC's core answers them
RESOURCE_EXHAUSTED itself ("Received message larger than max"), so they are not logged;
a request stream sees only the end of its requests. docs/reliability.md says why the
guard does not take that check over.
"""

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ..logs import log_event
from .errors import Refusal

log = logging.getLogger("radixkv.rpc")


@dataclass(frozen=True, slots=True)
class Malformed:
    """What a guarded deserializer returns for bytes that do not parse."""

    method: str
    size: int
    error: str

    @property
    def message(self) -> str:
        return (f"{self.method}: the request ({self.size} bytes) is not a valid protobuf message "
                f"of its type: {self.error}")


def guarded(server, on_malformed: Callable[[str], None] | None = None) -> "GuardedServer":
    """`server` as the generated `add_*Servicer_to_server` functions use it, adding
    guarded handlers. `on_malformed(method)` is told of each refusal (metrics)."""
    return GuardedServer(server, on_malformed)


class GuardedServer:
    """Forwards handler registration to a grpc.aio server with every handler guarded."""

    def __init__(self, server, on_malformed=None):
        self._server = server
        self._on_malformed = on_malformed

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self.guard(f"{service}/{name}", h) for name, h in handlers.items()})

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(g, self) for g in generic_handlers))

    def guard(self, method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        """`handler` with a deserializer that never raises and a behaviour that refuses
        what it could not parse. Handlers without a deserializer (raw bytes) and
        synchronous ones stay as they are."""
        if handler is None or handler.request_deserializer is None:
            return handler
        name = method.rsplit("/", 1)[-1]
        kind = handler_kind(handler)
        behaviour = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            return handler  # a synchronous handler (none here): left as grpc runs it
        wrap = _stream_behaviour if handler.request_streaming else _unary_behaviour
        return handler._replace(request_deserializer=_deserializer(handler.request_deserializer, name),
                                **{kind: wrap(behaviour, self._refuse)})

    async def _refuse(self, context, bad: Malformed) -> None:
        """End the call INVALID_ARGUMENT (see `end_call`), with one warning line."""
        log_event(log, "rpc.malformed", logging.WARNING, method=bad.method, bytes=bad.size, error=bad.error)
        if self._on_malformed is not None:
            self._on_malformed(bad.method)
        await end_call(context, Refusal(grpc.StatusCode.INVALID_ARGUMENT, bad.message), bad.method)


async def end_call(context, refusal: Refusal, method: str) -> None:
    """End the call with `refusal`'s status (raises AbortError). When the call already
    ended (its caller cancelled or past its deadline, the server stopping), gRPC cannot
    send the status (ExecuteBatchError): the call then ends as the cancelled call it is
    (CancelledError), which the servicer and the streams take as the engine gone, never
    as an error of the handler (a traceback at level error)."""
    try:
        await context.abort(refusal.code, refusal.message, refusal.trailer())
    except grpc.aio.InternalError as e:
        raise asyncio.CancelledError(f"{method}: the call ended before its status was sent") from e


class _GuardedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose answers are guarded (once per method, then cached)."""

    def __init__(self, inner: grpc.GenericRpcHandler, server: GuardedServer):
        self._inner = inner
        self._server = server
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details):
        """The guarded handler of `details.method`; None for a method this service lacks
        (not cached: any caller may name endless unknown methods)."""
        method = details.method
        handler = self._cache.get(method)
        if handler is None:
            handler = self._server.guard(method, self._inner.service(details))
            if handler is not None:
                self._cache[method] = handler
        return handler


def handler_kind(handler: grpc.RpcMethodHandler) -> str:
    """The field of `handler` holding its behaviour ("unary_unary", ..., "stream_stream")."""
    return {(False, False): "unary_unary", (False, True): "unary_stream",
            (True, False): "stream_unary", (True, True): "stream_stream"}[
        (handler.request_streaming, handler.response_streaming)]


def _deserializer(parse: Callable[[bytes], object], method: str) -> Callable[[bytes], object]:
    def deserialize(raw: bytes):
        try:
            return parse(raw)
        except Exception as e:  # DecodeError, or anything else a parser may raise
            return Malformed(method, len(raw), _describe(e))
    return deserialize


def _describe(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _unary_behaviour(behaviour, refuse):
    """One request: refused before the behaviour runs if it is Malformed."""
    if inspect.isasyncgenfunction(behaviour):
        async def generate(request, context):
            if isinstance(request, Malformed):
                await refuse(context, request)
            async for reply in behaviour(request, context):
                yield reply
        return generate

    async def call(request, context):
        if isinstance(request, Malformed):
            await refuse(context, request)
        return await behaviour(request, context)
    return call


def _stream_behaviour(behaviour, refuse):
    """A request stream: the first Malformed message read (by `context.read()` or the
    iterator) ends the call with INVALID_ARGUMENT."""
    async def checked(requests, context):
        async for request in requests:
            if isinstance(request, Malformed):
                await refuse(context, request)
            yield request

    if inspect.isasyncgenfunction(behaviour):
        async def generate(requests, context):
            guarded_context = _ReadGuard(context, refuse)
            async for reply in behaviour(checked(requests, guarded_context), guarded_context):
                yield reply
        return generate

    async def call(requests, context):
        guarded_context = _ReadGuard(context, refuse)
        return await behaviour(checked(requests, guarded_context), guarded_context)
    return call


class _ReadGuard:
    """The servicer context, except that `read()` refuses a Malformed message."""

    def __init__(self, context, refuse):
        self._context = context
        self._refuse = refuse

    async def read(self):
        request = await self._context.read()
        if isinstance(request, Malformed):
            await self._refuse(self._context, request)
        return request

    def __getattr__(self, name):
        return getattr(self._context, name)


__all__ = ["GuardedServer", "Malformed", "guarded"]
