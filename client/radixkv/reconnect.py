"""When a client tries to get its session back: capped exponential backoff with jitter.

A session is lost when the daemon restarted (or closed it: the ack stream broke, the
engine was replaced). The client then re-registers with the arguments of its last
`register`, never more often than `Backoff` allows, and without blocking the engine
in between: a call made before the next attempt is due fails at once with
`Unavailable` (the engine treats it as a cache miss). The attempt that succeeds raises
`SessionLost` (or `DaemonRestarted`) so the engine drops its view of cached device
pages. No I/O here: both clients drive a `Recovery`.
"""

import random
from dataclasses import dataclass

from .errors import DaemonRestarted, SessionLost
from .types import Registration


@dataclass(frozen=True)
class Backoff:
    """Delay before reconnect attempt n (0-based): `min(maximum, initial * multiplier**n)`,
    scaled by a random factor in [1 - jitter, 1] so that engines restarted together do
    not knock on the daemon in step."""

    initial: float = 0.05
    maximum: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self):
        if self.initial < 0 or self.maximum < self.initial or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"bad backoff {self}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        base = min(self.maximum, self.initial * self.multiplier ** min(attempt, 64))
        return base * (1 - self.jitter * (rng or random).random())


class Recovery:
    """The lost-session state of one client: why, how many attempts, when the next is due."""

    def __init__(self, backoff: Backoff, rng: random.Random | None = None):
        self.backoff = backoff
        self._rng = rng or random.Random()
        self.reason: str | None = None  # None: the session is fine
        self.attempts = 0
        self.next_at = 0.0
        self.registering = False  # a call is registering the session again now

    @property
    def lost(self) -> bool:
        return self.reason is not None

    def lose(self, reason: str, now: float) -> None:
        """The session is gone; the first attempt is due at once."""
        if self.reason is None:
            self.reason = reason
            self.attempts = 0
            self.next_at = now

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def wait_time(self, now: float) -> float:
        return max(0.0, self.next_at - now)

    def failed(self, now: float) -> None:
        self.next_at = now + self.backoff.delay(self.attempts, self._rng)
        self.attempts += 1
        self.registering = False

    def recovered(self) -> None:
        self.reason = None
        self.attempts = 0
        self.registering = False


def lost_message(reg: Registration, new: Registration, reason: str) -> tuple[type[SessionLost], str]:
    """The exception class and message for a session replaced by `new`."""
    if new.daemon_instance != reg.daemon_instance:
        return DaemonRestarted, (f"the daemon restarted (instance {reg.daemon_instance} -> "
                                 f"{new.daemon_instance}; {reason}); registered again: drop every "
                                 "cached device page")
    return SessionLost, (f"session {reg.session[:8]} was lost ({reason}); registered again: drop every "
                         "cached device page")


__all__ = ["Backoff", "Recovery", "lost_message"]
