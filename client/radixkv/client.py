"""Client: the blocking client engines use to talk to the radixkv daemon.

    with Client("unix:///run/radixkv/radixkv.sock") as kv:
        kv.wait_ready(10)
        kv.register("llama3-8b/tp0", layout, buffers.specs(), num_device_pages)
        [m] = kv.match([tokens], lease=True)
        ...

Every RPC raises a `radixkv.errors.RadixKVError` subclass on failure (`Unavailable`
when the daemon cannot be reached). Load-backs are acknowledged on the session's ack
stream by `wait`, which never reports a load as successful unless the daemon said so.

When the session is lost (the daemon restarted or closed it), the client registers
again with the same arguments, with capped exponential backoff between attempts (see
`radixkv.reconnect`), and the call that succeeds in doing so raises `SessionLost`
(`DaemonRestarted` for a new daemon): the engine must then drop its view of cached
device pages. Calls before the next attempt is due fail at once with `Unavailable`.

This class is the blocking shell: requests, conversions and recovery are written once
in `radixkv.session` (shared with `AsyncClient`); here each step is performed on a
blocking channel, and acks run on a reader thread (`radixkv.acks`).
"""

import time
from collections.abc import Iterable
from concurrent.futures import Future

import grpc

from radixkv.v1 import radixkv_pb2 as pb

from . import messages as msg
from .acks import AckStream
from .base import ORPHAN_WAIT_S, ClientBase, register_timed_out
from .channel import open_channel
from .errors import RadixKVError, SessionLost, from_rpc_error
from .layout import KvLayout
from .plans import Plan, PlanRun, Rpc, Sleep
from .session import DEFAULT_TARGET, SERVICE
from .streaming import CallStream
from .types import (EvictResult, InsertResult, LoadBackResult, LoadOutcome, MatchResult,
                    PrefetchProgress, Registration, Violation)


class Client(ClientBase):
    """A channel to one daemon and, after `register`, one session on it.

    `timeout` is the deadline of each RPC in seconds (default 30; None: none). A call
    that moves pages or leases (insert, load_back, evict, release, a leased match) and goes unanswered
    within it ends the session, since its outcome is unknown: the next call registers
    again and raises `SessionLost` (drop every cached device page). With `stream`, the
    session's match, load_back, insert, evict, release and echo go as messages on one
    Session stream instead of a unary RPC each (cheaper per call; `radixkv.streaming`);
    the daemon closes the session when that stream ends. `tls` and `token`
    secure a TCP connection (see `radixkv.channel`). `reconnect`: backoff between
    attempts to register again after the session was lost (None: never; calls then keep
    failing, FailedPrecondition after a call ended the session, until `close`). `on_session_lost(exc)` is called with the `SessionLost` before it is raised.
    Not meant to be shared by several engines; `wait` may be called from any thread.
    A client dropped without `close` ends its session when it is garbage-collected
    (unless something its session holds, such as a bound-method `on_session_lost`,
    refers back to it: then it lives, and its session with it, until `close`).
    """

    _ends_when_dropped = True

    _channel_opener = staticmethod(open_channel)
    _ack_stream_class = AckStream
    _call_stream_class = CallStream

    # -- lifecycle ---------------------------------------------------------------------

    def wait_ready(self, timeout: float = 10.0, service: str = SERVICE) -> None:
        """Poll the daemon's health service until it reports SERVING.

        Raises Unavailable if it is not serving within `timeout` seconds (DeadlineExceeded
        never escapes: an unready daemon is an unavailable one)."""
        self._run(self._session.wait_ready(timeout, service))

    def register(self, namespace: str, layout: KvLayout, buffers: Iterable, num_device_pages: int, *,
                 backend: str = "shm", device: int = 0, write_policy: str = "",
                 host_pool_pages: int = 0, replace_existing: bool = False, engine: str = "",
                 model: str = "", device_uuid: str = "", device_tier: str = "managed",
                 role: str = "engine", tp_rank: int = 0, tp_size: int = 1, instance: str = "",
                 wait_for_ranks: float = 0.0) -> Registration:
        """Attach to `namespace` with the engine's device `buffers` ((handle, offset, size)
        each, layer-major; `ShmKvBuffers.specs()` or `CudaKvBuffers.export(...)`, which is
        exported afresh for every automatic re-registration). The buffers must stay alive
        until `close` returns. On "cuda" the GPU is sent by UUID too (`device_uuid`,
        default: that of cuda:`device` here). One session per client: raises
        FailedPrecondition when already registered.

        Engine-managed namespaces (vLLM): `device_tier="engine_managed"`; `role="scheduler"`
        (no buffers, 0 pages: match, release, prefetch) or `"engine"` (one rank's buffers:
        insert with `async_`, load_back with `lease`/`start_page`); `tp_rank`/`tp_size`
        shard each page over the ranks; `instance` names the engine (logs). Any number of
        sessions share such a namespace, all with one layout and tp_size. A managed-device
        engine split over tensor-parallel ranks registers every rank on one namespace
        with its `tp_rank`/`tp_size` and one `instance`; rank 0's client makes the calls
        (docs/engines.md). `wait_for_ranks` seconds: such a rank's Register answers once
        every rank is in, or after that long (`Registration.ranks_missing` names the
        ranks still out); the call's timeout is longer by as much. Registering again
        after a lost session waits too, within `reconnect`'s timeout."""
        return self._run(self._session.register(
            namespace, layout, buffers, num_device_pages, backend=backend, device=device,
            write_policy=write_policy, host_pool_pages=host_pool_pages,
            replace_existing=replace_existing, engine=engine, model=model, device_uuid=device_uuid,
            device_tier=device_tier, role=role, tp_rank=tp_rank, tp_size=tp_size, instance=instance,
            wait_for_ranks=wait_for_ranks))

    def reconnect(self, timeout: float = 30.0) -> SessionLost | None:
        """Make sure the session is alive, registering again (with backoff) if it was lost.

        Returns None when the session was alive, else the `SessionLost` that a call
        would have raised (drop the cached device pages). Raises Unavailable if the
        daemon did not answer a registration within `timeout` seconds, and the daemon's
        refusal of the last attempt as itself (FailedPrecondition for another layout or
        model in the namespace, PermissionDenied, ResourceExhausted): one that does not
        pass by itself."""
        return self._run(self._session.reconnect(timeout))

    def close(self) -> None:
        """End the session and the channel. Idempotent; never raises for a daemon that
        is already gone.

        Close comes first: the daemon answers it only after the session's copies
        finished, its load-backs were finished and its leases released, so once this
        returns the daemon no longer writes the engine's buffers. Then the ack stream
        ends (acks still waiting resolve, as failed loads if unanswered), then the channel.
        """
        if self._session.closed:
            return
        try:
            self._wait_orphans()
            for stream in self._run(self._session.close()):
                if self._session.close_answered:
                    stream.close()
                else:
                    stream.abandon("the client closed (the daemon did not answer its Close)")
        finally:
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- engine operations -------------------------------------------------------------

    def match(self, prompts: Iterable, lease: bool = False, include_storage: bool = False,
              timeout: float | None | str = "client") -> list[MatchResult]:
        """Longest cached prefix of each prompt (token lists, packed bytes or `Prompt`s),
        in order. With `lease`, each matched path is protected until `release`; with
        `include_storage`, `storage_tokens` says how much more the storage tier holds.
        `timeout`: this call's deadline in seconds (default: the client's; None: none),
        for a scheduler step that cannot wait longer. Past it, DeadlineExceeded: without
        `lease` a miss to go on with, the session unharmed; with `lease` the leases' fate is
        unknown, so the session is ended and registered again (the next call raises
        SessionLost), as for any call that takes leases."""
        return self._run(self._session.match(prompts, lease, include_storage, timeout))

    def start_match(self, prompts: Iterable, lease: bool = False, include_storage: bool = False) -> Future | None:
        """`match` sent on the Session stream without waiting (a client made with
        `stream=True`): a Future resolved with the list of MatchResults, or with the
        RadixKVError the call failed with. None when no call can go on the stream now
        (not registered, the session lost, the client closed): `match` recovers. The
        caller owns the leases of an answer it stops waiting for. The Future's callbacks
        run on the thread that resolves it: the stream's reader thread for an answer
        (one that makes a blocking call on this client would wait for the very thread it
        runs on, until the call's timeout, stalling every call on the stream), or a
        thread that ends the stream (a recovery, `close`, the garbage collector). Hand
        such work to another thread and take no lock those may hold. (So for every
        `start_*`.)"""
        return self._start_on_stream("Match", lambda session: msg.match_request(session, prompts, lease, include_storage),
                                     MatchResult.all_from_pb)

    def start_load_back(self, node: int, device_pages, *, engine_event=None, lease: int = 0,
                        start_page: int = 0, wait: bool = True) -> Future | None:
        """An engine-managed `load_back(..., wait=wait)` sent on the Session stream without
        waiting: a Future resolved with the LoadBackResult (with `wait`, once the pages are
        copied; without, once the copy started: on CUDA with its per-layer events, and
        its `transfer` to acknowledge), or with the RadixKVError the call failed with.
        None as for `start_match`. The daemon writes `device_pages` until the answer comes
        (with `wait`) or the transfer is acknowledged: the caller must not reuse them
        before (a Future it stops waiting for leaves them being written)."""
        acks = None if wait else self._session.acks()  # the sending session's: its transfer is acked there

        def convert(response) -> LoadBackResult:
            result = LoadBackResult.from_pb(response)
            if acks is not None:
                acks.issue(result.transfer)
            return result
        return self._start_on_stream("LoadBack", lambda session: msg.load_back_request(
            session, node, device_pages, engine_event, lease, start_page, wait=wait), convert)

    def start_insert(self, tokens, device_pages, *, extra_key: bytes = b"", engine_event=None) -> Future | None:
        """An engine-managed asynchronous save (`insert(..., async_=True)`) sent on the
        Session stream without waiting: a Future resolved with the InsertResult (its
        `transfer` the copy to `wait` for) or with the RadixKVError the call failed with.
        None as for `start_match`. The daemon reads `device_pages` from when it takes the
        call until the transfer is acknowledged: the caller must not reuse them before the
        answer came and, if it names a transfer, that was waited for (a Future it stops
        waiting for leaves them being read)."""
        acks = self._session.acks()  # the sending session's: its transfer is acked there

        def convert(response) -> InsertResult:
            result = InsertResult.from_pb(response)
            if result.transfer:
                acks.issue(result.transfer)
            return result
        return self._start_on_stream("Insert", lambda session: msg.insert_request(
            session, tokens, device_pages, extra_key=extra_key, chunked=False, release_lease=0, lease=False,
            engine_event=engine_event, async_=True), convert)

    def _start_on_stream(self, method: str, build, convert) -> Future | None:
        """Send `build(session id)` as `method` on the Session stream; a Future of
        `convert(response)` or of the call's RadixKVError. None when the stream is not live."""
        stream = self._session.live_stream()
        if stream is None:
            return None
        answer: Future = Future()

        def done(sent: Future) -> None:  # on the stream's reader thread
            response = sent.result()
            try:
                answer.set_result(response if isinstance(response, RadixKVError) else convert(response))
            except Exception as e:  # a waiter must hear of it
                answer.set_result(RadixKVError(f"{method}: unreadable answer: {e}"))

        stream.start(method, build(self._session.id)).add_done_callback(done)
        return answer

    def prefetch(self, tokens, *, extra_key: bytes = b"", policy: str = "best_effort",
                 timeout: float | None = None) -> list[PrefetchProgress]:
        """Pull what only the storage tier holds of `tokens` into host memory. Returns
        the progress reports: "started" then, unless best_effort, "done" (or
        "waiting_ended" for the timeout policy); "nothing" when there is nothing to fetch."""
        return self._run(self._session.prefetch(tokens, extra_key=extra_key, policy=policy, timeout=timeout))

    def insert(self, tokens, device_pages, *, extra_key: bytes = b"", chunked: bool = False,
               release_lease: int = 0, lease: bool = False, engine_event=None, async_: bool = False) -> InsertResult:
        """Hand finished KV to the cache: `device_pages[i]` holds page i of `tokens`
        (whole pages). Free the returned redundant pages; the others are the cache's
        until `evict` returns them. `release_lease` releases a match lease afterwards.
        `engine_event` (CUDA; `CudaKvBuffers.record_event`): the daemon's copies wait on
        the GPU for it, so the pages need not be synchronized on the CPU first.
        Engine-managed namespaces copy the pages to host and never keep them: with
        `async_` the result's `transfer` is the copy (`wait` for it before reusing the
        pages); without, the call returns once copied."""
        return self._run(self._session.insert(tokens, device_pages, extra_key=extra_key, chunked=chunked,
                                              release_lease=release_lease, lease=lease, engine_event=engine_event,
                                              async_=async_))

    def load_back(self, node: int, device_pages, *, engine_event=None, lease: int = 0,
                  start_page: int = 0, wait: bool = False) -> LoadBackResult:
        """Copy the host-only part of `node`'s path (a match's `host_node`) into
        `device_pages` (`host_tokens // page_size` of them; with fewer, only the whole
        cached nodes from the top that fit are loaded, possibly none: transfer 0, the
        rest in `unused_pages`). Wait for `transfer` and `depends_on` before reading.
        `engine_event`: the copy overwrites the pages only after it (kernels still
        reading them from an earlier use). Engine-managed: `lease` is the (scheduler's)
        match lease on the path, `start_page` the path's pages the engine holds already;
        the complete host pages from there are copied into `device_pages`; `wait`: the
        call returns once they are (`transfer` 0, no ack; Unavailable if the copy failed)."""
        return self._run(self._session.load_back(node, device_pages, engine_event, lease, start_page, wait))

    def wait(self, transfer_ids: Iterable[int], timeout: float | None | str = "client") -> dict[int, LoadOutcome]:
        """Acknowledge the load-backs (and engine-managed saves) and wait until each
        finished: {id: outcome}.

        Any id of this session may be given (a match's or load-back's `depends_on` too);
        0 is skipped. Waiting again returns the same outcome. A lost daemon or stream
        gives failed outcomes, never `ok`. Raises DeadlineExceeded after `timeout`
        seconds (default: the client's; None: no limit): the acks stay in flight, the
        pages stay the daemon's to write, and a later `wait` collects the outcomes."""
        return self._session.acks().wait(transfer_ids, self.timeout if timeout == "client" else timeout)

    def release(self, leases: Iterable[int]) -> None:
        """Release leases taken by `match(lease=True)` or `insert(lease=True)` (0s are skipped).
        Raises NotFound (a lease no session holds: released, expired) or PermissionDenied
        (another session's) after releasing every other lease; `err.leases` are those refused."""
        self._run(self._session.release(leases))

    def evict(self, num_pages: int, *, engine_event=None) -> EvictResult:
        """Free up to `num_pages` device pages; the freed pages are the engine's again.
        `engine_event`: write-backs read the pages only after it."""
        return self._run(self._session.evict(num_pages, engine_event))

    # -- operators ---------------------------------------------------------------------

    def stats(self, namespace: str = "") -> pb.StatsResponse:
        """Counters and pool usage ("" : every namespace), as the daemon's message."""
        return self._run(self._session.operator("stats", namespace))

    def inspect(self, namespace: str, max_nodes: int = 0) -> pb.InspectResponse:
        """A summary of a namespace's tree with its first nodes, as the daemon's message."""
        return self._run(self._session.operator("inspect", namespace, max_nodes))

    def check_invariants(self, namespace: str = "") -> list[Violation]:
        """Every violated invariant ("" : every namespace); empty when sound."""
        return self._run(self._session.operator("check_invariants", namespace))

    def drop_namespace(self, namespace: str, *, store: bool = False) -> pb.DropNamespaceResponse:
        """Forget a namespace no engine is attached to (its host pool freed; storage
        keeps its pages), storing its host copies storage lacks first with `store`.
        FailedPrecondition while a session is attached, NotFound for an unknown name."""
        return self._run(self._session.operator("drop_namespace", namespace, store))

    def echo(self, payload: bytes = b"") -> bytes:
        """The payload back: one RPC's floor cost."""
        return self._run(self._session.operator("echo", payload))

    # -- the I/O -----------------------------------------------------------------------

    def _run(self, plan: Plan):
        """Run a plan on this channel, blocking: each step is performed here."""
        run = PlanRun(plan)
        try:
            while (step := run.next()) is not None:
                try:
                    run.answer(self._perform(step))
                except grpc.RpcError as e:
                    run.fail(from_rpc_error(e, getattr(step, "method", ""), getattr(step, "timeout", None)))
                except ValueError as e:  # grpc raises ValueError on a closed channel
                    run.fail(RadixKVError(str(e)))
                except RadixKVError as e:  # a call on the session stream
                    run.fail(e)
        finally:
            run.close()
        return run.result

    def _perform(self, step: Rpc | Sleep):
        if isinstance(step, Sleep):
            return time.sleep(step.seconds)
        if step.on_stream:
            return self._session.calls().call(step.method, step.request, step.timeout)
        if step.method == "Register":
            return self._register(step)
        stub = self._health if step.health else self._stub
        call = getattr(stub, step.method)(step.request, timeout=step.timeout, wait_for_ready=step.wait_for_ready)
        return list(call) if step.stream else call

    def _register(self, step: Rpc) -> pb.RegisterResponse:
        """Register with no deadline on the wire, waited for `step.timeout`. A deadline
        that ran out just after the daemon made the session would lose its id with the
        answer, and that session would hold the namespace, refusing every later Register:
        so past the timeout the call goes on, and the session it made is closed once
        answered (`close` waits for that, bounded)."""
        self._wait_orphans()  # this client's abandoned Register may hold the namespace: its Close first
        call = self._stub.Register.future(step.request, wait_for_ready=step.wait_for_ready)
        answered = False
        try:
            response = call.result(timeout=step.timeout)
            answered = True
            return response
        except grpc.FutureTimeoutError:
            raise register_timed_out(step.timeout) from None
        finally:
            if not answered:
                self._orphans.add(call)
                call.add_done_callback(self._close_orphan)

    def _close_orphan(self, call: grpc.Future) -> None:
        """On gRPC's thread: close the session an abandoned Register made, if it made one."""
        try:
            if not call.cancelled() and call.exception() is None:
                close = self._stub.Close.future(pb.CloseRequest(session=call.result().session),
                                                timeout=self.timeout)
                self._orphans.add(close)
                close.add_done_callback(self._orphans.discard)
        except ValueError:  # the channel closed meanwhile (`close` gave up waiting): the session stays
            pass
        finally:
            self._orphans.discard(call)

    def _wait_orphans(self) -> None:
        """Wait for abandoned Registers to answer, then for the Closes of the sessions they
        made: each for up to the timeout (ORPHAN_WAIT_S with none)."""
        bound = self.timeout if self.timeout is not None else ORPHAN_WAIT_S
        for _ in range(2):  # the Registers, then the Closes their answers started
            deadline = time.monotonic() + bound
            while self._orphans and (left := deadline - time.monotonic()) > 0:
                call = next(iter(self._orphans.copy()))
                try:
                    call.exception(timeout=left)
                except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
                    pass
                if call in self._orphans:  # answered; its callback (on gRPC's thread) is still to run
                    time.sleep(0.001)


__all__ = ["Client", "DEFAULT_TARGET", "SERVICE"]
