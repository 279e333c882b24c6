"""Tenants: which namespaces a caller may use, decided by its token.

The token file (`--auth-token-file`) holds one token per line, each followed by the
namespaces it grants as glob patterns (`*`, `?`, `[...]`, as `fnmatch`); `#` starts a
comment:

    # operators: every namespace (a token alone, as in the one-line format before)
    op-7c1d9e...
    # tenant alice: her models only
    al-93be04...   alice/*  shared/llama3-8b/*
    bob-5a6f11...  bob/*  uid=1001
    # carol's old and new token while her engines move to the new one
    c1-0d2e77...   carol/*  tenant=carol
    c2-61f3a0...   carol/*  tenant=carol

A session is its owner's: the token that registered it, or every token of its line's
`tenant=NAME` (a token being rotated and its successor are one owner, so an engine
restarted with the new token may replace the old one's session). Removing a token
still closes the sessions it registered.

`uid=N` binds a token's engines to the shared-memory segments user N owns: a Register
naming a segment of another owner is PERMISSION_DENIED (tenants sharing a host's
/dev/shm could otherwise name each other's segments, and the daemon would read and write
them on their behalf). CUDA IPC handles are not files: a process holds one only when
the exporter handed it over.

A caller whose token grants a namespace may register into it, use a session attached to
it (match, insert, load back, ack, release, evict, prefetch, close) and see it in Stats,
Inspect, CheckInvariants and WatchEvents; anything else is PERMISSION_DENIED naming the
namespace, checked before the call changes anything. Stats and CheckInvariants without a
namespace cover only the granted ones; a namespace the caller may not see is never named
in an answer. Without tokens (`--auth-token` inline, or none) every caller may use every
namespace. `Tokens.reload()` re-reads the file (SIGHUP).
"""

import fnmatch
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ..logs import log_event
from . import reasons
from .errors import ServiceError, not_found

log = logging.getLogger("radixkv.auth")


class TokenFileError(Exception):
    """The token file cannot be used (the message says which line and why)."""


@dataclass(frozen=True, slots=True)
class Grant:
    """The namespaces one token may use: glob `patterns`, or every one (`everything`)."""

    patterns: tuple[str, ...]
    label: str  # for logs: which line of the token file, never the token
    segment_uid: int | None = None  # `uid=N`: the owner its engines' shm segments must have
    owner: bytes = b""  # whose sessions it registers: sha256 of the token, or of its `tenant=` name
    token: bytes = b""  # sha256 of the token (its key in the file; the sessions it registered end with it)

    @property
    def everything(self) -> bool:
        return "*" in self.patterns

    def allows(self, namespace: str) -> bool:
        return self.everything or any(fnmatch.fnmatchcase(namespace, p) for p in self.patterns)

    def check(self, namespace: str) -> None:
        """PERMISSION_DENIED unless this grant covers `namespace`."""
        if not self.allows(namespace):
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               f"this token does not grant namespace {namespace!r} "
                               f"(it grants: {', '.join(self.patterns)})", reasons.NAMESPACE_NOT_GRANTED,
                               namespace=namespace)

    def check_session(self, session) -> None:
        """PERMISSION_DENIED unless this grant may act as `session`: one of every
        namespace (an operator's) may, one of some namespaces only as a session its own
        token registered in one of them (a session id alone is no credential: a tenant
        sharing a namespace sees the others' in Stats, and could otherwise act as them)."""
        if self.everything:
            return
        self.check(session.namespace.name)
        if session.owner != self.owner:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               f"session {session.id[:8]} was registered with another token", reasons.OTHER_SESSION)

    def shows(self, session) -> str:
        """The session's id as Stats shows it to this grant: whole to its owner and to an
        operator, its first 8 characters (as the daemon's logs) to anyone else."""
        return session.id if self.everything or session.owner == self.owner else session.id[:8]


EVERYTHING = Grant(("*",), "no token file")


def parse_token_file(text: str, path: str) -> dict[bytes, Grant]:
    """{sha256(token): Grant} from the file's text. TokenFileError for an empty file or
    a token listed twice."""
    grants: dict[bytes, Grant] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        token, patterns = fields[0], tuple(f for f in fields[1:] if not f.startswith(_OPTIONS))
        uids = [f[len("uid="):] for f in fields[1:] if f.startswith("uid=")]
        tenants = [f[len("tenant="):] for f in fields[1:] if f.startswith("tenant=")]
        if len(uids) > 1 or not all(u.isdecimal() for u in uids):
            raise TokenFileError(f"auth token file {path}: line {number}: give at most one uid=N, N a number "
                                 f"(got {' '.join('uid=' + u for u in uids)})")
        if len(tenants) > 1 or not all(tenants):
            raise TokenFileError(f"auth token file {path}: line {number}: give at most one tenant=NAME, NAME "
                                 f"not empty (got {' '.join('tenant=' + t for t in tenants)})")
        key = _digest(token.encode())
        if key in grants:
            raise TokenFileError(f"auth token file {path}: line {number} repeats the token of {grants[key].label}")
        owner = _digest(b"tenant=" + tenants[0].encode()) if tenants else key
        grants[key] = Grant(patterns or ("*",), f"line {number}", int(uids[0]) if uids else None, owner, key)
    if not grants:
        raise TokenFileError(f"auth token file {path} is empty (no token in it)")
    return grants


_OPTIONS = ("uid=", "tenant=")


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


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
            key = _digest(token.encode())
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
                return self._grants.get(_digest(given[len(b"Bearer "):]))
        return None

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


__all__ = ["EVERYTHING", "Grant", "TokenFileError", "Tokens", "authorize", "parse_token_file", "visible"]
