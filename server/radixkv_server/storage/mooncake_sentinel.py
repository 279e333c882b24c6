"""Noticing that a Mooncake master came back empty (for MooncakeStorage).

A restarted master has lost every key, and nothing in the store client says so: it
re-mounts its segment and carries on. So each backend keeps one small object of its own
in the store, its sentinel (a key no other backend uses, hard-pinned so the store never
evicts it), and looks for it after a call succeeds: at most every `interval` seconds,
and on the first success after a failed call (a master that restarted failed the calls
made while it was down). A look runs on a thread of its own, so the call that asks for
it never waits for it (a master that freezes meanwhile costs that thread its timeout).
A sentinel that was there and is gone means the store lost what it held (the master
restarted, or the segment that held it left the pool); the backend is told (`lost`)
and a new sentinel is put. `remove()` at close leaves nothing behind; a process that
dies leaves one pinned object of a few bytes.
"""

import logging
import threading
import time
import uuid


log = logging.getLogger("radixkv.storage")
CHECK_INTERVAL_S = 5.0
PAYLOAD = b"radixkv sentinel"


class Sentinel:
    """One backend's sentinel. `run(operation, fn, *args)` makes a store call with the
    backend's deadline; `config()` is a ReplicateConfig to pin with; `lost(why)` is
    called (on the sentinel's thread) when the sentinel vanished. Thread-safe; a check
    never raises (a failed look only makes the next call look again)."""

    def __init__(self, prefix: str, run, config, lost, interval: float = CHECK_INTERVAL_S):
        self.key = f"{prefix}sentinel:{uuid.uuid4().hex}"
        self.interval = interval
        self._run, self._config, self._lost = run, config, lost
        self._lock = threading.Lock()  # call threads check concurrently; one checks at a time
        self._placed = False           # the store held it at the last look
        self._due = 0.0                # monotonic time of the next look

    def failed(self) -> None:
        """A store call failed: look again after the next one that succeeds."""
        self._due = 0.0

    def check(self, store) -> None:
        """Start a look for the sentinel if one is due and none runs (it puts the
        sentinel when absent, and reports a loss when it was there before). Returns at
        once."""
        now = time.monotonic()
        if now < self._due or not self._lock.acquire(blocking=False):
            return
        self._due = now + self.interval
        try:
            threading.Thread(target=self._looking, args=(store,), daemon=True,
                             name="radixkv-mooncake-sentinel").start()
        except RuntimeError:  # no thread to be had (the process is exiting): look another time
            self._due = 0.0
            self._lock.release()

    def _looking(self, store) -> None:
        try:
            self._look(store)
        except Exception as exc:  # StorageUnavailable, or a call cancelled at close: look again later
            self._due = 0.0
            log.debug("storage sentinel %s: %s", self.key, exc)
        finally:
            self._lock.release()

    def _look(self, store) -> None:
        code = self._run("sentinel", store.is_exist, self.key)
        if code == 1:
            self._placed = True
            return
        if code != 0:  # the store could not say
            self._due = 0.0
            return
        if self._placed:
            self._placed = False
            self._lost("the store no longer holds this daemon's sentinel key (the master restarted, "
                       "or the segment that held it left the pool)")
        config = self._config()
        config.with_hard_pin = True
        self._placed = self._run("sentinel", store.put, self.key, PAYLOAD, config) == 0
        if not self._placed:
            self._due = 0.0

    def remove(self, store) -> None:
        """Take the sentinel out of the store (absent: nothing happens): at close, on the
        closing thread (which bounds it), after every store call has returned."""
        self._placed = False
        code = store.remove(self.key, True)
        log.debug("storage sentinel %s: removing it answered %d", self.key, code)
