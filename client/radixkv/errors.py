"""Typed client errors: one class per gRPC status the daemon answers with.

The daemon reports every caller error as a gRPC status code with a message (see the
proto's wire conventions). `from_rpc_error` turns a `grpc.RpcError` (sync or aio) into
the matching `RadixKVError` subclass, so engines catch `radixkv.errors.NotFound`
instead of comparing status codes. `Unavailable` means the daemon could not be reached
(not running, wrong socket, or shutting down). `SessionLost` (and `DaemonRestarted`)
come from the client itself: the session is gone and was replaced by a new one, so the
engine must drop its view of cached device pages.

`reason` tells apart refusals of one code that ask for different actions (the daemon's
`google.rpc.ErrorInfo`: SESSION_CLOSED, NAMESPACE_MISMATCH, RANKS_MISSING, ...; the
proto's wire conventions list them, docs/engines.md says what each asks), with
`metadata` (for example `leases` or `field`); "" and {} when the daemon gave none.
"""

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

DOMAIN = "radixkv"  # the ErrorInfo domain of the daemon's reasons


class RadixKVError(Exception):
    """Base class: a call the daemon (or the client, before sending) refused.

    `code` is the `grpc.StatusCode`, `message` the daemon's explanation, `reason` and
    `metadata` its ErrorInfo ("" and {} for none).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    leases: tuple[int, ...] = ()  # a refused Release: the leases no session (or another) holds

    def __init__(self, message: str, code: grpc.StatusCode | None = None, reason: str = "",
                 metadata: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.reason = reason
        self.metadata = dict(metadata or {})

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(RadixKVError):
    """Malformed input: misaligned tokens, wrong page counts, out-of-range pages."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RadixKVError):
    """Unknown node, lease or transfer (often evicted or finished since)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RadixKVError):
    """The current state forbids the call (e.g. the client is not registered)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(RadixKVError):
    """No session, or a session the daemon does not know (closed, or daemon restarted)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RadixKVError):
    """The object (lease, transfer) belongs to another session."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(RadixKVError):
    """A limit was hit (sessions, pool sizes, message size)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RadixKVError):
    """The daemon is unreachable or shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RadixKVError):
    """The call (or a client-side wait) ran past its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(RadixKVError):
    """The call was cancelled (usually because the client closed)."""

    code = grpc.StatusCode.CANCELLED


class Internal(RadixKVError):
    """A daemon bug: the daemon failed in a way no caller input explains."""

    code = grpc.StatusCode.INTERNAL


class Unimplemented(RadixKVError):
    """The daemon has no such RPC: it is older than this client (upgrade the daemon)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class SessionLost(RadixKVError):
    """The session is gone and the client registered a new one: every device page the
    engine handed to the cache is the engine's again (the daemon holds none of them),
    so the engine must drop its view of cached device pages before going on.

    Raised by the call that found out (its own outcome is unknown: treat its pages as
    not cached either); load-backs not yet answered have failed. `registration` is the
    new session. Not an `Unavailable`: retrying the call without dropping the view
    would be wrong.
    """

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, registration=None, old_instance: str = "", new_instance: str = ""):
        super().__init__(message)
        self.registration = registration
        self.old_instance = old_instance
        self.new_instance = new_instance


class DaemonRestarted(SessionLost):
    """The daemon restarted (a new `daemon_instance`): its host tier is gone too."""


_BY_CODE: dict[grpc.StatusCode, type[RadixKVError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, Unauthenticated, PermissionDenied,
                ResourceExhausted, Unavailable, DeadlineExceeded, Cancelled, Internal, Unimplemented)
}


def error_for(code: grpc.StatusCode, message: str, reason: str = "",
              metadata: dict[str, str] | None = None) -> RadixKVError:
    """The exception for a status code; codes without a class give a `RadixKVError`
    carrying that code."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return RadixKVError(message, code, reason, metadata)
    return cls(message, reason=reason, metadata=metadata)


def error_info(err: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """The reason and metadata of the daemon's ErrorInfo in a failed call's status
    details; ("", {}) when it has none (or details that do not parse, or another
    domain's: a proxy's)."""
    try:
        status = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None
    except (ValueError, TypeError):  # details that contradict the call's status
        return "", {}
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN:
            return info.reason, dict(info.metadata)
    return "", {}


def code_from_int(value: int) -> grpc.StatusCode:
    """The `grpc.StatusCode` whose numeric value is `value` (UNKNOWN when none is)."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def from_rpc_error(err: grpc.RpcError, method: str = "", timeout: float | None = None) -> RadixKVError:
    """Map a failed call (`grpc.RpcError` or `grpc.aio.AioRpcError`) to its typed error;
    with `method`, the message names it (and `timeout` when the deadline ran out)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    message = details or str(err)
    if method and code is grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        message = f"{method}: no answer within {timeout:g}s ({message})"
    if method and code is grpc.StatusCode.UNIMPLEMENTED:  # gRPC's own words name neither
        from . import __version__
        message = (f"the daemon has no {method} call: it is older than this client (radixkv {__version__}); "
                   f"upgrade the daemon ({message})")
    return error_for(code, message, *error_info(err))


__all__ = [
    "Cancelled", "DaemonRestarted", "DeadlineExceeded", "FailedPrecondition", "Internal",
    "InvalidArgument", "NotFound", "PermissionDenied", "RadixKVError", "ResourceExhausted",
    "SessionLost", "Unauthenticated", "Unavailable", "Unimplemented", "code_from_int", "error_for", "error_info",
    "from_rpc_error",
]
