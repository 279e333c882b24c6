"""Every error a caller can cause, mapped to a gRPC status in this one place."""

import asyncio

import grpc

from ..core import errors as core


class ServiceError(Exception):
    """An error raised by the RPC layer itself (sessions, limits, registration)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


# Most specific first: the first matching class decides the status.
_CORE_STATUS: list[tuple[type, grpc.StatusCode]] = [
    (core.NotOwner, grpc.StatusCode.PERMISSION_DENIED),
    (core.PageOwnershipError, grpc.StatusCode.INVALID_ARGUMENT),
    (core.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (core.UnknownNode, grpc.StatusCode.NOT_FOUND),
    (core.UnknownTransfer, grpc.StatusCode.NOT_FOUND),
    (core.LockError, grpc.StatusCode.FAILED_PRECONDITION),
    (core.NotReady, grpc.StatusCode.UNAVAILABLE),
    (core.CacheError, grpc.StatusCode.FAILED_PRECONDITION),
]


MAX_MESSAGE_BYTES = 2000  # UTF-8: a status travels in a trailer of 16 KiB at most, percent-encoded (x3)


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status and message for a caller error; None for anything else (a bug). A
    message quoting a caller's string of many kilobytes (a session id, a name) is cut to
    MAX_MESSAGE_BYTES: whole, it passed gRPC's trailer limit and the caller got
    RESOURCE_EXHAUSTED "metadata size exceeds hard limit" instead."""
    if isinstance(exc, ServiceError):
        return exc.code, _cut(str(exc))
    for cls, code in _CORE_STATUS:
        if isinstance(exc, cls):
            return code, _cut(str(exc))
    return None


def internal(where: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status answering a bug in `where`: INTERNAL naming the exception's type only
    (its text may quote the daemon's memory or paths; the daemon's log has the traceback).
    Every RPC path, unary or stream, answers a bug with it."""
    return grpc.StatusCode.INTERNAL, f"internal error in {where}: {type(exc).__name__}"


def _cut(message: str) -> str:
    encoded = message.encode()
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return message
    kept = encoded[:MAX_MESSAGE_BYTES].decode(errors="ignore")  # on a character's boundary
    return f"{kept}... (cut: {len(message)} characters)"


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unauthenticated(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, message)


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


REPLACED = "replaced by a new registration"  # why a session another engine's Register took the place of ended


def session_end_code(by_close: bool, replaced: bool) -> grpc.StatusCode | None:
    """The status a closed session's streams end with: OK (None) after a Close call,
    FAILED_PRECONDITION when another engine's Register replaced it (or a rank of its
    group: do not take the namespace back), ABORTED for any other reason (its other
    stream ended, a rank of its group ended, it idled out: register again)."""
    if by_close:
        return None
    return grpc.StatusCode.FAILED_PRECONDITION if replaced else grpc.StatusCode.ABORTED


class SessionEnd:
    """A stream's word that the daemon closed its session (`Daemon._end_session`), said
    once: `event` is set, and `status` is what the stream ends with (None: OK), a new
    error each time: one kept here would hold, through its traceback, the frame of the
    stream that raised it, and so the stream itself (freed only by the cyclic collector)."""

    def __init__(self):
        self.event = asyncio.Event()
        self._failure: tuple[grpc.StatusCode, str] | None = None

    def __bool__(self) -> bool:
        return self.event.is_set()

    @property
    def status(self) -> "ServiceError | None":
        return None if self._failure is None else ServiceError(*self._failure)

    def say(self, session_id: str, reason: str, code: grpc.StatusCode | None) -> bool:
        """Record the close: `code` (`session_end_code`) with a message saying `reason`,
        or OK for None. False when it was said already (the first word stands)."""
        if self.event.is_set():
            return False
        if code is not None:
            self._failure = (code, f"session {session_id} was closed: {reason}")
        self.event.set()
        return True
