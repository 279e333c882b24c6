"""Joining a Mooncake Store lazily, and the memory registered with it (for MooncakeStorage)."""

import logging
import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

from ..logs import log_event
from .errors import StorageUnavailable
from .mooncake_probe import probe_master

log = logging.getLogger("radixkv.storage")
RETRY_INTERVAL_S = 1.0  # after a failed setup(), the next call waits this long to retry


class Membership:
    """This node's membership of the store: `client()` joins on first use (on a call
    thread, via `submit`) and then returns the joined MooncakeDistributedStore; memory
    ranges attached before or after joining are registered with it. Thread-safe."""

    def __init__(self, name: str, master: str, timeout: float, setup_args: tuple, submit,
                 ranges: list[tuple[int, int]]):
        self.name, self.master, self.timeout, self.setup_args = name, master, timeout, setup_args
        self._submit = submit
        self._lock = threading.Lock()  # guards the state below
        self._store = None             # a MooncakeDistributedStore once setup() succeeded
        self._connecting = None        # the Future of a setup() in flight
        self._failed_at = 0.0
        self._ranges = list(ranges)
        self._registered: set[int] = set()  # addresses registered with _store
        self._left = False                   # leave() was called: a join finishing later closes its store
        self._told: str | None = None        # the join failure last logged at WARNING (None once joined)

    def attach(self, address: int, nbytes: int) -> None:
        with self._lock:
            if (address, nbytes) not in self._ranges:
                self._ranges.append((address, nbytes))
            store = self._store
        if store is not None:
            self._register(store)

    def detach(self, address: int, nbytes: int) -> None:
        """Forget a range (its memory is about to be freed) and unregister it from the
        joined store: registered memory stays pinned to the pages it had, so a new pool
        at the same address would otherwise be read through the old ones (RDMA)."""
        with self._lock:
            if (address, nbytes) in self._ranges:
                self._ranges.remove((address, nbytes))
            registered = address in self._registered
            self._registered.discard(address)
            store = self._store
        if registered and store is not None:
            code = store.unregister_buffer(address)
            if code != 0:
                log_event(log, "storage.unregister_failed", logging.WARNING, store=self.name, bytes=nbytes, code=code)

    def attached(self, start: int, nbytes: int) -> bool:
        return any(a <= start and start + nbytes <= a + n for a, n in self._ranges)

    def register_new(self, buf) -> bool:
        """Register a staging buffer; False while not joined or when the store refuses."""
        with self._lock:
            store = self._store
        if store is None:
            return False
        code = store.register_buffer(buf.ctypes.data, buf.nbytes)
        if code != 0:
            log_event(log, "storage.register_failed", logging.WARNING, store=self.name, bytes=buf.nbytes, code=code,
                      buffer="staging")
            return False
        with self._lock:
            self._registered.add(buf.ctypes.data)
        return True

    def leave(self):
        """The joined store, forgotten (for closing it), or None. Afterwards no call gets
        a store, and a join still in flight closes the store it makes."""
        with self._lock:
            store, self._store, self._left = self._store, None, True
        return store

    def unregister_all(self, store) -> None:
        """Unregister every buffer registered with `store` (before closing it: memory the
        store knows must not be freed while it could still use it). Best effort."""
        with self._lock:
            addresses, self._registered = sorted(self._registered), set()
        for a in addresses:
            code = store.unregister_buffer(a)
            if code != 0:
                log_event(log, "storage.unregister_failed", logging.WARNING, store=self.name, address=f"{a:#x}",
                          code=code)

    def client(self):
        """The joined store, or StorageUnavailable while joining is in progress or failed."""
        with self._lock:
            if self._store is not None:
                return self._store
            if self._connecting is None:
                if time.monotonic() - self._failed_at < RETRY_INTERVAL_S:
                    raise StorageUnavailable(self.name, "connect", detail="joining the store failed; retrying soon")
                self._connecting = self._submit(self._join)
            connecting = self._connecting
        try:
            connecting.result(self.timeout)
        except FutureTimeout:
            raise StorageUnavailable(self.name, "connect", detail=(
                f"the master did not answer within {self.timeout:g}s; still trying")) from None
        with self._lock:
            if self._store is None:
                raise StorageUnavailable(self.name, "connect", detail=f"cannot join the store at {self.master}")
            return self._store

    def _join(self) -> None:
        # setup() holds the GIL while it waits for the master (up to ~60 s, every thread
        # of the daemon frozen): call it only once the master answers an RPC.
        silent = probe_master(self.master, self.timeout)
        if silent is not None:
            self._failed(silent)
            return
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        # The store's INFO lines stay out of the daemon's log; MC_LOG_LEVEL=INFO in the
        # daemon's environment brings them back.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.store import MooncakeDistributedStore
        store = MooncakeDistributedStore()
        code = store.setup(*self.setup_args)
        if code != 0:
            self._failed(f"joining the store at {self.master} failed (setup answered {code})")
            return
        with self._lock:
            self._connecting = None
            left = self._left
            if not left:
                self._store = store
            self._told = None
        if left:  # closed while joining: nothing will use this store (no memory registered yet)
            store.close()
            return
        self._register(store)
        log_event(log, "storage.joined", store=self.name, lent_bytes=self.setup_args[2])

    def _failed(self, why: str) -> None:
        """A join failed: the next call (RETRY_INTERVAL_S later) tries again. Logged when
        the reason changes (once per outage, not once per retry)."""
        with self._lock:
            self._connecting = None
            self._failed_at = time.monotonic()
            told, self._told = self._told, why.split(" (")[0]
        level = logging.DEBUG if told == self._told else logging.WARNING
        log_event(log, "storage.master_unreachable", level, store=self.name, master=self.master, error=why,
                  note="the store is not joined: lookups find nothing in storage and stores fail; "
                  "joining is tried again with later calls")

    def _register(self, store) -> None:
        with self._lock:
            todo = [(a, n) for a, n in self._ranges if a not in self._registered]
            self._registered.update(a for a, _ in todo)
        for a, n in todo:
            code = store.register_buffer(a, n)
            if code != 0:
                log_event(log, "storage.register_failed", logging.WARNING, store=self.name, bytes=n, code=code)
                with self._lock:
                    self._registered.discard(a)


