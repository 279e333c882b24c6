"""What the Mooncake Store's answers mean, for MooncakeStorage: the error codes it tells
apart (mooncake-store/include/types.h), the checks every batch answer passes before it
is read, and the log of segment owners that stopped answering."""

import logging
import threading
import time

from ..logs import log_event
from .errors import StorageUnavailable

log = logging.getLogger("radixkv.storage")

NO_SPACE = -200            # NO_AVAILABLE_HANDLE: the store is full
BUFFER_TOO_SMALL = -600    # the object is larger than the buffers given
NOT_FOUND = -704           # OBJECT_NOT_FOUND
TRANSFER_FAIL = -800       # the segment holding the object did not answer
RPC_FAIL = (-900, -901)    # the master did not answer
MIN_SEGMENT = 16 << 20     # the store refuses smaller segments and local buffers
OWNER_LOG_INTERVAL_S = 1.0  # at most one dead-owner line this often (reads of live and dead owners interleave)


def answered(store: str, operation: str, codes, keys: int) -> list:
    """`codes`, one batch call's answer, checked: StorageUnavailable unless it holds one
    result per key (answers are matched to keys by position: a short list would pair
    the next key's bytes with the wrong key) or when every result says the master did
    not answer. Pure."""
    if len(codes) != keys:
        raise StorageUnavailable(store, operation, detail=f"the store answered {len(codes)} results for {keys} keys")
    if codes and all(c in RPC_FAIL for c in codes):
        raise StorageUnavailable(store, operation, detail=f"the master did not answer (code {codes[0]})")
    return codes


class DeadOwners:
    """Reads of pages whose segment owner stopped answering (-800, until the master drops
    that owner after client_ttl): one WARNING per outage, at most one every
    OWNER_LOG_INTERVAL_S (reads of live owners' pages interleave with the dead one's until
    the master drops it, each ending the outage). An outage ends with a read that found
    pages and no -800. Thread-safe."""

    def __init__(self, store: str):
        self.store = store
        self._lock = threading.Lock()  # the call threads of one backend read concurrently
        self._outage = False
        self._told_at = -OWNER_LOG_INTERVAL_S  # time.monotonic() of the last line

    def read(self, codes: list[int], hits: int, head: bool) -> None:
        """Note one batch read's `codes` (`hits` of them found their page). Pages whose
        owner is gone are misses: one node of the pool failed, not the store, so lookups
        and reads of other nodes' pages go on (counting it against the tier's health
        would pause every lookup, live nodes' pages included). `head`: the batch starts
        the run being read (kept for callers; a miss there ends the run at once)."""
        gone = sum(1 for c in codes if c == TRANSFER_FAIL)
        now = time.monotonic()
        with self._lock:
            first = gone and not self._outage and now - self._told_at >= OWNER_LOG_INTERVAL_S
            if first:
                self._told_at = now
            if gone:
                self._outage = True
            elif hits:
                self._outage = False
        if first:
            log_event(log, "storage.segment_owner_lost", logging.WARNING, store=self.store, code=TRANSFER_FAIL,
                      note="pages whose segment owner stopped answering read as misses until the master drops "
                      "that owner (its client_ttl)")

