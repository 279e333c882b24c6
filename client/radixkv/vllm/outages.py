"""How the connector logs a run of failures of one kind (lookups, saves): one warning at
the first failure of a run, debug lines for the rest, one info line when it works again.

An engine against a daemon that is away fails every lookup and save for as long as that
lasts; a line per request would bury the one that says what happened.
"""

import logging

from radixkv.errors import DeadlineExceeded, RadixKVError, Unavailable


class OutageLog:
    """A run of failures of `what` (for example "lookups fail and are treated as misses"),
    logged on `log` with the prefix "radixkv: ". Not thread-safe: each user calls it from
    one thread (or under its own lock)."""

    def __init__(self, log: logging.Logger, what: str, again: str):
        self._log = log
        self._what = what
        self._again = again  # logged when it works again, e.g. "lookups answered again"
        self.failures = 0  # failures since it last worked

    def failed(self, detail) -> None:
        """One failure, `detail` saying what (an error, a count)."""
        self.failures += 1
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        self._log.log(level, "radixkv: %s: %s", self._what, detail)

    def worked(self) -> None:
        """It worked: after failures, an info line with how many there were."""
        if self.failures:
            self._log.info("radixkv: %s (%d failed before)", self._again, self.failures)
            self.failures = 0


def registering_again_failed(log: logging.Logger, who: str, error: RadixKVError) -> None:
    """Log one failed attempt of `who` (a worker, the scheduler) at registering its lost
    session again, the same way for every session: a daemon that is away or slow
    (Unavailable, DeadlineExceeded) at debug, as the next attempt follows; a refusal
    (another model or layout holds the namespace now, a token revoked, a limit) as a
    warning, since it does not pass by itself and every lookup or load is a miss until
    an operator acts."""
    if isinstance(error, (Unavailable, DeadlineExceeded)):
        log.debug("radixkv: %s: the session is not back yet: %s", who, error)
    else:
        log.warning("radixkv: %s: registering the session again was refused: %s", who, error)


__all__ = ["OutageLog", "registering_again_failed"]
