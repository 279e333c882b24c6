"""Tenants: which namespaces a caller may use, decided by its token (the token file's
format, owners and quotas: token_file.py).

A caller whose token grants a namespace may register into it, use a session attached to
it (match, insert, load back, ack, release, evict, prefetch, close) and see it in Stats,
Inspect, CheckInvariants and WatchEvents; anything else is PERMISSION_DENIED naming the
namespace, checked before the call changes anything. Stats and CheckInvariants without a
namespace cover only the granted ones; a namespace the caller may not see is never named
in an answer. Without tokens (`--auth-token` inline, or none) every caller may use every
namespace. `Tokens.reload()` re-reads the file (SIGHUP).
"""

import logging
from collections.abc import Callable

import grpc

from ..logs import log_event
from . import reasons
from .errors import ServiceError, not_found
from .token_file import EVERYTHING, Grant, Quota, TokenFileError, digest, parse_token_file

log = logging.getLogger("radixkv.auth")


class Tokens:
    """The tokens the daemon accepts and what each grants; empty: no token is needed.
    Shared by the auth interceptor (is the caller admitted?) and the servicer (what may
    it use?); `reload` swaps them at once on the event loop."""

    def __init__(self, token: str = "", token_file: str = ""):
        self.token_file = token_file
        self.on_reloaded: Callable[[], None] | None = None  # after a reload took effect (the daemon's revocations)
        self._grants: dict[bytes, Grant] = {}
        if token_file:
            self._grants = self._read()
        elif token:
            key = digest(token.encode())
            self._grants = {key: Grant(("*",), "--auth-token", owner=key, token=key)}

    @property
    def required(self) -> bool:
        return bool(self._grants)

    @property
    def scoped(self) -> bool:
        """Whether some token grants less than everything (checks are needed): not every
        namespace, or only one user's shared-memory segments."""
        return any(not g.everything or g.segment_uid is not None for g in self._grants.values())

    def __len__(self) -> int:
        return len(self._grants)

    def grant(self, metadata) -> Grant | None:
        """The grant of the caller's `authorization: Bearer <token>`; None when it
        carries no token the daemon accepts. EVERYTHING when no token is needed."""
        if not self._grants:
            return EVERYTHING
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                if not given.startswith(b"Bearer "):
                    return None
                return self._grants.get(digest(given[len(b"Bearer "):]))
        return None

    def tenant(self, grant: Grant, owner: bytes) -> str:
        """The name of `owner` (a session's or namespace's) as `grant` is shown it: the
        tenant's name to itself and to operators, "" to other tenants, to everyone
        without a token file, and for an owner whose tokens are gone."""
        if not self.token_file or not grant.sees_owner(owner):
            return ""
        return next((g.tenant for g in self._grants.values() if g.owner == owner), "")

    def granted_to_others(self, grant: Grant, namespace: str) -> bool:
        """Whether another tenant's token (one granting some namespaces, not an
        operator's) may use `namespace` too."""
        return any(g.allows(namespace) for g in self._grants.values() if g.owner != grant.owner and not g.everything)

    def allows(self, token: bytes, namespace: str) -> bool:
        """Whether the token whose digest is `token` (a session's) still grants `namespace`
        (True without a token file: nothing was granted, nothing is revoked)."""
        if not self.token_file:
            return True
        grant = self._grants.get(token)
        return grant is not None and grant.allows(namespace)

    def reload(self) -> bool:
        """Re-read the token file (when there is one); on an error keep the tokens in use
        and log it. True when the new tokens are in use."""
        if not self.token_file:
            return False
        try:
            grants = self._read()
        except TokenFileError as e:
            log_event(log, "auth.reload_failed", logging.ERROR, file=self.token_file, error=str(e),
                      kept_tokens=len(self._grants))
            return False
        self._grants = grants
        log_event(log, "auth.reloaded", file=self.token_file, tokens=len(grants),
                  scoped=sum(1 for g in grants.values() if not g.everything))
        if self.on_reloaded is not None:
            self.on_reloaded()
        return True

    def _read(self) -> dict[bytes, Grant]:
        try:
            with open(self.token_file, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            raise TokenFileError(f"cannot read auth token file {self.token_file}: {e.strerror}") from None
        return parse_token_file(text, self.token_file)


def visible(grant: Grant, namespaces: dict, name: str) -> list:
    """The namespaces an operator call covers: `name` ("" every one the grant covers).
    PERMISSION_DENIED for a name the grant does not cover; NOT_FOUND for an unknown one,
    listing only the names the caller may see."""
    if not name:
        return [ns for n, ns in namespaces.items() if grant.allows(n)]
    grant.check(name)
    if name not in namespaces:
        raise not_found(f"no namespace {name!r}; known: {sorted(n for n in namespaces if grant.allows(n))}",
                        reasons.NAMESPACE_UNKNOWN, namespace=name)
    return [namespaces[name]]


# Methods where an empty namespace means "every namespace" and a token that grants only
# some must name one (Stats and CheckInvariants cover the granted ones instead).
NAME_REQUIRED = frozenset({"WatchEvents"})


def authorize(grant: Grant, sessions, method: str, request) -> None:
    """PERMISSION_DENIED when `request` names a namespace, or a live session attached to
    one, that `grant` does not cover (an unknown session is left to the handler).
    Request streams are checked by their handler (acks.py)."""
    if grant.everything:
        return
    session_id = getattr(request, "session", "")
    if session_id and isinstance(session_id, str):
        session = sessions.peek(session_id)
        if session is not None:
            grant.check_session(session)
    namespace = getattr(request, "namespace", None)
    if namespace:
        grant.check(namespace)
    elif namespace == "" and method in NAME_REQUIRED:
        raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                           f"this token grants only some namespaces ({', '.join(grant.patterns)}): "
                           f"{method} must name one", reasons.NAMESPACE_NOT_GRANTED)


__all__ = ["EVERYTHING", "Grant", "Quota", "TokenFileError", "Tokens", "authorize", "parse_token_file", "visible"]
