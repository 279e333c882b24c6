"""The storage tier checked at start, on a thread of its own: a store that does not answer
(a wrong address, a server not up yet, a password refused) is logged at once, not at the
first store, which may be the shutdown's; a first check that succeeds logs
`storage.checked`. Until a check succeeds it is checked again every
`--storage-check-interval` seconds (10), and `radixkv_storage_up` reads 0 (the daemon serves meanwhile: lookups
find nothing in storage, stores fail and are retried as they come).
"""

import asyncio
import functools
import logging
import threading
import time

from .logs import log_event

log = logging.getLogger("radixkv.storage")


def check_storage(storage, daemon, loop: asyncio.AbstractEventLoop, interval: float) -> None:
    """Start checking `storage` (StorageBackend.check) in a daemon thread: a check lasts
    as long as the store's own timeouts allow, a hung store's forever, and the daemon
    never waits for it. Sets `daemon.storage_answered` on the loop: False after a failed
    check, True once one succeeded; checks again every `interval` seconds until then."""

    def report(answered: bool, error: str = "", first: bool = False) -> None:
        daemon.storage_answered = answered
        if answered:
            log_event(log, "storage.checked" if first else "storage.recovered", store=storage.name,
                      direction="check")
        else:
            log_event(log, "storage.unavailable", logging.WARNING, store=storage.name, direction="check",
                      error=error, note=f"checked at start: lookups find nothing in storage and stores fail "
                      f"until it answers; checked again every {interval:g}s (--storage-check-interval)")

    def run() -> None:
        failed = False
        while True:
            try:
                storage.check()
            except Exception as e:  # StorageUnavailable, or whatever a closed backend raises
                if not failed and not _tell(loop, report, False, str(e)):
                    return
                failed = True
                time.sleep(interval)
                if not daemon.accepting:  # shutting down
                    return
                continue
            _tell(loop, functools.partial(report, True, first=not failed))
            return

    threading.Thread(target=run, name="radixkv-storage-check", daemon=True).start()


def _tell(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Run `fn(*args)` on the loop; False once the loop closed (the daemon stopped)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


__all__ = ["check_storage"]
