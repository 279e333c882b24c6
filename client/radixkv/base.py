"""ClientBase: what the blocking and asyncio clients share besides their plans: the
constructor (channel, stubs, `Session`) and the properties that need no I/O.

Each shell names its channel opener and ack stream class (`open_channel` / `AckStream`
for `Client`, `open_aio_channel` / `AsyncAckStream` for `AsyncClient`); the base calls
no method a shell defines.
"""

import asyncio
import weakref
from collections.abc import Callable, Sequence

from grpc_health.v1 import health_pb2_grpc

from radixkv.v1 import radixkv_pb2_grpc

from . import messages as msg
from .acks import DEFAULT_OUTCOME_CACHE
from .channel import Tls, resolve_target
from .errors import DeadlineExceeded, FailedPrecondition, SessionLost
from .reconnect import Backoff
from .session import DEFAULT_TARGET, Session
from .types import Registration

ORPHAN_WAIT_S = 30.0  # how long `close` waits for an abandoned Register's answer with no timeout set


def register_timed_out(timeout: float | None) -> DeadlineExceeded:
    """The error of a Register not answered within the client's timeout (the call goes
    on: each shell closes the session it makes, see `Client._register`)."""
    return DeadlineExceeded(f"Register: no answer within {timeout:g}s (the session it may still "
                            "make is closed when answered)")


class ClientBase:
    """A channel to one daemon and, after `register`, one session on it (see `Client`
    for the arguments)."""

    _channel_opener: Callable  # (target, options, tls, token) -> channel; set by each shell
    _ack_stream_class: type  # (stub, session, outcome_cache=, on_broken=) -> ack stream
    _call_stream_class: type  # (stub, session, on_broken=) -> session stream (radixkv.streaming)
    _ends_when_dropped = False  # a shell whose streams may be ended from the garbage collector

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = 30.0,
                 max_message_bytes: int = msg.DEFAULT_MAX_MESSAGE_BYTES,
                 options: Sequence[tuple[str, object]] = (),
                 outcome_cache: int = DEFAULT_OUTCOME_CACHE,
                 tls: Tls | None = None, token: str | None = None,
                 reconnect: Backoff | None = Backoff(),
                 on_session_lost: Callable[[SessionLost], None] | None = None,
                 stream: bool = False):
        self.target = target = resolve_target(target)
        channel_options = msg.channel_options(max_message_bytes, options)
        self._channel_args = (target, channel_options, tls, token)
        self._channel = self._channel_opener(*self._channel_args)
        self._stub = radixkv_pb2_grpc.RadixKVStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._outcome_cache = outcome_cache
        self._orphans: set = set()  # Registers past their timeout (or cancelled), then their sessions' Closes
        # The session holds the shell's openers weakly: its streams' threads keep the session
        # alive, and through strong openers they would keep a client nobody holds.
        self._session = Session(target, timeout=timeout, reconnect=reconnect, on_session_lost=on_session_lost,
                                open_acks=_weakly(self._open_acks),
                                open_calls=_weakly(self._open_calls) if stream else None)
        if self._ends_when_dropped:  # not at interpreter exit: the process ending ends the session
            weakref.finalize(self, _dropped, self._session, self._channel).atexit = False
        else:  # asyncio: its streams and channel are the loop's (the first it is used on: `_loop`)
            self._loop = [_running_loop()]
            weakref.finalize(self, _dropped_on_loop, self._session, self._channel, self._loop).atexit = False

    @property
    def timeout(self) -> float | None:
        """The deadline of each RPC in seconds (None: none)."""
        return self._session.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._session.timeout = value

    @property
    def registration(self) -> Registration | None:
        """The session `register` returned, or None before."""
        return self._session.registration

    @property
    def session_lost(self) -> bool:
        """The session is gone (the daemon restarted, or stopped answering) and not
        registered again yet: the next call registers it again, when the backoff lets it,
        or fails Unavailable. An engine that must not wait for that registration (a
        deadline of its own) can answer misses meanwhile and call `reconnect` apart."""
        return self._session.lost

    @property
    def session(self) -> str:
        """The session id. Raises FailedPrecondition before `register` or after `close`."""
        return self._session.id

    def _open_acks(self, session: str, on_broken: Callable):
        """A new session's ack stream, opened (it names the session to the daemon)."""
        acks = self._ack_stream_class(self._stub, session, outcome_cache=self._outcome_cache,
                                      on_broken=on_broken)
        acks.open()
        return acks

    def _open_calls(self, session: str, on_broken: Callable):
        """A new session's Session stream (with `stream=True`)."""
        return self._call_stream_class(self._stub, session, on_broken=on_broken)


def _weakly(method: Callable) -> Callable:
    """The bound `method`, called through a weak reference to its object."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is None:
            raise FailedPrecondition("the client was garbage-collected")
        return bound(*args)
    return call


def _dropped(session: Session, channel) -> None:
    """A client collected without `close`: its streams end (the daemon then closes the
    session: copies finished, leases released, the namespace free again) and its channel."""
    if not session.closed:
        session.drop("the client was garbage-collected without close()")
        channel.close()


def _dropped_on_loop(session: Session, channel, loop_box: list) -> None:
    """An AsyncClient collected without `close`: as `_dropped`, on its loop while that
    loop runs (a dropped one kept its session, so the namespace stayed taken)."""
    loop = loop_box[0]

    def drop() -> None:
        if not session.closed:
            session.drop("the client was garbage-collected without close()")
            task = loop.create_task(channel.close())
            _CLOSING.add(task)  # the loop holds tasks weakly
            task.add_done_callback(_CLOSING.discard)

    if loop is not None and not loop.is_closed():
        try:
            loop.call_soon_threadsafe(drop)
        except RuntimeError:  # the loop closed meanwhile: its process is ending
            pass


_CLOSING: set = set()  # channel closes of dropped AsyncClients, until done


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


__all__ = ["ClientBase"]
