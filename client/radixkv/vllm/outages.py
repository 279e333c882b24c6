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


class RegisteringAgain:
    """How `who` (a worker, the scheduler) logs its attempts at registering a lost
    session again, the same way for every session: a daemon that is away or slow
    (Unavailable, DeadlineExceeded) at debug, as the next attempt follows; a refusal
    (another model or layout holds the namespace now, a token revoked, a limit) as one
    warning per run of refusals (it does not pass by itself: every lookup or load is a
    miss until an operator acts; the attempts go on every few seconds, at debug), and
    an info line once registered. Not thread-safe: each session calls it from one place."""

    def __init__(self, log: logging.Logger, who: str):
        self._log = log
        self._refused = OutageLog(log, f"{who}: registering the session again was refused", f"{who}: registered again")
        self._who = who

    def failed(self, error: RadixKVError) -> None:
        if isinstance(error, (Unavailable, DeadlineExceeded)):
            self._log.debug("radixkv: %s: the session is not back yet: %s", self._who, error)
        else:
            self._refused.failed(error)

    def worked(self) -> None:
        self._refused.worked()


__all__ = ["OutageLog", "RegisteringAgain"]
