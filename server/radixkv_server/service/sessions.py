"""Sessions: an engine's attachment to a namespace, and what it owns there.

A session owns its leases and its load-back transfers (tagged with the session id in
the core). Closing it, for any reason, waits for its copies, finishes its load-backs
and releases its leases, so nothing it held outlives it.
"""

import asyncio
import itertools
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .errors import unauthenticated
from .namespace import Namespace


REMEMBER_EXPIRED = 4096  # expired leases and load-backs remembered per session, for clear errors


@dataclass(eq=False)
class Session:
    id: str
    namespace: Namespace
    engine: str
    leases: dict[int, int] = field(default_factory=dict)  # lease id -> locked node id
    created: float = field(default_factory=time.monotonic)
    closing: bool = False
    has_ack_stream: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    # For the timeouts, oldest first (insertion order is time order): when each lease was
    # taken, and when each load-back not yet acknowledged was answered.
    lease_times: dict[int, float] = field(default_factory=dict)
    unacked: dict[int, float] = field(default_factory=dict)
    expired: OrderedDict = field(default_factory=OrderedDict)  # (kind, id) -> why

    def pop_lease(self, lease: int) -> int:
        """Forget a lease (released by the engine or expired); returns its node id."""
        self.lease_times.pop(lease, None)
        return self.leases.pop(lease)

    def overdue_leases(self, now: float, timeout: float) -> list[int]:
        out = []
        for lease, taken in list(self.lease_times.items()):
            if lease not in self.leases:
                del self.lease_times[lease]
            elif now - taken < timeout:
                break
            else:
                out.append(lease)
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


class SessionRegistry:
    """Live sessions by id, and the reasons recent ones were closed (for clear errors)."""

    def __init__(self, remember_closed: int = 4096):
        self._live: dict[str, Session] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._remember = remember_closed
        self._lease_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._live)

    def all(self) -> list[Session]:
        return list(self._live.values())

    def new(self, namespace: Namespace, engine: str) -> Session:
        session = Session(secrets.token_hex(16), namespace, engine)
        self._live[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The live session with this id; UNAUTHENTICATED with the reason otherwise."""
        if not session_id:
            raise unauthenticated("no session given: call Register and pass the session it returns")
        session = self._live.get(session_id)
        if session is None:
            reason = self._closed.get(session_id)
            if reason is not None:
                raise unauthenticated(f"session {session_id} was closed ({reason}); register again")
            raise unauthenticated(f"unknown session {session_id!r}; register again (the daemon may have restarted)")
        if session.closing:
            raise unauthenticated(f"session {session_id} is closing")
        return session

    def new_lease(self, session: Session, node_id: int) -> int:
        lease = next(self._lease_ids)
        session.leases[lease] = node_id
        session.lease_times[lease] = time.monotonic()
        return lease

    def forget(self, session: Session, reason: str) -> None:
        self._live.pop(session.id, None)
        self._closed[session.id] = reason
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)
