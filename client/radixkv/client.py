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
"""

import threading
import time
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

from . import messages as msg
from .acks import DEFAULT_OUTCOME_CACHE, AckStream
from .channel import Tls, open_channel
from .errors import (DaemonRestarted, FailedPrecondition, RadixKVError, SessionLost, Unauthenticated,
                     Unavailable, from_rpc_error)
from .layout import KvLayout
from .reconnect import Backoff, Recovery
from .types import (EvictResult, InsertResult, LoadBackResult, LoadOutcome, MatchResult,
                    PrefetchProgress, Registration, Violation)

SERVICE = "radixkv.v1.RadixKV"
DEFAULT_TARGET = "unix:///run/radixkv/radixkv.sock"
PROBE_TIMEOUT = 2.0  # seconds: is the session still alive after a failed call?


def lost_message(reg: Registration, new: Registration, reason: str) -> tuple[type[SessionLost], str]:
    """The exception class and message for a session replaced by `new`."""
    if new.daemon_instance != reg.daemon_instance:
        return DaemonRestarted, (f"the daemon restarted (instance {reg.daemon_instance} -> "
                                 f"{new.daemon_instance}; {reason}); registered again: drop every "
                                 "cached device page")
    return SessionLost, (f"session {reg.session[:8]} was lost ({reason}); registered again: drop every "
                         "cached device page")


class Client:
    """A channel to one daemon and, after `register`, one session on it.

    `timeout` is the deadline of each RPC in seconds (None: none). `tls` and `token`
    secure a TCP connection (see `radixkv.channel`). `reconnect`: backoff between
    attempts to register again after the session was lost (None: never; calls then keep
    failing). `on_session_lost(exc)` is called with the `SessionLost` before it is raised.
    Not meant to be shared by several engines; `wait` may be called from any thread.
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = 30.0,
                 max_message_bytes: int = msg.DEFAULT_MAX_MESSAGE_BYTES,
                 options: Sequence[tuple[str, object]] = (),
                 outcome_cache: int = DEFAULT_OUTCOME_CACHE,
                 tls: Tls | None = None, token: str | None = None,
                 reconnect: Backoff | None = Backoff(),
                 on_session_lost: Callable[[SessionLost], None] | None = None):
        self.target = target
        self.timeout = timeout
        self._channel = open_channel(target, msg.channel_options(max_message_bytes, options), tls, token)
        self._stub = radixkv_pb2_grpc.RadixKVStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._outcome_cache = outcome_cache
        self._registration: Registration | None = None
        self._register_request: pb.RegisterRequest | None = None
        self._acks: AckStream | None = None
        self._closed = False
        self._recovery = Recovery(reconnect) if reconnect is not None else None
        self._recovery_lock = threading.Lock()  # the ack reader thread reports a broken stream
        self._on_session_lost = on_session_lost

    # -- lifecycle ---------------------------------------------------------------------

    def wait_ready(self, timeout: float = 10.0, service: str = SERVICE) -> None:
        """Poll the daemon's health service until it reports SERVING.

        Raises Unavailable if it is not serving within `timeout` seconds (DeadlineExceeded
        never escapes: an unready daemon is an unavailable one)."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"daemon at {self.target} not serving after {timeout}s ({last})")
            try:
                resp = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                          timeout=min(left, 1.0), wait_for_ready=True)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as e:
                last = str(from_rpc_error(e))
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    @property
    def registration(self) -> Registration | None:
        """The session `register` returned, or None before."""
        return self._registration

    @property
    def session(self) -> str:
        """The session id. Raises FailedPrecondition before `register` or after `close`."""
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._registration is None:
            raise FailedPrecondition("not registered: call register() first")
        return self._registration.session

    def register(self, namespace: str, layout: KvLayout, buffers: Iterable, num_device_pages: int, *,
                 backend: str = "shm", device: int = 0, write_policy: str = "",
                 host_pool_pages: int = 0, replace_existing: bool = False, engine: str = "",
                 model: str = "") -> Registration:
        """Attach to `namespace` with the engine's device `buffers` ((handle, offset, size)
        each, layer-major; `ShmKvBuffers.specs()` or `CudaKvBuffers.export(...)`). The
        buffers must stay alive until `close` returns. One session per client: raises
        FailedPrecondition when already registered."""
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._registration is not None:
            raise FailedPrecondition(f"already registered (session {self._registration.session})")
        req = msg.register_request(
            namespace, layout, buffers, num_device_pages, backend=backend, device=device,
            write_policy=write_policy, host_pool_pages=host_pool_pages,
            replace_existing=replace_existing, engine=engine, model=model)
        reg = Registration.from_pb(self._call(self._stub.Register, req))
        self._register_request = req
        self._attach(reg)
        return reg

    def reconnect(self, timeout: float = 30.0) -> SessionLost | None:
        """Make sure the session is alive, registering again (with backoff) if it was lost.

        Returns None when the session was alive, else the `SessionLost` that a call
        would have raised (drop the cached device pages). Raises Unavailable if the
        daemon did not take a registration within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        if self._recovery is None or self._register_request is None:
            raise FailedPrecondition("reconnect needs a registered client with a reconnect backoff")
        if not self._recovery.lost:
            self._check_session(Unavailable("checking the session"))
            if not self._recovery.lost:
                return None
        while True:
            time.sleep(min(self._recovery.wait_time(time.monotonic()), max(0.0, deadline - time.monotonic())))
            try:
                self._recover()
            except SessionLost as e:
                return e
            except RadixKVError:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"no session after {timeout}s: {self._recovery.reason}") from None

    def close(self) -> None:
        """End the session and the channel. Idempotent; never raises for a daemon that
        is already gone.

        Close comes first: the daemon answers it only after the session's copies
        finished, its load-backs were finished and its leases released, so once this
        returns the daemon no longer writes the engine's buffers. Then the ack stream
        ends (acks still waiting resolve, as failed loads if unanswered), then the channel.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._registration is not None:
                try:
                    self._stub.Close(pb.CloseRequest(session=self._registration.session), timeout=self.timeout)
                except grpc.RpcError:
                    pass  # the daemon is gone, or already closed the session
            if self._acks is not None:
                self._acks.close()
        finally:
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- engine operations -------------------------------------------------------------

    def match(self, prompts: Iterable, lease: bool = False, include_storage: bool = False) -> list[MatchResult]:
        """Longest cached prefix of each prompt (token lists, packed bytes or `Prompt`s),
        in order. With `lease`, each matched path is protected until `release`; with
        `include_storage`, `storage_tokens` says how much more the storage tier holds."""
        resp = self._call(self._stub.Match, msg.match_request(self.session, prompts, lease, include_storage))
        return [MatchResult.from_pb(r) for r in resp.results]

    def prefetch(self, tokens, *, extra_key: bytes = b"", policy: str = "best_effort",
                 timeout: float | None = None) -> list[PrefetchProgress]:
        """Pull what only the storage tier holds of `tokens` into host memory. Returns
        the progress reports: "started" then, unless best_effort, "done" (or
        "waiting_ended" for the timeout policy); "nothing" when there is nothing to fetch."""
        request = msg.prefetch_request(self.session, tokens, extra_key=extra_key, policy=policy, timeout=timeout)
        deadline = None if self.timeout is None else self.timeout + (timeout or 0)
        try:
            return [PrefetchProgress.from_pb(p) for p in self._stub.Prefetch(request, timeout=deadline)]
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def insert(self, tokens, device_pages, *, extra_key: bytes = b"", chunked: bool = False,
               release_lease: int = 0, lease: bool = False) -> InsertResult:
        """Hand finished KV to the cache: `device_pages[i]` holds page i of `tokens`
        (whole pages). Free the returned redundant pages; the others are the cache's
        until `evict` returns them. `release_lease` releases a match lease afterwards."""
        req = msg.insert_request(self.session, tokens, device_pages, extra_key=extra_key,
                                 chunked=chunked, release_lease=release_lease, lease=lease)
        return InsertResult.from_pb(self._call(self._stub.Insert, req))

    def load_back(self, node: int, device_pages) -> LoadBackResult:
        """Copy the host-only part of `node`'s path (a match's `host_node`) into
        `device_pages`. Wait for `transfer` and `depends_on` before reading."""
        req = msg.load_back_request(self.session, node, device_pages)
        result = LoadBackResult.from_pb(self._call(self._stub.LoadBack, req))
        self._ack_stream().issue(result.transfer)
        return result

    def wait(self, transfer_ids: Iterable[int], timeout: float | None = None) -> dict[int, LoadOutcome]:
        """Acknowledge the load-backs and wait until each finished: {id: outcome}.

        Any id of this session may be given (a match's or load-back's `depends_on` too);
        0 is skipped. Waiting again returns the same outcome. A lost daemon or stream
        gives failed outcomes, never `ok`. Raises DeadlineExceeded after `timeout`."""
        return self._ack_stream().wait(transfer_ids, timeout)

    def release(self, leases: Iterable[int]) -> None:
        """Release leases taken by `match(lease=True)` or `insert(lease=True)` (0s are skipped)."""
        req = msg.release_request(self.session, leases)
        if req.leases:
            self._call(self._stub.Release, req)

    def evict(self, num_pages: int) -> EvictResult:
        """Free up to `num_pages` device pages; the freed pages are the engine's again."""
        return EvictResult.from_pb(self._call(self._stub.Evict, msg.evict_request(self.session, num_pages)))

    # -- operators ---------------------------------------------------------------------

    def stats(self, namespace: str = "") -> pb.StatsResponse:
        """Counters and pool usage ("" : every namespace), as the daemon's message."""
        return self._call(self._stub.Stats, pb.StatsRequest(namespace=namespace))

    def inspect(self, namespace: str, max_nodes: int = 0) -> pb.InspectResponse:
        """A summary of a namespace's tree with its first nodes, as the daemon's message."""
        return self._call(self._stub.Inspect, pb.InspectRequest(namespace=namespace, max_nodes=max_nodes))

    def check_invariants(self, namespace: str = "") -> list[Violation]:
        """Every violated invariant ("" : every namespace); empty when sound."""
        resp = self._call(self._stub.CheckInvariants, pb.CheckInvariantsRequest(namespace=namespace))
        return [Violation(v.namespace, v.message) for v in resp.violations]

    def echo(self, payload: bytes = b"") -> bytes:
        """The payload back: one RPC's floor cost."""
        return self._call(self._stub.Echo, pb.EchoRequest(payload=payload)).payload

    # -- internals ---------------------------------------------------------------------

    def _ack_stream(self) -> AckStream:
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._acks is None:
            raise FailedPrecondition("not registered: call register() first")
        return self._acks

    def _call(self, method, request):
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._recovery is not None and self._recovery.lost:
            self._recover()  # raises: SessionLost once registered again, else Unavailable
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as e:
            err = from_rpc_error(e)
        except ValueError as e:  # grpc raises ValueError on a closed channel
            raise RadixKVError(str(e)) from None
        if isinstance(err, (Unavailable, Unauthenticated)) and method is not self._stub.Register:
            self._check_session(err)
            if self._recovery is not None and self._recovery.lost:
                self._recover()
        raise err

    # -- a lost session ----------------------------------------------------------------

    def _attach(self, reg: Registration) -> None:
        msg.forget_stale_events(self._register_request)
        self._registration = reg
        self._acks = AckStream(self._stub, reg.session, outcome_cache=self._outcome_cache,
                               on_broken=self._stream_broken)
        self._acks.open()

    def _stream_broken(self, reason: str) -> None:
        """The daemon ended the ack stream, and with it the session (reader thread)."""
        if self._recovery is not None and not self._closed:
            with self._recovery_lock:
                self._recovery.lose(reason, time.monotonic())

    def _check_session(self, err: RadixKVError) -> None:
        """After `err`, ask the daemon whether the session lives; mark it lost if not."""
        if self._recovery is None or self._registration is None or self._recovery.lost:
            return
        try:
            self._stub.Match(pb.MatchRequest(session=self._registration.session), timeout=PROBE_TIMEOUT)
            return  # alive: `err` was about that call alone
        except grpc.RpcError as e:
            probe = from_rpc_error(e)
        if isinstance(probe, (Unavailable, Unauthenticated)):
            with self._recovery_lock:
                self._recovery.lose(f"{err.code.name}: {err.message}", time.monotonic())

    def _recover(self) -> None:
        """Try to register again if an attempt is due. Raises SessionLost on success,
        Unavailable (or the daemon's refusal) otherwise; never returns."""
        rec, reg = self._recovery, self._registration
        now = time.monotonic()
        if self._acks is not None:
            self._acks.abandon(f"the session was lost ({rec.reason})")
        if not rec.due(now):
            raise Unavailable(f"session lost ({rec.reason}); next reconnect attempt in "
                              f"{rec.wait_time(now):.2f}s")
        try:  # as first registered: replace_existing only if the engine asked for it then
            new = Registration.from_pb(self._stub.Register(self._register_request, timeout=self.timeout))
        except grpc.RpcError as e:
            rec.failed(time.monotonic())
            err = from_rpc_error(e)
            if isinstance(err, Unavailable):
                raise Unavailable(f"session lost ({rec.reason}); reconnect attempt {rec.attempts} failed: "
                                  f"{err.message}") from None
            raise err from None
        cls, message = lost_message(reg, new, rec.reason)
        with self._recovery_lock:
            rec.recovered()
        self._attach(new)
        lost = cls(message, new, reg.daemon_instance, new.daemon_instance)
        if self._on_session_lost is not None:
            self._on_session_lost(lost)
        raise lost


__all__ = ["Client", "DEFAULT_TARGET", "SERVICE"]
