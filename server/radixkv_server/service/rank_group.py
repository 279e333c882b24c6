"""RankGroup: the rank sessions of a tensor-parallel managed-device namespace.

An engine split over `tp_size` ranks (SGLang's tensor parallelism) keeps one page table
for all of them: page p of every rank holds that rank's heads of the same tokens. Each
rank registers a session with its own buffers on the one namespace; the group gathers
until every rank is in, then the namespace copies through all the ranks' buffers as one
device (`datapath.RankedBuffers`), so every transfer is done on every rank or on none.

Rank 0's session drives: Match, Insert, LoadBack, Evict, Release, Prefetch and acks
come from it (the engine shares the answers among its ranks, as it shares requests).
The other ranks' sessions lend their buffers and keep their session alive. A group is
one engine (one `instance`): when any of its sessions ends, the daemon ends the others.

The event loop owns it. Pure bookkeeping: the namespace attaches and closes buffers.
"""

import asyncio

from ..datapath import DeviceBuffers, RankedBuffers
from . import reasons
from .errors import precondition, unavailable
from .sessions import Session

DRIVER = 0  # the rank whose session makes the tree calls


class RankGroup:
    """The sessions of `tp_size` ranks of namespace `name`."""

    def __init__(self, name: str, tp_size: int):
        self.name = name
        self.tp_size = tp_size
        self.sessions: dict[int, Session] = {}  # rank -> its session
        self.device_uuids: dict[int, str] = {}  # rank -> the GPU its buffers were opened on ("": none)
        self._waiting: dict[int, DeviceBuffers] = {}  # opened buffers of ranks in, until all are
        self.warm = False  # the namespace held a host tier when this group's first rank came
        self._formed: asyncio.Future | None = None  # this group's gathering: see `wait_formed`

    @property
    def complete(self) -> bool:
        return len(self.sessions) == self.tp_size

    def missing(self) -> list[int]:
        return [r for r in range(self.tp_size) if r not in self.sessions]

    @property
    def driver(self) -> Session | None:
        return self.sessions.get(DRIVER)

    def join(self, session: Session, device: DeviceBuffers, warm: bool) -> RankedBuffers | None:
        """Add rank `session.rank` with its buffers (its place must be free); the first
        rank of a group says whether the namespace was `warm` for all of them. Once every
        rank is in: all their buffers as one device, which the caller attaches and owns
        (then `formed`); None while ranks are missing (the group holds the buffers).
        Call on the event loop."""
        assert session.rank not in self.sessions, "the registration checks the rank's place is free"
        if not self.sessions:
            self.warm = warm
            self._formed = asyncio.get_running_loop().create_future()
        self.sessions[session.rank] = session
        self.device_uuids[session.rank] = getattr(device, "device_uuid", "")
        self._waiting[session.rank] = device
        if not self.complete:
            return None
        assert len(self._waiting) == self.tp_size, "the registration lets no rank join a group that is closing"
        ranked = RankedBuffers([self._waiting[r] for r in range(self.tp_size)], device.layout)
        self._waiting.clear()
        return ranked

    def formed(self, dropped_tokens: int | None) -> None:
        """The joined buffers were attached (`dropped_tokens` with the last group's device
        residency), or failed to (None): wakes `wait_formed`."""
        if self._formed is not None and not self._formed.done():
            self._formed.set_result(dropped_tokens)

    async def wait_formed(self, session: Session, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for the group `session` joined to form: the
        tokens its attach dropped once it did (at once for a formed group); None when it
        has not yet. ServiceError UNAVAILABLE when the group ended first (a rank left, or
        attaching the buffers failed): `session` is closing then."""
        formed = self._formed
        if self.sessions.get(session.rank) is session and formed is not None:
            try:
                dropped = await asyncio.wait_for(asyncio.shield(formed), timeout)
            except TimeoutError:
                dropped = None
            if self.sessions.get(session.rank) is session and (dropped is not None or not formed.done()):
                return dropped
        raise unavailable(f"namespace {self.name}'s ranks went before all {self.tp_size} were in (a rank's "
                          "session ended, or attaching their buffers failed); register again", reasons.NAMESPACE_BUSY)

    def leave(self, session: Session) -> bool:
        """Remove `session` (closing its buffers if the group never completed with them).
        Whether the group was complete until now (its buffers attached); False for a
        session that is not a member. A group left before it formed never forms."""
        if self.sessions.get(session.rank) is not session:
            return False
        was_complete = self.complete
        self.formed(None)
        del self.sessions[session.rank]
        del self.device_uuids[session.rank]
        device = self._waiting.pop(session.rank, None)
        if device is not None:
            device.close()
        return was_complete

    def partners(self, session: Session) -> list[Session]:
        """The group's other sessions (they end with `session`)."""
        if self.sessions.get(session.rank) is not session:
            return []
        return [s for s in self.sessions.values() if s is not session]

    def check_driver(self, session: Session, what: str) -> None:
        """FAILED_PRECONDITION for a call of a closing session, from another rank than
        the driver, and (naming the missing ranks) while the group is not complete. Not
        UNAVAILABLE: clients take that for a lost daemon and register again."""
        if session.closing:  # the group's sessions all begin closing when one does
            raise precondition(f"{what}: session {session.id[:8]} is closing with its engine's ranks",
                               reasons.SESSION_CLOSED, session=session.id)
        if session.rank != DRIVER:
            raise precondition(
                reason=reasons.NOT_DRIVER_RANK, message=f"{what}: namespace {self.name} is shared by {self.tp_size} tensor-parallel ranks and rank "
                f"{DRIVER}'s session makes its calls; this session is rank {session.rank}'s (it lends its buffers)")
        if not self.complete:
            missing = self.missing()
            raise precondition(reason=reasons.RANKS_MISSING, missing=",".join(map(str, missing)),
                               message=f"{what}: namespace {self.name} waits for rank{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(map(str, missing))} of {self.tp_size} to register (or re-register: "
                               "a group whose rank left ends whole)")

    def close(self) -> None:
        """Close buffers of ranks still waiting for the others. Idempotent."""
        for device in self._waiting.values():
            device.close()
        self._waiting.clear()


__all__ = ["DRIVER", "RankGroup"]
