"""The token file (`--auth-token-file`): what each token grants, whose sessions it
registers, and how much its tenant may hold.

One token per line, followed by the namespaces it grants as glob patterns (`*`, `?`,
`[...]`, as `fnmatch`) and options (`name=value`; a namespace name never holds `=`);
`#` starts a comment:

    # operators: every namespace (a token alone, as in the one-line format before)
    op-7c1d9e...
    # tenant alice: her models only, at most 4 namespaces, 64 GiB of host pools, 16 engines
    al-93be04...   alice/*  shared/llama3-8b/*  namespaces=4  host=64GiB  sessions=16
    bob-5a6f11...  bob/*  uid=1001
    # carol's old and new token while her engines move to the new one
    c1-0d2e77...   carol/*  tenant=carol
    c2-61f3a0...   carol/*  tenant=carol

`tenant=NAME`: a session is its owner's, the token that registered it or, with this,
every token of the tenant (a token being rotated and its successor are one owner, so an
engine restarted with the new token may replace the old one's session). Removing a
token still closes the sessions it registered.

`uid=N` binds a token's engines to the shared-memory segments user N owns: a Register
naming a segment of another owner is PERMISSION_DENIED (tenants sharing a host's
/dev/shm could otherwise name each other's segments, and the daemon would read and write
them on their behalf). CUDA IPC handles are not files: a process holds one only when
the exporter handed it over.

`namespaces=N`, `host=SIZE`, `sessions=N`: the tenant's quota (admission.py). The
namespaces its Registers create (not those it joins) count against the first two: at
most N, their host pools at most SIZE bytes together (`64GiB`, `512MiB`). Every session
its tokens registered counts against `sessions=` (a vLLM engine holds one per worker and
one for its scheduler), in any namespace, its own or joined. Every line of one tenant
gives the same quota. Without them a tenant is bounded only by the daemon's own limits.
"""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass

import grpc

from ..units import parse_size
from . import reasons
from .errors import ServiceError


class TokenFileError(Exception):
    """The token file cannot be used (the message says which line and why)."""


@dataclass(frozen=True, slots=True)
class Quota:
    """What the namespaces a tenant creates may take together (None: no bound)."""

    namespaces: int | None = None
    host_bytes: int | None = None
    sessions: int | None = None


@dataclass(frozen=True, slots=True)
class Grant:
    """The namespaces one token may use: glob `patterns`, or every one (`everything`)."""

    patterns: tuple[str, ...]
    label: str  # for logs: which line of the token file, never the token
    segment_uid: int | None = None  # `uid=N`: the owner its engines' shm segments must have
    owner: bytes = b""  # whose sessions it registers: sha256 of the token, or of its `tenant=` name
    token: bytes = b""  # sha256 of the token (its key in the file; the sessions it registered end with it)
    quota: Quota | None = None  # its tenant's (`namespaces=`, `host=`, `sessions=`)
    tenant: str = ""  # the owner's name for Stats: its `tenant=`, else "line N" ("": no token file)

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
        token (or tenant) registered in one of them (a session id alone is no credential:
        a tenant sharing a namespace sees the others' in Stats, and could otherwise act
        as them)."""
        if self.everything:
            return
        self.check(session.namespace.name)
        if session.owner != self.owner:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               f"session {session.id[:8]} was registered with another token", reasons.OTHER_SESSION)

    def sees_owner(self, owner: bytes) -> bool:
        """Whether this grant is shown who `owner` is (its own, or an operator's)."""
        return self.everything or owner == self.owner

    def shows(self, session) -> str:
        """The session's id as Stats shows it to this grant: whole to its owner and to an
        operator, its first 8 characters (as the daemon's logs) to anyone else."""
        return session.id if self.everything or session.owner == self.owner else session.id[:8]


EVERYTHING = Grant(("*",), "no token file")

_NUMBER, _SIZE, _NAME = "a number", "a size (64GiB)", "a name"
_OPTIONS = {"uid": _NUMBER, "tenant": _NAME, "namespaces": _NUMBER, "host": _SIZE, "sessions": _NUMBER}  # what each takes


def parse_token_file(text: str, path: str) -> dict[bytes, Grant]:
    """{sha256(token): Grant} from the file's text. TokenFileError for an empty file, a
    token listed twice, an unknown or malformed option, or one tenant's lines giving
    different quotas."""
    grants: dict[bytes, Grant] = {}
    quotas: dict[bytes, tuple[Quota, str]] = {}  # owner -> its quota and the line that gave it
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"auth token file {path}: line {number}"
        token, patterns = fields[0], tuple(f for f in fields[1:] if "=" not in f)
        options = _options([f for f in fields[1:] if "=" in f], where)
        key = digest(token.encode())
        if key in grants:
            raise TokenFileError(f"{where} repeats the token of {grants[key].label}")
        owner = digest(b"tenant=" + options["tenant"].encode()) if "tenant" in options else key
        quota = Quota(options.get("namespaces"), options.get("host"), options.get("sessions"))
        quota = None if quota == Quota() else quota
        if owner in quotas and quotas[owner][0] != quota:
            raise TokenFileError(f"{where}: tenant {options['tenant']} has another quota on {quotas[owner][1]} "
                                 "(give every line of one tenant the same namespaces=, host= and sessions=)")
        quotas[owner] = (quota, f"line {number}")
        grants[key] = Grant(patterns or ("*",), f"line {number}", options.get("uid"), owner, key, quota,
                            options.get("tenant", f"line {number}"))
    if not grants:
        raise TokenFileError(f"auth token file {path} is empty (no token in it)")
    return grants


def _options(fields: list[str], where: str) -> dict:
    """`name=value` fields, each parsed as _OPTIONS says it takes."""
    out: dict = {}
    for field in fields:
        name, _, value = field.partition("=")
        if name not in _OPTIONS:
            raise TokenFileError(f"{where}: unknown option {name}= (options: {', '.join(o + '=' for o in _OPTIONS)})")
        if name in out:
            raise TokenFileError(f"{where}: give at most one {name}=")
        takes = _OPTIONS[name]
        try:
            if takes is _NUMBER:
                if not value.isdecimal():
                    raise ValueError
                out[name] = int(value)
            elif takes is _SIZE:
                out[name] = parse_size(value)
            elif not value:
                raise ValueError
            else:
                out[name] = value
        except ValueError:
            raise TokenFileError(f"{where}: {name}= takes {takes} (got {field})") from None
    return out


def digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


__all__ = ["EVERYTHING", "Grant", "Quota", "TokenFileError", "digest", "parse_token_file"]
