"""Every error a caller can cause, mapped to a gRPC status in this one place: a code, a
message for a person and, where an engine must tell refusals of one code apart, a
reason (`reasons.py`) with its metadata, sent as a `google.rpc.ErrorInfo`."""

import asyncio
from typing import NamedTuple

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ..core import errors as core
from . import reasons


class ServiceError(Exception):
    """An error raised by the RPC layer itself (sessions, limits, registration):
    `reason` (one of `reasons`, "" for none) and `metadata` go out as its ErrorInfo."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "", **metadata: object):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.metadata = {key: str(value) for key, value in metadata.items()}


class Refusal(NamedTuple):
    """What a refused call ends with (or a Session stream's CallStatus says)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    metadata: dict[str, str] = {}

    def trailer(self) -> tuple:
        """Trailing metadata carrying the status with its ErrorInfo (`grpc-status-details-bin`,
        read by grpc_status.rpc_status.from_call); empty without a reason."""
        if not self.reason:
            return ()
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=self.reason, domain=reasons.DOMAIN, metadata=self.metadata))
        status = status_pb2.Status(code=self.code.value[0], message=self.message, details=[info])
        return tuple(rpc_status.to_status(status).trailing_metadata)


# Most specific first: the first matching class decides the status.
_CORE_STATUS: list[tuple[type, grpc.StatusCode, str]] = [
    (core.NotOwner, grpc.StatusCode.PERMISSION_DENIED, reasons.OTHER_SESSION),
    (core.PageOwnershipError, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (core.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (core.UnknownNode, grpc.StatusCode.NOT_FOUND, reasons.NODE_UNKNOWN),
    (core.UnknownTransfer, grpc.StatusCode.NOT_FOUND, reasons.TRANSFER_UNKNOWN),
    (core.LockError, grpc.StatusCode.FAILED_PRECONDITION, ""),
    (core.NotReady, grpc.StatusCode.UNAVAILABLE, ""),
    (core.CacheError, grpc.StatusCode.FAILED_PRECONDITION, ""),
]


# A status travels in the call's trailer, which a client takes whole only under 8 KiB
# (gRPC's soft limit: past it, up to the 16 KiB hard one, it refuses a growing share of
# trailers at random, RESOURCE_EXHAUSTED "metadata size exceeds soft limit"). The message
# goes twice: percent-encoded in grpc-message (every byte outside printable ASCII, and
# '%', takes 3), and in grpc-status-details-bin (base64: 4 bytes per 3), with metadata.
MAX_MESSAGE_BYTES = 2000  # the message as grpc-message sends it (percent-encoded)
MAX_METADATA_BYTES = 1000  # per value (a list of leases)


def status_of(exc: Exception) -> Refusal | None:
    """The status for a caller error; None for anything else (a bug). A message quoting
    a caller's string of many kilobytes (a session id, a name) is cut to
    MAX_MESSAGE_BYTES, and a metadata value to MAX_METADATA_BYTES: whole, they passed
    gRPC's trailer limit and the caller got RESOURCE_EXHAUSTED "metadata size exceeds
    hard limit" instead."""
    if isinstance(exc, ServiceError):
        metadata = {key: _cut(value, MAX_METADATA_BYTES) for key, value in exc.metadata.items()}
        return Refusal(exc.code, _cut(str(exc)), exc.reason, metadata)
    for cls, code, reason in _CORE_STATUS:
        if isinstance(exc, cls):
            return Refusal(code, _cut(str(exc)), reason)
    return None


def internal(where: str, exc: BaseException) -> Refusal:
    """The status answering a bug in `where`: INTERNAL naming the exception's type only
    (its text may quote the daemon's memory or paths; the daemon's log has the traceback).
    Every RPC path, unary or stream, answers a bug with it."""
    return Refusal(grpc.StatusCode.INTERNAL, f"internal error in {where}: {type(exc).__name__}")


def wire_bytes(text: str) -> int:
    """The size of `text` percent-encoded as gRPC sends a status message."""
    return sum(1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode()) for c in text)


def _cut(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message` whole when it takes at most `limit` bytes on the wire (`wire_bytes`),
    else its start, cut on a character's boundary, and how long it was."""
    if len(message) <= limit // 3 or wire_bytes(message) <= limit:
        return message
    kept, used = [], 0
    for c in message:
        used += wire_bytes(c)
        if used > limit:
            break
        kept.append(c)
    return f"{''.join(kept)}... (cut: {len(message)} characters)"


def _refusal(code: grpc.StatusCode):
    """A maker of `ServiceError`s of `code`: (message, reason="", **metadata)."""
    def make(message: str, reason: str = "", **metadata: object) -> ServiceError:
        return ServiceError(code, message, reason, **metadata)
    return make


invalid = _refusal(grpc.StatusCode.INVALID_ARGUMENT)
not_found = _refusal(grpc.StatusCode.NOT_FOUND)
precondition = _refusal(grpc.StatusCode.FAILED_PRECONDITION)
exhausted = _refusal(grpc.StatusCode.RESOURCE_EXHAUSTED)
unauthenticated = _refusal(grpc.StatusCode.UNAUTHENTICATED)
unavailable = _refusal(grpc.StatusCode.UNAVAILABLE)


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
        self._failure: tuple[grpc.StatusCode, str, str] | None = None

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
            why = reasons.SESSION_REPLACED if code is grpc.StatusCode.FAILED_PRECONDITION else reasons.SESSION_CLOSED
            self._failure = (code, f"session {session_id} was closed: {reason}", why)
        self.event.set()
        return True
