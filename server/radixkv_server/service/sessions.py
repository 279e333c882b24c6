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
        return lease

    def forget(self, session: Session, reason: str) -> None:
        self._live.pop(session.id, None)
        self._closed[session.id] = reason
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)
