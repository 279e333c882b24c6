"""Who may call: optional tokens, and TLS credentials for TCP listeners.

With tokens configured (`tenants.Tokens`: an inline token, or a token file whose tokens
may each grant only some namespaces) every RPC must carry `authorization: Bearer
<token>` metadata with one of them, or is refused UNAUTHENTICATED before its handler
runs; what the token grants is checked by the servicer (tenants.py). Health checks stay
open so that probes (kubelet, container HEALTHCHECK) need no secret; they reveal only
SERVING or not.

TLS certificates are read again on SIGHUP (`ReloadableTls`): new connections get the
new certificate and client CA; connections already open keep theirs.
"""

import logging
import ssl
from collections.abc import Callable

import grpc

from ..logs import log_event
from . import reasons
from .errors import Refusal

log = logging.getLogger("radixkv.auth")

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class AuthError(Exception):
    """The token or a certificate file cannot be used (the message says which and why)."""


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise AuthError(f"cannot read {what} {path}: {e.strerror}") from None


class ReloadableTls:
    """TLS credentials for TCP listeners (with a client CA: mutual TLS, clients must
    present a certificate it signed), whose certificate, key and client CA are read
    again by `reload` (SIGHUP). gRPC asks for a newer configuration at each new
    connection's handshake; connections already open keep theirs. Mutual TLS stays on
    or off as started."""

    def __init__(self, cert: str, key: str, client_ca: str):
        self._files = (cert, key, client_ca)
        self._current = self._read()
        self._fresh = None  # read by `reload`, handed to gRPC at the next handshake

    @classmethod
    def open(cls, cert: str, key: str, client_ca: str) -> "ReloadableTls | None":
        """None when TLS is off (no certificate). AuthError for a file it cannot read."""
        return cls(cert, key, client_ca) if cert else None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._current, self._fetch, require_client_authentication=bool(self._files[2]))

    def reload(self) -> bool:
        """Read the files again; on an error keep the certificates in use and log it.
        True when the new ones will be used."""
        try:
            self._fresh = self._read()
        except AuthError as e:
            log_event(log, "tls.reload_failed", logging.ERROR, error=str(e))
            return False
        log_event(log, "tls.reloaded", cert=self._files[0], client_ca=self._files[2] or "-")
        return True

    def _fetch(self):
        """Called by gRPC (any thread) before a handshake: the new configuration once."""
        fresh, self._fresh = self._fresh, None
        return fresh

    def _read(self):
        """The configuration for gRPC, once the files parse as a certificate and its key
        (and CA certificates): AuthError saying what is wrong (gRPC failed only later, at
        the bind or at each handshake, naming neither)."""
        cert, key, client_ca = self._files
        root = read_file(client_ca, "TLS client CA") if client_ca else None
        pair = (read_file(key, "TLS key"), read_file(cert, "TLS certificate"))
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key, password=lambda: b"")  # never a prompt: gRPC takes no passphrase
            if client_ca:
                context.load_verify_locations(client_ca)
        except ssl.SSLError as e:
            raise AuthError(f"TLS certificate {cert}, key {key}"
                            f"{f', client CA {client_ca}' if client_ca else ''}: cannot be used: {e}") from None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=root)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuse RPCs without `authorization: Bearer <token>` naming one of `tokens`
    (health checks excepted). `tokens` may be reloaded meanwhile. `on_refused(method)`
    (the method's short name) is told of each refusal (metrics)."""

    def __init__(self, tokens, on_refused: Callable[[str], None] | None = None):
        self._tokens = tokens  # tenants.Tokens
        self._on_refused = on_refused

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES) or \
                self._tokens.grant(details.invocation_metadata) is not None:
            return handler
        log_event(log, "rpc.unauthenticated", logging.DEBUG, method=details.method)
        if self._on_refused is not None:
            self._on_refused(details.method.rsplit("/", 1)[-1])
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request: a request
    stream (whatever the method's shape: the wire is the same) never iterated, with no
    deserializer. A unary handler made gRPC receive and parse the whole message first,
    so a caller without a token could make the daemon hold --max-message-size bytes per
    call (64 MiB; 16 such calls took it from 244 to 1330 MiB)."""

    async def refuse(requests, context):
        refusal = Refusal(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: send 'authorization: Bearer <token>' metadata", reasons.TOKEN_REJECTED)
        await context.abort(refusal.code, refusal.message, refusal.trailer())

    return grpc.stream_stream_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
