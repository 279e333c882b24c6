"""Channels to the daemon: plain, TLS or mutual TLS, with an optional shared token.

    Client("daemon.host:7070", tls=Tls(ca_file="ca.pem"), token="s3cret")
    Client("daemon.host:7070", tls=Tls("ca.pem", cert_file="engine.pem", key_file="engine.key"))

Unix sockets need no TLS (the socket's file mode guards them); TCP to another host
should use it. With a token every call carries `authorization: Bearer <token>`.
"""

import os
import stat
import time
from collections import namedtuple
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from grpc_health.v1 import health_pb2

from .errors import InvalidArgument, RadixKVError, Unavailable
from .plans import Plan, Rpc, Sleep


DEFAULT_TARGET = "unix:///run/radixkv/radixkv.sock"


def fallback_target() -> str:
    """Where a daemon on the default address listens when it may not use /run/radixkv
    (not root): this user's runtime directory, else /tmp/radixkv-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/radixkv-{os.getuid()}"
    return f"unix://{base}/radixkv/radixkv.sock"


def resolve_target(target: str) -> str:
    """`target`, except that the default address is the fallback's when only the
    fallback's socket exists (a daemon run by this user, `make serve` not as root), so
    clients on defaults find a daemon on defaults. Decided when a client is made: one
    made before such a daemon started keeps the default address. The fallback is taken
    only when its directories and socket are this user's own and no one else may write
    the directories: /tmp/radixkv-<uid> may be made by anyone first, and a socket there
    would get the engine's token and its KV buffers' handles."""
    if target != DEFAULT_TARGET or os.path.exists(DEFAULT_TARGET.removeprefix("unix://")):
        return target
    fallback = fallback_target()
    sock = fallback.removeprefix("unix://")
    ours = (_mine(os.path.dirname(os.path.dirname(sock)), stat.S_ISDIR, 0o022)
            and _mine(os.path.dirname(sock), stat.S_ISDIR, 0o022) and _mine(sock, stat.S_ISSOCK, 0))
    return fallback if ours else target


def _mine(path: str, kind, others_may_not: int) -> bool:
    """Whether `path` is of `kind` (not a link), this user's, and none of the mode bits
    `others_may_not` is set."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & others_may_not


@dataclass(frozen=True)
class Tls:
    """TLS towards the daemon. `ca_file`: PEM roots that signed the daemon's certificate
    (empty: the system's roots). `cert_file` and `key_file`: this client's certificate,
    for daemons that require mutual TLS. `server_name`: the name to check in the
    daemon's certificate when it differs from the target's host."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("Tls: cert_file and key_file go together")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file), private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file))

    def options(self) -> list[tuple[str, object]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e.strerror}") from None


def _with_token(details, token_md: tuple[str, str], cls):
    metadata = list(details.metadata or ())
    metadata.append(token_md)
    return cls(details.method, details.timeout, metadata, details.credentials,
               details.wait_for_ready, *([details.compression] if hasattr(details, "compression") else []))


class _Details(namedtuple("_Details", "method timeout metadata credentials wait_for_ready compression"),
               grpc.ClientCallDetails):
    pass


class _Token(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every call of a blocking channel."""

    def __init__(self, token: str):
        self._md = ("authorization", f"Bearer {token}")

    def _call(self, continuation, details, request):
        return continuation(_with_token(details, self._md, _Details), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


class _AioToken:
    """Adds the token to every call of an asyncio channel. grpc.aio files an
    interceptor under its first matching kind only, hence one subclass per kind."""

    def __init__(self, token: str):
        self._md = ("authorization", f"Bearer {token}")

    async def _call(self, continuation, details, request):
        return await continuation(_with_token(details, self._md, grpc.aio.ClientCallDetails), request)

    @classmethod
    def all_kinds(cls, token: str) -> list:
        return [kind(token) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamStream)]


class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioToken._call


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AioToken._call


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AioToken._call


def _check_token(token: str | None) -> None:
    if token is not None and (not token or any(c in token for c in "\r\n")):
        raise InvalidArgument("token must be a non-empty single line")


def open_channel(target: str, options: Sequence, tls: Tls | None, token: str | None) -> grpc.Channel:
    """A blocking channel: TLS when `tls` is given, the token on every call when given."""
    _check_token(token)
    if tls is not None:
        channel = grpc.secure_channel(target, tls.credentials(), options=[*options, *tls.options()])
    else:
        channel = grpc.insecure_channel(target, options=options)
    return grpc.intercept_channel(channel, _Token(token)) if token else channel


def open_aio_channel(target: str, options: Sequence, tls: Tls | None, token: str | None) -> grpc.aio.Channel:
    """The asyncio twin of `open_channel`."""
    _check_token(token)
    interceptors = _AioToken.all_kinds(token) if token else None
    if tls is not None:
        return grpc.aio.secure_channel(target, tls.credentials(), options=[*options, *tls.options()],
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def wait_serving(target: str, timeout: float, service: str) -> Plan[None]:
    """Until the daemon at `target` answers `service` SERVING (health), within `timeout`
    seconds; raises Unavailable saying what it answered last (or why nothing came)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while (left := deadline - time.monotonic()) > 0:
        try:
            resp = yield Rpc("Check", health_pb2.HealthCheckRequest(service=service), min(left, 1.0),
                             health=True, wait_for_ready=True)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except RadixKVError as e:
            last = str(e)
        yield Sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    if "DEADLINE_EXCEEDED" in last:  # waiting for a connection hides why there is none
        try:
            yield Rpc("Check", health_pb2.HealthCheckRequest(service=service), 1.0, health=True)
        except RadixKVError as e:
            last = str(e)
    raise Unavailable(f"daemon at {target} not serving after {timeout}s ({last})")


__all__ = ["Tls", "open_aio_channel", "open_channel", "wait_serving"]
