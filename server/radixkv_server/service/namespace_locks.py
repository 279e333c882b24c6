"""One lock per namespace name, and the room held by the changes under way.

A Register, a DropNamespace and a reclaim (namespace_reclaim.py) each change one
namespace and await I/O while they do: device buffers opened, a host pool allocated
and pinned, a replaced session closed after its copies, host copies stored, a pool
freed. They take the lock of the namespace they change, so a slow change (a
DropNamespace storing into a store that stopped answering, a 100 GiB pool being
pinned) holds only that namespace's callers, never another tenant's Register.

The daemon's limits (--max-namespaces, --max-sessions, the host memory budget) are
checked between awaits on the daemon's one loop, so the check needs no lock of its
own; what it must count besides the registry is the room a change under way holds
(`Reserved`): a Register admitted but not done yet (its session, and its new pool),
and a namespace being dropped (its pool until it is freed).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass


@dataclass
class Reserved:
    """The room one namespace's change under way holds outside the registry."""

    session: bool = False           # a Register admitted whose session is not made yet
    host_bytes: int | None = None   # a namespace not in the registry (being made or freed), its pool's bytes
    owner: bytes = b""              # the registering tenant (token_file.Grant.owner), for its quota


class NamespaceLocks:
    def __init__(self):
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}  # the holder and the waiters, per name
        self._reserved: dict[str, Reserved] = {}

    @contextlib.asynccontextmanager
    async def hold(self, name: str):
        """Hold namespace `name`'s lock for the block; what the block reserved under
        `name` and did not release is released at its end (a Register that failed)."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        self._users[name] = self._users.get(name, 0) + 1
        try:
            async with lock:
                try:
                    yield
                finally:
                    self._reserved.pop(name, None)
        finally:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name], self._locks[name]

    def busy(self, name: str) -> bool:
        """Whether a change of namespace `name` is under way or waiting."""
        return name in self._users

    # -- room held meanwhile (by the holder of `name`'s lock) ---------------------------

    def reserve(self, name: str, session: bool = False, host_bytes: int | None = None, owner: bytes = b"") -> None:
        """Count a session and/or a pool of `host_bytes` (tenant `owner`'s) for `name`
        until released."""
        self._reserved[name] = Reserved(session, host_bytes, owner)

    def session_made(self, name: str) -> None:
        """The session reserved for `name` is in the registry now."""
        if (held := self._reserved.get(name)) is not None:
            held.session = False

    def pool_entered(self, name: str) -> None:
        """The pool reserved for `name` is in the registry now."""
        if (held := self._reserved.get(name)) is not None:
            held.host_bytes = None

    def sessions(self, owner: bytes | None = None) -> int:
        """Sessions admitted and not made yet (tenant `owner`'s only, when given)."""
        return sum(held.session for held in self._reserved.values() if owner in (None, held.owner))

    def pools(self, owner: bytes | None = None) -> dict[str, int]:
        """Pools outside the registry, being made or freed (tenant `owner`'s only, when
        given): name -> bytes."""
        return {name: held.host_bytes for name, held in self._reserved.items()
                if held.host_bytes is not None and owner in (None, held.owner)}


__all__ = ["NamespaceLocks", "Reserved"]
