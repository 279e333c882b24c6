"""Who may call: an optional shared token, and TLS credentials for TCP listeners.

With a token configured every RPC must carry `authorization: Bearer <token>` metadata
or is refused UNAUTHENTICATED before its handler runs. Health checks stay open so that
probes (kubelet, container HEALTHCHECK) need no secret; they reveal only SERVING or not.
"""

import hmac
import logging

import grpc

from ..logs import log_event

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


def load_token(token: str, token_file: str) -> str:
    """The configured token ('' when none): given inline, or the first line of a file."""
    if token_file:
        lines = read_file(token_file, "auth token file").decode("utf-8", "replace").splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise AuthError(f"auth token file {token_file} is empty")
    return token


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials | None:
    """TLS credentials for TCP listeners; with `client_ca`, clients must present a
    certificate that CA signed (mutual TLS). None when TLS is off."""
    if not cert:
        return None
    root = read_file(client_ca, "TLS client CA") if client_ca else None
    return grpc.ssl_server_credentials(
        [(read_file(key, "TLS key"), read_file(cert, "TLS certificate"))],
        root_certificates=root, require_client_auth=root is not None)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuse RPCs without `authorization: Bearer <token>` (health checks excepted)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("TokenAuth needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES) or \
                self._authorized(details.invocation_metadata):
            return handler
        log_event(log, "rpc.unauthenticated", logging.DEBUG, method=details.method)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong token: send 'authorization: Bearer <token>' metadata")

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
