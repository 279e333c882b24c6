"""Sessions: an engine's attachment to a namespace, and the bookkeeping of what it holds.

A session owns the ids of its leases (each names a node its namespace locked), the
load-backs it was answered but has not acknowledged, and the reasons recent ones
expired. It changes no cache state itself: its `Namespace` locks and unlocks, loads and
finishes, and asks the session which lease or transfer is whose. Closing a session
(`Daemon.close_session`) finishes its load-backs and releases its leases, so nothing
it held outlives it.
"""

import asyncio
import contextlib
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from ..core.ids import fresh_ids
from . import reasons
from .errors import ServiceError, exhausted, invalid, not_found, precondition, unauthenticated

REMEMBER_EXPIRED = 4096  # expired leases and load-backs remembered per session, for clear errors


@dataclass(eq=False)
class Session:
    id: str
    namespace: object  # the service.namespace.Namespace it is attached to
    engine: str
    lease_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)
    leases: dict[int, int] = field(default_factory=dict)  # lease id -> locked node id
    created: float = field(default_factory=time.monotonic)
    last_call: float = field(default_factory=time.monotonic)  # when a call naming it last began or ended
    has_ack_stream: bool = False
    closer: asyncio.Task | None = None  # the daemon's task ending it, once it began closing
    # For the timeouts, oldest first (insertion order is time order): when each lease was
    # taken, and when each load-back not yet acknowledged was answered.
    lease_times: dict[int, float] = field(default_factory=dict)
    unacked: dict[int, float] = field(default_factory=dict)
    expired: OrderedDict = field(default_factory=OrderedDict)  # (kind, id) -> why
    # Engine-managed namespaces: "engine" (a rank's buffers) or "scheduler" (no buffers),
    # the tensor-parallel rank, the engine instance it belongs to, and its device pages.
    role: str = "engine"
    rank: int = 0
    instance: str = ""
    device_pages: int = 0
    owner: bytes = b""  # whose it is: tenants.Grant.owner of the token that registered it (b"": no token file)
    token: bytes = b""  # sha256 of the token that registered it: removed from the token file, the session ends
    max_leases: int = 100_000  # leases it may hold at once (--max-leases-per-session)
    lease_room_held: int = 0  # leases its calls in flight will take (`lease_room`)
    waiting_for_ranks: bool = False  # its Register waits for its group (rank_registration.wait_for_ranks)
    # Expired transfers the daemon finished: transfer -> expiry.ExpiredTransfer, for the
    # late ack. `ack_stream`: the session's open AckStream (acks.py), told at once of
    # each; None while it has none.
    expired_loads: OrderedDict = field(default_factory=OrderedDict)
    ack_stream: object = None
    session_stream: object = None  # its open Session stream (session_stream.py), or None
    # Whether another live session of the registry holds a lease (for the status of a
    # call naming it): lease ids are unique across a registry's sessions.
    held_elsewhere: Callable[[int], bool] = field(default=lambda lease: False, repr=False)

    def idle_without_stream(self, now: float) -> float:
        """Seconds since a call last named this session, while it has no stream open;
        0 while it has one (a stream's end closes its session anyway) or while its
        Register waits for its group's other ranks (its engine has no id to call with)."""
        if self.ack_stream is not None or self.session_stream is not None or self.waiting_for_ranks:
            return 0.0
        return now - self.last_call

    @property
    def closing(self) -> bool:
        """The daemon began closing it (`Daemon.close_session`)."""
        return self.closer is not None

    def check_open(self) -> None:
        """FAILED_PRECONDITION once the session began closing (after an `await`)."""
        if self.closing:
            raise precondition(f"session {self.id} closed while this call waited", reasons.SESSION_CLOSED,
                               session=self.id)

    # -- leases ---------------------------------------------------------------------------

    def check_lease_room(self, more: int) -> None:
        """RESOURCE_EXHAUSTED when `more` leases would take this session past its limit
        (counting those its calls in flight hold room for: `lease_room`); called before a
        call takes any, so none is taken that its caller never learns of."""
        if more > 0 and len(self.leases) + self.lease_room_held + more > self.max_leases:
            raise exhausted(reason=reasons.LIMIT_REACHED, limit="--max-leases-per-session", message=f"session {self.id[:8]} holds {len(self.leases)} leases and this call would take "
                            f"{more} more, past --max-leases-per-session {self.max_leases}: release the leases of "
                            "requests that are done (each pins its pages against eviction)")

    @contextlib.contextmanager
    def lease_room(self, more: int):
        """`check_lease_room`, then hold room for `more` leases while the call waits
        before taking them (concurrent calls of the session would all pass the check)."""
        self.check_lease_room(more)
        held = max(more, 0)
        self.lease_room_held += held
        try:
            yield
        finally:
            self.lease_room_held -= held

    def add_lease(self, node_id: int) -> int:
        """Record a lease on `node_id` (which the caller locked); returns its id."""
        lease = next(self.lease_ids)
        self.leases[lease] = node_id
        self.lease_times[lease] = time.monotonic()
        return lease

    def check_lease(self, lease: int) -> None:
        """PERMISSION_DENIED for another session's lease; NOT_FOUND (saying whether it
        expired) for one no session holds."""
        if lease not in self.leases:
            self._refuse_unknown([lease])

    def pop_lease(self, lease: int) -> int:
        """Forget a lease (released by the engine or expired); returns its node id."""
        self.check_lease(lease)
        self.lease_times.pop(lease, None)
        return self.leases.pop(lease)

    def pop_leases(self, leases: list[int]) -> list[int]:
        """Forget every lease listed, or none: PERMISSION_DENIED naming another session's,
        NOT_FOUND naming each one no session holds, INVALID_ARGUMENT for one listed twice.
        Returns their node ids."""
        unknown = [lease for lease in leases if lease not in self.leases]
        if unknown:
            self._refuse_unknown(unknown)
        if len(set(leases)) != len(leases):
            raise invalid(f"leases {sorted(x for x in set(leases) if leases.count(x) > 1)} are listed twice")
        return [self.pop_lease(lease) for lease in leases]

    def pop_held(self, leases: list[int]) -> list[int]:
        """Forget those of `leases` this session still holds (a call taking them failed
        before answering); returns their node ids."""
        held = [lease for lease in leases if lease in self.leases]
        return [self.pop_lease(lease) for lease in held]

    def pop_all_leases(self) -> list[int]:
        """Forget every lease (the session is closing); returns their node ids."""
        nodes = list(self.leases.values())
        self.leases.clear()
        self.lease_times.clear()
        return nodes

    def _refuse_unknown(self, leases: list[int]) -> None:
        foreign = [lease for lease in leases if self.held_elsewhere(lease)]
        if foreign:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               "; ".join(f"lease {lease} belongs to another session" for lease in foreign),
                               reasons.OTHER_SESSION, leases=",".join(map(str, foreign)))
        raise not_found("; ".join(self._lease_unknown(lease) for lease in leases), reasons.LEASE_UNKNOWN,
                        leases=",".join(map(str, leases)))

    def _lease_unknown(self, lease: int) -> str:
        why = self.expired.get(("lease", lease))
        if why is not None:
            return f"lease {lease} {why}"
        return f"lease {lease} is not held by this session (released, or never taken)"

    # -- load-backs awaiting their ack ------------------------------------------------------

    def answered(self, transfer: int) -> None:
        """The engine was told of load-back `transfer`; its ack is due."""
        self.unacked[transfer] = time.monotonic()

    def acked(self, transfer: int) -> None:
        self.unacked.pop(transfer, None)

    def forget_loads(self) -> None:
        """Its load-backs were finished (the session is closing): no ack is due."""
        self.unacked.clear()

    # -- timeouts ---------------------------------------------------------------------------

    def overdue_leases(self, now: float, timeout: float) -> list[int]:
        """Leases held `timeout` or longer, oldest first. Reads `lease_times` from its
        oldest entry to the first lease not yet due (no copy of the whole table: an expiry
        pass over a million leases took 0.1 s on the loop), forgetting released ones."""
        out, released = [], []
        for lease, taken in self.lease_times.items():
            if lease not in self.leases:
                released.append(lease)
            elif now - taken < timeout:
                break
            else:
                out.append(lease)
        for lease in released:
            del self.lease_times[lease]
        return out

    def overdue_loads(self, now: float, timeout: float) -> list[int]:
        out = []
        for transfer, answered in self.unacked.items():
            if now - answered < timeout:
                break
            out.append(transfer)
        return out

    def remember_expired(self, kind: str, ident: int, why: str) -> None:
        self.expired[(kind, ident)] = why
        while len(self.expired) > REMEMBER_EXPIRED:
            self.expired.popitem(last=False)

    def finished_expired(self, transfer: int, outcome) -> None:
        """The daemon finished expired `transfer` (`outcome`: an expiry.ExpiredTransfer):
        remember it for a late ack and tell the ack stream, if one is open."""
        self.expired_loads[transfer] = outcome
        while len(self.expired_loads) > REMEMBER_EXPIRED:
            self.expired_loads.popitem(last=False)
        if self.ack_stream is not None:
            self.ack_stream.expired(transfer, outcome)

    def expired_transfer(self, transfer: int):
        """The expiry.ExpiredTransfer of a transfer the daemon finished, else None."""
        return self.expired_loads.get(transfer)

    def expired_reason(self, kind: str, ident: int) -> str | None:
        """Why lease or transfer `ident` expired ("lease" / "transfer"), if it did."""
        return self.expired.get((kind, ident))


@dataclass(frozen=True, slots=True)
class Holdings:
    """What the sessions of one namespace hold now (Stats, metrics)."""

    leases: int = 0
    oldest_lease_seconds: float = 0.0  # age of the oldest lease (0: none)
    unacked_loads: int = 0             # load-backs answered, not acknowledged yet
    # Age of the oldest of those (0: none). Engine-managed namespaces count their loads
    # (and their saves answered before copied) here too: both wait for the engine's ack.
    oldest_unacked_seconds: float = 0.0


class SessionRegistry:
    """Live sessions by id, and the reasons recent ones were closed (for clear errors).
    Lease ids are unique across the sessions of a registry."""

    def __init__(self, remember_closed: int = 4096, max_leases: int = 100_000):
        self.max_leases = max_leases  # per session (--max-leases-per-session)
        self._live: dict[str, Session] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._remember = remember_closed
        self._lease_ids = fresh_ids()

    def __len__(self) -> int:
        return len(self._live)

    def all(self) -> list[Session]:
        return list(self._live.values())

    def peek(self, session_id: str) -> Session | None:
        """The live session with this id, or None (no error: for checks before a call)."""
        return self._live.get(session_id)

    def holdings(self, namespace) -> Holdings:
        """Leases and unacknowledged load-backs of the sessions attached to `namespace`,
        with the age of the oldest of each. Reads only; costs one step per session (plus
        the released leases not yet dropped from `lease_times`)."""
        now = time.monotonic()
        leases = unacked = 0
        oldest_lease = oldest_unacked = now
        for s in self._live.values():
            if s.namespace is namespace:
                leases += len(s.leases)
                unacked += len(s.unacked)
                # lease_times and unacked are in time order; released leases leave lease_times lazily
                taken = next((t for lease, t in s.lease_times.items() if lease in s.leases), now)
                oldest_lease = min(oldest_lease, taken)
                oldest_unacked = min(oldest_unacked, next(iter(s.unacked.values()), now))
        return Holdings(leases, now - oldest_lease, unacked, now - oldest_unacked)

    def new(self, namespace, engine: str, owner: bytes = b"", token: bytes = b"") -> Session:
        """A live session of `namespace`, its own to `owner`, registered with the token
        whose digest is `token` (tenants.Grant)."""
        session = Session(secrets.token_hex(16), namespace, engine, lease_ids=self._lease_ids,
                          held_elsewhere=self._leased, max_leases=self.max_leases, owner=owner, token=token)
        self._live[session.id] = session
        return session

    def _leased(self, lease: int) -> bool:
        """Whether a live session holds `lease` (an error path: one pass over them)."""
        return any(lease in s.leases for s in self._live.values())

    def get(self, session_id: str) -> Session:
        """The live session with this id; UNAUTHENTICATED with the reason otherwise."""
        if not session_id:
            raise unauthenticated("no session given: call Register and pass the session it returns",
                                  reasons.SESSION_REQUIRED)
        session = self._live.get(session_id)
        if session is None:
            reason = self._closed.get(session_id)
            if reason is not None:
                raise unauthenticated(f"session {session_id} was closed ({reason}); register again",
                                      reasons.SESSION_CLOSED, session=session_id)
            raise unauthenticated(f"unknown session {session_id!r}; register again (the daemon may have restarted)",
                                  reasons.SESSION_UNKNOWN, session=session_id)
        if session.closing:
            raise unauthenticated(f"session {session_id} is closing", reasons.SESSION_CLOSED, session=session_id)
        session.last_call = time.monotonic()
        return session

    def find(self, session_id: str) -> Session | None:
        """The session with this id, live or closing; None once closed or unknown."""
        return self._live.get(session_id)

    def forget(self, session: Session, reason: str) -> None:
        self._live.pop(session.id, None)
        self._closed[session.id] = reason
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)
