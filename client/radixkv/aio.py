"""AsyncClient: the asyncio twin of `radixkv.client.Client`, on grpc.aio.

Same methods, same results, same errors, awaited. Create and use it inside one running
event loop; the ack stream is a task on that loop, and the streams' state is owned by
the loop (no locks). With `stream=True` the engine calls go on the session stream
(`AsyncCallStream`, `radixkv.streaming`): the lowest latency per call here; calls may
overlap (e.g. with the engine's forward pass). See `Client` for the contract of each
method: both run the same plans (`radixkv.session`); this shell performs their steps on
a grpc.aio channel.
"""

import asyncio
from collections.abc import Callable, Iterable

import grpc

from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

from . import messages as msg
from .acks import DEFAULT_OUTCOME_CACHE, AckLedger, end_reason
from .base import ORPHAN_WAIT_S, ClientBase, register_timed_out
from .channel import open_aio_channel
from .errors import DeadlineExceeded, FailedPrecondition, RadixKVError, SessionLost, from_rpc_error
from .layout import KvLayout
from .plans import Plan, PlanRun, Rpc, Sleep
from .session import SERVICE
from .streaming import AsyncCallStream
from .types import (EvictResult, InsertResult, LoadBackResult, LoadOutcome, MatchResult,
                    PrefetchProgress, Registration, Violation)

_CLOSE = object()


class AsyncAckStream:
    """The session's ack stream on the event loop (see `radixkv.acks.AckStream`; the
    bookkeeping is the same `AckLedger`)."""

    def __init__(self, stub, session: str, *, outcome_cache: int = DEFAULT_OUTCOME_CACHE,
                 close_timeout: float = 30.0, on_broken: Callable | None = None):
        self._stub = stub
        self._session = session
        self._close_timeout = close_timeout
        self._on_broken = on_broken
        self._ledger = AckLedger(outcome_cache)
        self._futures: dict[int, asyncio.Future] = {}  # one per ack in flight
        self._queue: asyncio.Queue = asyncio.Queue()
        self._call = None
        self._reader: asyncio.Task | None = None

    def open(self) -> None:
        """Open the stream now (it names the session, acknowledging nothing)."""
        if self._call is None and self._ledger.ended is None:
            self._start()

    def issue(self, transfer: int) -> None:
        """Record a transfer id this session's LoadBack returned (0 is ignored)."""
        self._ledger.issue(transfer)

    def abandon(self, reason: str) -> None:
        """The session is gone: fail every unanswered ack and drop the stream now."""
        self._ledger.end(reason)
        if self._call is not None:
            self._queue.put_nowait(_CLOSE)
            self._call.cancel()
        self._resolve(*self._ledger.unanswered())

    async def wait(self, ids: Iterable[int], timeout: float | None = None) -> dict[int, LoadOutcome]:
        """Ack every id not acked yet and wait for all answers (see `AckStream.wait`)."""
        wanted = msg.transfer_ids(ids)
        send, refused = self._ledger.to_ack(wanted)
        self._resolve(*refused)
        loop = asyncio.get_running_loop()
        for t in send:
            self._futures[t] = loop.create_future()
            if self._call is None:
                self._start()
            self._queue.put_nowait(t)
        futures = {t: self._futures[t] for t in wanted if self._ledger.in_flight(t)}
        if futures:
            _, not_done = await asyncio.wait(futures.values(), timeout=timeout)
            if not_done:
                late = sorted(t for t, f in futures.items() if not f.done())
                raise DeadlineExceeded(f"load-backs {late} not answered within {timeout}s")
        return {t: futures[t].result() if t in futures else self._ledger.outcome(t) for t in wanted}

    async def close(self, reason: str = "the client closed") -> None:
        """End the stream, wait for the daemon's side to end, fail what stayed unanswered."""
        self._ledger.end(reason)
        if self._reader is not None:
            self._queue.put_nowait(_CLOSE)
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), self._close_timeout)
            except asyncio.TimeoutError:
                self._call.cancel()
                await asyncio.gather(self._reader, return_exceptions=True)
        self._resolve(*self._ledger.unanswered())

    def _start(self) -> None:
        self._call = self._stub.Acks(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self):
        yield pb.AckRequest(session=self._session, transfer=0)  # opens the stream
        while (item := await self._queue.get()) is not _CLOSE:
            yield pb.AckRequest(session=self._session, transfer=item)

    async def _read(self) -> None:
        """The reader task: record answers until the stream ends, then fail the rest."""
        error = None
        try:
            async for resp in self._call:
                self._resolve(LoadOutcome.from_pb(resp))
        except (asyncio.CancelledError, Exception) as e:  # a reader that dies must still fail the waiters
            error = e
        by_daemon = self._ledger.end(end_reason(error))
        self._queue.put_nowait(_CLOSE)
        self._resolve(*self._ledger.unanswered())
        if by_daemon and self._on_broken is not None:
            self._on_broken(end_reason(error), error.code() if isinstance(error, grpc.RpcError) else None)

    def _resolve(self, *outcomes: LoadOutcome) -> None:
        for outcome in outcomes:
            self._ledger.record(outcome)
            fut = self._futures.pop(outcome.transfer, None)
            if fut is not None and not fut.done():
                fut.set_result(outcome)


class AsyncClient(ClientBase):
    """A grpc.aio channel to one daemon and, after `register`, one session on it: the
    arguments and calls of `Client`, as coroutines. With `stream=True` any call that goes
    unanswered within `timeout` ends the session (the stream ends with it)."""

    _channel_opener = staticmethod(open_aio_channel)
    _ack_stream_class = AsyncAckStream
    _call_stream_class = AsyncCallStream

    async def wait_ready(self, timeout: float = 10.0, service: str = SERVICE) -> None:
        await self._run(self._session.wait_ready(timeout, service))

    async def register(self, namespace: str, layout: KvLayout, buffers: Iterable, num_device_pages: int, *,
                       backend: str = "shm", device: int = 0, write_policy: str = "",
                       host_pool_pages: int = 0, replace_existing: bool = False, engine: str = "",
                       model: str = "", device_uuid: str = "", device_tier: str = "managed",
                       role: str = "engine", tp_rank: int = 0, tp_size: int = 1, instance: str = "",
                       wait_for_ranks: float = 0.0) -> Registration:
        return await self._run(self._session.register(
            namespace, layout, buffers, num_device_pages, backend=backend, device=device,
            write_policy=write_policy, host_pool_pages=host_pool_pages,
            replace_existing=replace_existing, engine=engine, model=model, device_uuid=device_uuid,
            device_tier=device_tier, role=role, tp_rank=tp_rank, tp_size=tp_size, instance=instance,
            wait_for_ranks=wait_for_ranks))

    async def reconnect(self, timeout: float = 30.0) -> SessionLost | None:
        """As `Client.reconnect`."""
        return await self._run(self._session.reconnect(timeout))

    async def close(self) -> None:
        """End the session (Close, then the ack stream; see `Client.close`) and the
        channel. Idempotent. On another event loop than its own (closed by now, as after
        a second `asyncio.run`) it only drops its streams: the daemon then closes the session."""
        if self._session.closed:
            return
        if self._loop[0] is not None and self._loop[0] is not asyncio.get_running_loop():
            await self._close_from_another_loop()
            return
        try:
            await self._wait_orphans()
            for stream in await self._run(self._session.close()):
                if self._session.close_answered:
                    await stream.close()
                else:
                    stream.abandon("the client closed (the daemon did not answer its Close)")
        finally:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def match(self, prompts: Iterable, lease: bool = False, include_storage: bool = False,
                    timeout: float | None | str = "client") -> list[MatchResult]:
        return await self._run(self._session.match(prompts, lease, include_storage, timeout))

    async def prefetch(self, tokens, *, extra_key: bytes = b"", policy: str = "best_effort",
                       timeout: float | None = None) -> list[PrefetchProgress]:
        return await self._run(self._session.prefetch(tokens, extra_key=extra_key, policy=policy,
                                                      timeout=timeout))

    async def insert(self, tokens, device_pages, *, extra_key: bytes = b"", chunked: bool = False,
                     release_lease: int = 0, lease: bool = False, engine_event=None,
                     async_: bool = False) -> InsertResult:
        return await self._run(self._session.insert(tokens, device_pages, extra_key=extra_key,
                                                    chunked=chunked, release_lease=release_lease, lease=lease,
                                                    engine_event=engine_event, async_=async_))

    async def load_back(self, node: int, device_pages, *, engine_event=None, lease: int = 0,
                        start_page: int = 0, wait: bool = False) -> LoadBackResult:
        return await self._run(self._session.load_back(node, device_pages, engine_event, lease, start_page, wait))

    async def wait(self, transfer_ids: Iterable[int], timeout: float | None | str = "client") -> dict[int, LoadOutcome]:
        """As `Client.wait` (its timeout the client's by default)."""
        return await self._session.acks().wait(transfer_ids, self.timeout if timeout == "client" else timeout)

    async def release(self, leases: Iterable[int]) -> None:
        await self._run(self._session.release(leases))

    async def evict(self, num_pages: int, *, engine_event=None) -> EvictResult:
        return await self._run(self._session.evict(num_pages, engine_event))

    async def stats(self, namespace: str = "") -> pb.StatsResponse:
        return await self._run(self._session.operator("stats", namespace))

    async def inspect(self, namespace: str, max_nodes: int = 0) -> pb.InspectResponse:
        return await self._run(self._session.operator("inspect", namespace, max_nodes))

    async def check_invariants(self, namespace: str = "") -> list[Violation]:
        return await self._run(self._session.operator("check_invariants", namespace))

    async def drop_namespace(self, namespace: str, *, store: bool = False) -> pb.DropNamespaceResponse:
        return await self._run(self._session.operator("drop_namespace", namespace, store))

    async def echo(self, payload: bytes = b"") -> bytes:
        return await self._run(self._session.operator("echo", payload))

    # -- the I/O -----------------------------------------------------------------------

    async def _run(self, plan: Plan):
        """Run a plan on this channel: each step is awaited here. FailedPrecondition on
        another event loop than the one the client was first used on."""
        self._check_loop()
        run = PlanRun(plan)
        try:
            while (step := run.next()) is not None:
                try:
                    run.answer(await self._perform(step))
                except grpc.RpcError as e:
                    run.fail(from_rpc_error(e, getattr(step, "method", ""), getattr(step, "timeout", None)))
                except grpc.aio.UsageError as e:
                    run.fail(RadixKVError(str(e)))
                except RadixKVError as e:  # a call on the session stream
                    run.fail(e)
        finally:
            run.close()
        return run.result

    async def _close_from_another_loop(self) -> None:
        """Close the session over a channel of this loop (its own channel and streams are
        another loop's, which may be closed); never raises."""
        registration = self._session.registration
        self._session.drop("the client was closed from another event loop than its own")
        if registration is None:
            return
        channel = self._channel_opener(*self._channel_args)
        try:
            await radixkv_pb2_grpc.RadixKVStub(channel).Close(pb.CloseRequest(session=registration.session),
                                                              timeout=self.timeout)
        except grpc.RpcError:
            pass  # the daemon is gone or does not answer: its session ends with it, or by --idle-session-timeout
        finally:
            await channel.close()

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop[0] is None:
            self._loop[0] = loop
        elif self._loop[0] is not loop:
            raise FailedPrecondition("this AsyncClient belongs to the event loop it was first used on (its channel "
                                     "and streams are that loop's); make an AsyncClient per event loop")

    async def _perform(self, step: Rpc | Sleep):
        if isinstance(step, Sleep):
            return await asyncio.sleep(step.seconds)
        if step.on_stream:
            return await self._session.calls().call(step.method, step.request, step.timeout)
        if step.method == "Register":
            return await self._register(step)
        stub = self._health if step.health else self._stub
        call = getattr(stub, step.method)(step.request, timeout=step.timeout, wait_for_ready=step.wait_for_ready)
        return [m async for m in call] if step.stream else await call

    async def _register(self, step: Rpc):
        """A Register the caller stops waiting for (its timeout ran out, or a cancelled
        task) goes on, with no deadline on the wire: a session the daemon made for it would
        hold the namespace with no one to use or close it, so it is closed once answered
        (see `Client._register`)."""
        await self._wait_orphans()  # this client's abandoned Register may hold the namespace: its Close first
        answer = asyncio.ensure_future(self._stub.Register(step.request, wait_for_ready=step.wait_for_ready))
        answered = False
        try:
            response = await asyncio.wait_for(asyncio.shield(answer), step.timeout)
            answered = True
            return response
        except asyncio.TimeoutError:
            raise register_timed_out(step.timeout) from None
        finally:
            if not answered:
                self._orphans.add(answer)
                answer.add_done_callback(self._close_orphan)

    async def _wait_orphans(self) -> None:
        """Wait for abandoned Registers to answer, then for the Closes of the sessions they
        made: each for up to the timeout (ORPHAN_WAIT_S with none)."""
        bound = self.timeout if self.timeout is not None else ORPHAN_WAIT_S
        for _ in range(2):  # the Registers, then the Closes their answers started
            if self._orphans:
                await asyncio.wait(set(self._orphans), timeout=bound)

    def _close_orphan(self, answer: asyncio.Future) -> None:
        self._orphans.discard(answer)
        if answer.cancelled() or answer.exception() is not None:
            return
        close = self._stub.Close(pb.CloseRequest(session=answer.result().session), timeout=self.timeout)
        self._orphans.add(task := asyncio.ensure_future(close))
        task.add_done_callback(self._orphan_closed)

    def _orphan_closed(self, task: asyncio.Future) -> None:
        self._orphans.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a daemon gone meanwhile ends that session anyway


def _share_docstrings() -> None:
    """Each AsyncClient call's contract is its Client twin's, awaited: `help()` and an
    editor show it on both."""
    from .client import Client

    for name, method in vars(AsyncClient).items():
        if not name.startswith("_") and callable(method) and not method.__doc__:
            method.__doc__ = getattr(Client, name).__doc__


_share_docstrings()

__all__ = ["AsyncAckStream", "AsyncCallStream", "AsyncClient"]
