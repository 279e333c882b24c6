"""AsyncClient: the asyncio twin of `radixkv.client.Client`, on grpc.aio.

Same methods, same results, same errors, awaited. Create and use it inside one running
event loop; the ack stream is a task on that loop, and its state is owned by the loop
(no locks). See `Client` for the contract of each method.
"""

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

from . import messages as msg
from .acks import DEFAULT_OUTCOME_CACHE, AckLedger
from .channel import Tls, open_aio_channel
from .client import DEFAULT_TARGET, PROBE_TIMEOUT, SERVICE, lost_message
from .errors import (DeadlineExceeded, FailedPrecondition, RadixKVError, SessionLost, Unauthenticated,
                     Unavailable, from_rpc_error)
from .layout import KvLayout
from .reconnect import Backoff, Recovery
from .types import (EvictResult, InsertResult, LoadBackResult, LoadOutcome, MatchResult,
                    PrefetchProgress, Registration, Violation)

_CLOSE = object()


class AsyncAckStream:
    """The session's ack stream on the event loop (see `radixkv.acks.AckStream`)."""

    def __init__(self, stub, session: str, *, outcome_cache: int = DEFAULT_OUTCOME_CACHE,
                 close_timeout: float = 30.0, on_broken: Callable[[str], None] | None = None):
        self._stub = stub
        self._session = session
        self._close_timeout = close_timeout
        self._on_broken = on_broken
        self._ledger = AckLedger(outcome_cache)
        self._pending: dict[int, asyncio.Future] = {}  # acked, not answered yet
        self._broken: str | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._call = None
        self._reader: asyncio.Task | None = None

    def open(self) -> None:
        """Open the stream now (it names the session, acknowledging nothing)."""
        if self._call is None and self._broken is None:
            self._start()

    def issue(self, transfer: int) -> None:
        """Record a transfer id this session's LoadBack returned (0 is ignored)."""
        if transfer:
            self._ledger.issue(transfer)

    def abandon(self, reason: str) -> None:
        """The session is gone: fail every unanswered ack and drop the stream now."""
        if self._broken is None:
            self._broken = reason
        if self._call is not None:
            self._queue.put_nowait(_CLOSE)
            self._call.cancel()
        self._fail_pending(self._broken)

    async def wait(self, ids: Iterable[int], timeout: float | None = None) -> dict[int, LoadOutcome]:
        """Ack every id not acked yet and wait for all answers (see `AckStream.wait`)."""
        wanted = msg.transfer_ids(ids)
        for t in wanted:
            if self._ledger.outcome(t) is not None or t in self._pending:
                continue
            if self._ledger.issued(t):
                self._send(t)
            else:
                self._resolve(AckLedger.not_ours(t))
        futures = {t: self._pending[t] for t in wanted if t in self._pending}
        result = {t: self._ledger.outcome(t) for t in wanted if t not in futures}
        if futures:
            _, not_done = await asyncio.wait(futures.values(), timeout=timeout)
            if not_done:
                late = sorted(t for t, f in futures.items() if not f.done())
                raise DeadlineExceeded(f"load-backs {late} not answered within {timeout}s")
            result.update((t, f.result()) for t, f in futures.items())
        return {t: result[t] for t in wanted}

    async def close(self, reason: str = "the client closed") -> None:
        """End the stream, wait for the daemon's side to end, fail what stayed unanswered."""
        if self._broken is None:
            self._broken = reason
        if self._reader is not None:
            self._queue.put_nowait(_CLOSE)
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), self._close_timeout)
            except asyncio.TimeoutError:
                self._call.cancel()
                await asyncio.gather(self._reader, return_exceptions=True)
        self._fail_pending(self._broken)

    def _send(self, t: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._pending[t] = fut
        if self._broken is not None:
            self._resolve(LoadOutcome.failure(t, f"not acknowledged: {self._broken}"))
            return
        if self._call is None:
            self._start()
        self._queue.put_nowait(t)

    def _start(self) -> None:
        self._call = self._stub.Acks(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self):
        yield pb.AckRequest(session=self._session, transfer=0)  # opens the stream
        while (item := await self._queue.get()) is not _CLOSE:
            yield pb.AckRequest(session=self._session, transfer=item)

    async def _read(self) -> None:
        reason = "the daemon ended the ack stream (session closed)"
        try:
            async for resp in self._call:
                self._resolve(LoadOutcome.from_pb(resp))
        except grpc.RpcError as e:
            reason = f"ack stream broke: {from_rpc_error(e)}"
        except asyncio.CancelledError:
            reason = "ack stream cancelled"
        except Exception as e:  # a reader that dies must still fail the waiters
            reason = f"ack stream reader failed: {e!r}"
        by_daemon = self._broken is None
        if by_daemon:
            self._broken = reason
        self._queue.put_nowait(_CLOSE)
        self._fail_pending(self._broken)
        if by_daemon and self._on_broken is not None:
            self._on_broken(reason)

    def _fail_pending(self, reason: str) -> None:
        for t in list(self._pending):
            self._resolve(LoadOutcome.failure(t, f"no answer from the daemon: {reason}"))

    def _resolve(self, outcome: LoadOutcome) -> None:
        fut = self._pending.pop(outcome.transfer, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome)
        self._ledger.record(outcome)


class AsyncClient:
    """A grpc.aio channel to one daemon and, after `register`, one session on it."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = 30.0,
                 max_message_bytes: int = msg.DEFAULT_MAX_MESSAGE_BYTES,
                 options: Sequence[tuple[str, object]] = (),
                 outcome_cache: int = DEFAULT_OUTCOME_CACHE,
                 tls: Tls | None = None, token: str | None = None,
                 reconnect: Backoff | None = Backoff(),
                 on_session_lost: Callable[[SessionLost], None] | None = None):
        self.target = target
        self.timeout = timeout
        self._channel = open_aio_channel(target, msg.channel_options(max_message_bytes, options), tls, token)
        self._stub = radixkv_pb2_grpc.RadixKVStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._outcome_cache = outcome_cache
        self._registration: Registration | None = None
        self._register_request: pb.RegisterRequest | None = None
        self._acks: AsyncAckStream | None = None
        self._closed = False
        self._recovery = Recovery(reconnect) if reconnect is not None else None
        self._on_session_lost = on_session_lost

    async def wait_ready(self, timeout: float = 10.0, service: str = SERVICE) -> None:
        """Poll health until SERVING; raises Unavailable after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = "no answer"
        while (left := deadline - loop.time()) > 0:
            try:
                resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                                timeout=min(left, 1.0), wait_for_ready=True)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as e:
                last = str(from_rpc_error(e))
            await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
        raise Unavailable(f"daemon at {self.target} not serving after {timeout}s ({last})")

    @property
    def registration(self) -> Registration | None:
        return self._registration

    @property
    def session(self) -> str:
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._registration is None:
            raise FailedPrecondition("not registered: call register() first")
        return self._registration.session

    async def register(self, namespace: str, layout: KvLayout, buffers: Iterable, num_device_pages: int, *,
                       backend: str = "shm", device: int = 0, write_policy: str = "",
                       host_pool_pages: int = 0, replace_existing: bool = False, engine: str = "",
                       model: str = "") -> Registration:
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._registration is not None:
            raise FailedPrecondition(f"already registered (session {self._registration.session})")
        req = msg.register_request(
            namespace, layout, buffers, num_device_pages, backend=backend, device=device,
            write_policy=write_policy, host_pool_pages=host_pool_pages,
            replace_existing=replace_existing, engine=engine, model=model)
        reg = Registration.from_pb(await self._call(self._stub.Register, req))
        self._register_request = req
        self._attach(reg)
        return reg

    async def reconnect(self, timeout: float = 30.0) -> SessionLost | None:
        """See `Client.reconnect`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._recovery is None or self._register_request is None:
            raise FailedPrecondition("reconnect needs a registered client with a reconnect backoff")
        if not self._recovery.lost:
            await self._check_session(Unavailable("checking the session"))
            if not self._recovery.lost:
                return None
        while True:
            await asyncio.sleep(min(self._recovery.wait_time(time.monotonic()), max(0.0, deadline - loop.time())))
            try:
                await self._recover()
            except SessionLost as e:
                return e
            except RadixKVError:
                if loop.time() >= deadline:
                    raise Unavailable(f"no session after {timeout}s: {self._recovery.reason}") from None

    async def close(self) -> None:
        """End the session (Close, then the ack stream; see `Client.close`) and the
        channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._registration is not None:
                try:
                    await self._stub.Close(pb.CloseRequest(session=self._registration.session), timeout=self.timeout)
                except grpc.RpcError:
                    pass  # the daemon is gone, or already closed the session
            if self._acks is not None:
                await self._acks.close()
        finally:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def match(self, prompts: Iterable, lease: bool = False, include_storage: bool = False) -> list[MatchResult]:
        resp = await self._call(self._stub.Match, msg.match_request(self.session, prompts, lease, include_storage))
        return [MatchResult.from_pb(r) for r in resp.results]

    async def prefetch(self, tokens, *, extra_key: bytes = b"", policy: str = "best_effort",
                       timeout: float | None = None) -> list[PrefetchProgress]:
        """See `Client.prefetch`."""
        request = msg.prefetch_request(self.session, tokens, extra_key=extra_key, policy=policy, timeout=timeout)
        deadline = None if self.timeout is None else self.timeout + (timeout or 0)
        try:
            return [PrefetchProgress.from_pb(p) async for p in self._stub.Prefetch(request, timeout=deadline)]
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def insert(self, tokens, device_pages, *, extra_key: bytes = b"", chunked: bool = False,
                     release_lease: int = 0, lease: bool = False) -> InsertResult:
        req = msg.insert_request(self.session, tokens, device_pages, extra_key=extra_key,
                                 chunked=chunked, release_lease=release_lease, lease=lease)
        return InsertResult.from_pb(await self._call(self._stub.Insert, req))

    async def load_back(self, node: int, device_pages) -> LoadBackResult:
        req = msg.load_back_request(self.session, node, device_pages)
        result = LoadBackResult.from_pb(await self._call(self._stub.LoadBack, req))
        if self._acks is not None:
            self._acks.issue(result.transfer)
        return result

    async def wait(self, transfer_ids: Iterable[int], timeout: float | None = None) -> dict[int, LoadOutcome]:
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._acks is None:
            raise FailedPrecondition("not registered: call register() first")
        return await self._acks.wait(transfer_ids, timeout)

    async def release(self, leases: Iterable[int]) -> None:
        req = msg.release_request(self.session, leases)
        if req.leases:
            await self._call(self._stub.Release, req)

    async def evict(self, num_pages: int) -> EvictResult:
        resp = await self._call(self._stub.Evict, msg.evict_request(self.session, num_pages))
        return EvictResult.from_pb(resp)

    async def stats(self, namespace: str = "") -> pb.StatsResponse:
        return await self._call(self._stub.Stats, pb.StatsRequest(namespace=namespace))

    async def inspect(self, namespace: str, max_nodes: int = 0) -> pb.InspectResponse:
        return await self._call(self._stub.Inspect, pb.InspectRequest(namespace=namespace, max_nodes=max_nodes))

    async def check_invariants(self, namespace: str = "") -> list[Violation]:
        resp = await self._call(self._stub.CheckInvariants, pb.CheckInvariantsRequest(namespace=namespace))
        return [Violation(v.namespace, v.message) for v in resp.violations]

    async def echo(self, payload: bytes = b"") -> bytes:
        return (await self._call(self._stub.Echo, pb.EchoRequest(payload=payload))).payload

    async def _call(self, method, request):
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._recovery is not None and self._recovery.lost:
            await self._recover()  # raises: SessionLost once registered again, else Unavailable
        try:
            return await method(request, timeout=self.timeout)
        except grpc.RpcError as e:
            err = from_rpc_error(e)
        except grpc.aio.UsageError as e:
            raise RadixKVError(str(e)) from None
        if isinstance(err, (Unavailable, Unauthenticated)) and method is not self._stub.Register:
            await self._check_session(err)
            if self._recovery is not None and self._recovery.lost:
                await self._recover()
        raise err

    # -- a lost session (see Client) -----------------------------------------------------

    def _attach(self, reg: Registration) -> None:
        msg.forget_stale_events(self._register_request)
        self._registration = reg
        self._acks = AsyncAckStream(self._stub, reg.session, outcome_cache=self._outcome_cache,
                                    on_broken=self._stream_broken)
        self._acks.open()

    def _stream_broken(self, reason: str) -> None:
        if self._recovery is not None and not self._closed:
            self._recovery.lose(reason, time.monotonic())

    async def _check_session(self, err: RadixKVError) -> None:
        if self._recovery is None or self._registration is None or self._recovery.lost:
            return
        try:
            await self._stub.Match(pb.MatchRequest(session=self._registration.session), timeout=PROBE_TIMEOUT)
            return
        except grpc.RpcError as e:
            probe = from_rpc_error(e)
        if isinstance(probe, (Unavailable, Unauthenticated)):
            self._recovery.lose(f"{err.code.name}: {err.message}", time.monotonic())

    async def _recover(self) -> None:
        rec, reg = self._recovery, self._registration
        now = time.monotonic()
        if self._acks is not None:
            self._acks.abandon(f"the session was lost ({rec.reason})")
        if not rec.due(now):
            raise Unavailable(f"session lost ({rec.reason}); next reconnect attempt in "
                              f"{rec.wait_time(now):.2f}s")
        try:
            new = Registration.from_pb(await self._stub.Register(self._register_request, timeout=self.timeout))
        except grpc.RpcError as e:
            rec.failed(time.monotonic())
            err = from_rpc_error(e)
            if isinstance(err, Unavailable):
                raise Unavailable(f"session lost ({rec.reason}); reconnect attempt {rec.attempts} failed: "
                                  f"{err.message}") from None
            raise err from None
        cls, message = lost_message(reg, new, rec.reason)
        rec.recovered()
        self._attach(new)
        lost = cls(message, new, reg.daemon_instance, new.daemon_instance)
        if self._on_session_lost is not None:
            self._on_session_lost(lost)
        raise lost


__all__ = ["AsyncAckStream", "AsyncClient"]
