"""StorageHealth: whether the storage tier answers, per direction ("read", "write"), as
this daemon sees it. One backend serves every namespace, so an outage is the store's,
not a namespace's: it begins with the first failed call of a direction, whichever
namespace made it (`storage.unavailable`, naming that namespace), and ends with the
first call of that direction that succeeds, whichever namespace made it
(`storage.recovered`). Kept per namespace, a namespace whose store failed and that then
went quiet held `radixkv_storage_up` at 0, and its alert firing, long after the store
was mended. One exception: a read outage a fetch began ends only with a fetch, not with
a lookup (where the two disagree, a dead Mooncake segment owner whose pages the master
still lists, the signal would flap with every lookup).

A full store (`StorageFull`: a Mooncake pool at capacity, which evicts in the
background) still answers: its refusals are no outage, a busy fleet is in that state
much of the time, and telling each refused batch as an outage and the next stored one
as a recovery made the signal flap too fast for any alert (and 6 log lines a second).
They are counted (`full_refusals`) and said at most once a minute (`storage.store_full`).

Used on the daemon's event loop only.
"""

import logging
import time

from ..logs import log_event

log = logging.getLogger("radixkv.storage")

FULL_SAID_EVERY_S = 60.0
READ_NOTE = "lookups and prefetches find nothing in storage; each namespace tries again after a pause"
WRITE_NOTE = "stores fail: pages stay on host only; each new store tries again"


class StorageHealth:
    def __init__(self, store: str, clock=time.monotonic):
        self.store = store
        self.failing: dict[str, str] = {}  # direction -> the error that began its outage
        self._begun_by: dict[str, str] = {}  # direction -> "lookup" or "" (any other call)
        self.full_refusals = 0              # store calls a full store refused, since start
        self._clock = clock
        self._full_said_at: float | None = None
        self._full_unsaid = 0               # refusals since the last storage.store_full line

    @property
    def reads_answer(self) -> bool:
        """Lookups and fetches are not failing (what `radixkv_storage_up` says)."""
        return "read" not in self.failing

    def failed(self, direction: str, error: str, namespace: str, by: str = "") -> None:
        """A call of `direction` failed (`by` "lookup": a lookup): begins an outage
        unless one is on."""
        if direction in self.failing:
            return
        self.failing[direction], self._begun_by[direction] = error, by
        log_event(log, "storage.unavailable", logging.WARNING, namespace=namespace, direction=direction,
                  error=error, note=WRITE_NOTE if direction == "write" else READ_NOTE)

    def answered(self, direction: str, namespace: str, by: str = "") -> bool:
        """A call of `direction` succeeded (`by` "lookup": a lookup, which does not end
        an outage another kind of call began); True when that ended an outage."""
        if direction not in self.failing or (by == "lookup" and self._begun_by[direction] != "lookup"):
            return False
        del self.failing[direction], self._begun_by[direction]
        log_event(log, "storage.recovered", namespace=namespace, direction=direction)
        return True

    def full(self, error: str, namespace: str) -> None:
        """A store was refused for want of room: counted, said at most once a minute."""
        self.full_refusals += 1
        self._full_unsaid += 1
        now = self._clock()
        if self._full_said_at is not None and now - self._full_said_at < FULL_SAID_EVERY_S:
            return
        log_event(log, "storage.store_full", logging.WARNING if self._full_said_at is None else logging.INFO,
                  namespace=namespace, refused_stores=self._full_unsaid, error=error,
                  note=f"the store is full: those pages stay on host only (said at most every "
                       f"{FULL_SAID_EVERY_S:g}s; radixkv_store_failed_tokens_total counts them)")
        self._full_said_at, self._full_unsaid = now, 0


__all__ = ["StorageHealth"]
