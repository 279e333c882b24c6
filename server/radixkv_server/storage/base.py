"""The L3 storage interface every backend implements (`open.open_storage` picks one by URL).

The daemon calls a backend from worker threads, never from its event loop: every method
blocks. One backend object may be used by several threads at once. Storage is a cache:
a fault raises `StorageUnavailable` (the daemon then serves from device and host only
and tries again later), a damaged record reads as a miss, and nothing here ever raises
a raw `OSError` or redis error.
"""

import enum
import logging
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from ..logs import log_event
from .errors import StorageUnavailable
from .health import StorageHealth
from .stats import StorageStats
from .record import CorruptPage, NotForThisReader, decode, decode_into, encode, verify

MAX_KEY_BYTES = 64
log = logging.getLogger("radixkv.storage")


class Read(enum.Enum):
    """What `get_into` found for one key."""
    HIT = "hit"          # the page holds the key's verified payload
    MISS = "miss"        # absent, or a sound record of another size
    DAMAGED = "damaged"  # a record failed its checks; it is removed


@dataclass(slots=True)
class ReadAhead:
    """What `StorageBackend.read_ahead` found: the run of `keys` storage holds, with
    their `records` where the backend read them already (else None: read on place).
    Records may be views of a buffer the backend lends: whoever holds a ReadAhead
    hands it to `place` or calls `close()` (idempotent), which gives that back."""

    keys: list[bytes]
    records: list | None = None
    release: Callable[[], None] | None = None

    @property
    def found(self) -> int:
        return len(self.keys)

    def close(self) -> None:
        release, self.release, self.records = self.release, None, None
        if release is not None:
            release()


class StorageBackend(ABC):
    """A key -> page store. Keys are 1..64 bytes (`keys.page_keys` makes 32-byte ones);
    payloads are opaque bytes, wrapped in a checksummed `record` inside the backend.

    Contract shared by every backend:
    - Keys are content addresses: a present key is never rewritten, so a reader sees
      either no page or a whole page, never a partial or mixed one.
    - Store faults raise `StorageUnavailable`; bad arguments raise ValueError or
      TypeError before the store is touched. After a fault the same object keeps
      working once the store is back (no reopen needed).
    - `close()` is idempotent; any call after it raises StorageUnavailable.
    - When the backend learns the store may have lost pages it acknowledged (a Redis
      restarted, a Mooncake master came back empty), `generation` goes up (metric
      `radixkv_storage_contents_lost_total`) and `on_lost` listeners are called (from
      that thread). Losses it cannot see (maxmemory, a failover) call nothing.
    Subclasses implement the `_`-prefixed primitives and set `faults`, the raw error
    types that mean "the store failed"; the base class wraps those, times and counts.
    """

    faults: tuple[type[BaseException], ...] = (OSError,)
    kind = ""  # which store: "file", "redis", "redis+cluster", "mooncake" (told to engines)

    def __init__(self, name: str):
        self.name = name  # for messages and logs; never holds credentials
        self.stats = StorageStats()
        self._stats_lock = threading.Lock()  # worker threads update stats concurrently
        self._closed = False
        self.generation = 0
        self._lost_listeners: list[Callable[[], None]] = []
        self._unexpected_seen: set[type] = set()  # error types outside `faults` logged once
        self.health = StorageHealth(name)  # as every namespace's calls found it (on the loop)

    def on_lost(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` (from any thread) whenever the store may have lost what it
        held; returns the function that stops it. Thread-safe."""
        with self._stats_lock:
            self._lost_listeners.append(listener)

        def stop() -> None:
            with self._stats_lock:
                if listener in self._lost_listeners:
                    self._lost_listeners.remove(listener)
        return stop

    def lost_contents(self, why: str) -> None:
        """The store may have lost what it held (`why` names the sign): `generation`
        goes up and every listener hears it. Thread-safe; for subclasses."""
        with self._stats_lock:
            self.generation += 1
            listeners = list(self._lost_listeners)
        for listener in listeners:
            listener()
        log_event(log, "storage.contents_lost", logging.WARNING, store=self.name, why=why,
                  note="pages recorded as stored are stored again when they leave the host")

    # -- public API ------------------------------------------------------------------

    def exists_prefix(self, keys: list[bytes]) -> int:
        """How many leading `keys` are present; stops probing at the first miss.

        A present but damaged record counts as present (get() then reports it). Reads only.
        """
        keys = _checked_keys(keys, "exists_prefix")
        return self._call("exists_prefix", self._exists_prefix, keys) if keys else 0

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        """The payload stored under each key, in order; None for a miss or a damaged
        record. A damaged record is counted in `stats.corrupt`, logged and removed
        (best effort) so a later put() can store the page again."""
        keys = _checked_keys(keys, "get")
        if not keys:
            return []
        blobs = self._call("get", self._get_blobs, keys)
        out: list[bytes | None] = []
        damaged = []
        misses = nbytes = 0
        for key, blob in zip(keys, blobs):
            payload = None
            if blob is None:
                misses += 1
            else:
                try:
                    payload = decode(key, blob)
                    nbytes += len(payload)
                except NotForThisReader:
                    misses += 1
                except CorruptPage as exc:
                    self._damaged(key, exc)
                    damaged.append(key)
            out.append(payload)
        self._count(gets=len(keys), misses=misses, corrupt=len(damaged), get_bytes=nbytes)
        if damaged:
            self._drop(damaged)
        return out

    def get_into(self, keys: list[bytes], pages: list) -> int:
        """Read the payloads of `keys` straight into `pages` (writable buffers, one per
        key, each one page long); returns how many LEADING pages now hold their key's
        verified payload. A miss, a damaged record, or a record of another size ends
        the run; pages past it hold unspecified bytes. Damaged records are counted,
        logged and removed as in get(). ValueError when the lists differ in length."""
        keys = _checked_keys(keys, "get_into")
        if len(pages) != len(keys):
            raise ValueError(f"get_into: {len(keys)} keys but {len(pages)} pages")
        if not keys:
            return 0
        return self._settle_reads(keys, pages, self._call("get", self._get_into, keys, pages))

    def read_ahead(self, keys: list[bytes], page_bytes: int) -> "ReadAhead":
        """The leading run of `keys` the store holds, for a fetch into pages of
        `page_bytes` not reserved yet. A backend that can read the run in the one round
        trip a probe would take (Redis; Mooncake through a staging buffer) reads it now
        and holds the records; the others probe (`exists_prefix`) and read on `place`.
        Reads only. Hand the result to `place` or close it."""
        keys = _checked_keys(keys, "read_ahead")
        if not keys:
            return ReadAhead([])
        got = self._call("get", self._read_ahead, keys, page_bytes)
        if got is None:
            found = self._call("exists_prefix", self._exists_prefix, keys)
            return ReadAhead(keys[:found])
        records, release = got
        found = next((i for i, r in enumerate(records) if r is None), len(records))
        ahead = ReadAhead(keys[:found], records[:found], release)
        if not found:
            ahead.close()
        return ahead

    def place(self, ahead: "ReadAhead", pages: list) -> int:
        """Put the first len(pages) pages of `ahead`'s run into `pages`, then close it;
        returns how many leading pages hold their key's verified payload, as get_into
        (which it is, for a run read on place). ValueError for more pages than the run."""
        try:
            if len(pages) > ahead.found:
                raise ValueError(f"place: {len(pages)} pages for a run of {ahead.found}")
            keys = ahead.keys[:len(pages)]
            if ahead.records is None:
                return self.get_into(keys, pages)
            reads = []
            for key, record, page in zip(keys, ahead.records, pages):
                reads.append(self._place(key, record, page))
                if reads[-1] is not Read.HIT:
                    break
            return self._settle_reads(keys, pages, reads + [Read.MISS] * (len(keys) - len(reads)))
        finally:
            ahead.close()

    def _settle_reads(self, keys: list[bytes], pages: list, reads: list["Read"]) -> int:
        """Count and log what a read found, drop damaged records; the leading HIT run."""
        damaged = [k for k, r in zip(keys, reads) if r is Read.DAMAGED]
        leading = next((i for i, r in enumerate(reads) if r is not Read.HIT), len(reads))
        hits = sum(1 for r in reads if r is Read.HIT)
        self._count(gets=len(keys), misses=len(keys) - hits - len(damaged), corrupt=len(damaged),
                    get_bytes=sum(memoryview(p).nbytes for p, r in zip(pages, reads) if r is Read.HIT))
        if damaged:
            self._drop(damaged)
        return leading

    def attach_memory(self, address: int, nbytes: int) -> None:
        """Pages given to get_into() and put() will come from this memory (a host pool):
        a backend that moves bytes without copies may register it with its store. A
        no-op by default; attaching a range again is harmless."""

    def detach_memory(self, address: int, nbytes: int) -> None:
        """The memory `attach_memory` named is about to be freed (its pool closes, no
        call using it in flight): a backend that registered it unregisters it, so a
        later pool at the same address is registered afresh. A no-op by default."""

    def put(self, items: list[tuple[bytes, bytes]]) -> int:
        """Store (key, payload) pairs whose key is absent; returns how many were stored.

        A present key is left as it is (counted in `stats.put_skipped`). Pages of one call
        are not stored atomically together: after a fault some may be stored, none partially.
        """
        items = _checked_items(items)
        if not items:
            return 0
        stored = self._call("put", self._put_pages, items)
        new = sum(1 for s in stored if s)
        nbytes = sum(memoryview(payload).nbytes for (_, payload), s in zip(items, stored) if s)
        self._count(puts=new, put_bytes=nbytes, put_skipped=len(items) - new)
        return new

    def check(self) -> None:
        """Probe the store (reachable, writable where that can be told cheaply);
        returns None or raises StorageUnavailable. For start-up logs and health checks."""
        self._call("check", self._check)

    def close(self) -> None:
        """Release connections and handles. Idempotent; later calls raise StorageUnavailable."""
        if not self._closed:
            self._closed = True
            self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- for subclasses ---------------------------------------------------------------

    @abstractmethod
    def _exists_prefix(self, keys: list[bytes]) -> int:
        """Number of leading keys present (keys is non-empty)."""

    @abstractmethod
    def _get_blobs(self, keys: list[bytes]) -> list[bytes | None]:
        """The stored records (undecoded), None where absent."""

    @abstractmethod
    def _put_blobs(self, records: list[tuple[bytes, bytes]]) -> list[bool]:
        """Store each record unless its key is present; True where this call stored it."""

    def _put_pages(self, items: list[tuple[bytes, bytes]]) -> list[bool]:
        """Store each (key, payload) unless its key is present; True where this call
        stored it. The default wraps each payload in a record (one copy) for _put_blobs."""
        return self._put_blobs([(key, encode(key, payload)) for key, payload in items])

    def _get_into(self, keys: list[bytes], pages: list) -> list[Read]:
        """What each key held, its payload written into its page where it is a HIT. The
        default reads whole records with _get_blobs and copies each payload once."""
        return [Read.MISS if blob is None else self._place(key, blob, page)
                for key, blob, page in zip(keys, self._get_blobs(keys), pages)]

    def _read_ahead(self, keys: list[bytes], page_bytes: int) -> tuple[list, Callable[[], None] | None] | None:
        """(records of `keys`, None where absent; what gives back the memory they lend
        or None) when reading them costs what a probe costs; None (the default, or
        when it does not pay now): probe, and read on place."""
        return None

    def _place(self, key: bytes, blob, page) -> Read:
        """Check the record `blob` and copy its payload into `page`."""
        return self._checked(key, decode_into, key, blob, page)

    def _verified(self, key: bytes, head, page) -> Read:
        """Check a payload read in place into `page` against its record header `head`."""
        return self._checked(key, verify, key, head, page)

    def _checked(self, key: bytes, check, *args) -> Read:
        """HIT when `check(*args)` passes; a record not for this reader (another size or
        format version) reads as a MISS, a damaged record as DAMAGED (logged once, dropped)."""
        try:
            check(*args)
            return Read.HIT
        except NotForThisReader:
            return Read.MISS
        except CorruptPage as exc:
            self._damaged(key, exc)
            return Read.DAMAGED

    def _damaged(self, key: bytes, why: CorruptPage) -> None:
        log_event(log, "storage.page_damaged", logging.WARNING, store=self.name, key=key.hex(), error=why,
                  note="dropped: a miss, stored again by the next store of that page")

    @abstractmethod
    def _discard(self, keys: list[bytes]) -> None:
        """Remove the records of damaged pages; absent keys are not an error."""

    @abstractmethod
    def _check(self) -> None:
        """Raise one of `faults` (or StorageUnavailable) unless the store answers."""

    def _close(self) -> None:
        """Release resources; called once."""

    # -- internals --------------------------------------------------------------------

    def _call(self, operation: str, fn, *args):
        start = time.perf_counter()
        try:
            if self._closed:
                raise StorageUnavailable(self.name, operation, detail="the backend is closed")
            return fn(*args)
        except StorageUnavailable:
            self._count(errors=1)
            raise
        except self.faults as exc:
            self._count(errors=1)
            raise StorageUnavailable(self.name, operation, exc) from exc
        except Exception as exc:  # a client library's or backend's bug: the store failed all the same
            self._count(errors=1)
            self._unexpected(operation, exc)
            raise StorageUnavailable(self.name, operation, exc) from exc
        finally:
            self._count(seconds=time.perf_counter() - start)

    def _unexpected(self, operation: str, exc: Exception) -> None:
        """An error none of `faults` names: logged with its traceback the first time each
        type is seen (an engine's every Match would repeat it), then only counted. Engine
        calls see the store as unavailable, not an INTERNAL error of their own."""
        with self._stats_lock:
            first = type(exc) not in self._unexpected_seen
            self._unexpected_seen.add(type(exc))
        if first:
            log_event(log, "storage.unexpected_error", logging.ERROR, store=self.name, operation=operation,
                      error=f"{type(exc).__name__}: {exc}", traceback="".join(traceback.format_exception(exc)),
                      note="read as the store being unavailable; later errors of this type are not logged")

    def _drop(self, keys: list[bytes]) -> None:
        try:
            self._call("discard", self._discard, keys)
        except StorageUnavailable as exc:  # the get() result stands; the next get retries
            log_event(log, "storage.discard_failed", logging.WARNING, store=self.name, error=exc)

    def _count(self, **deltas) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)


def _checked_keys(keys, operation: str) -> list[bytes]:
    keys = list(keys)
    for key in keys:
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"{operation}: a key must be 1..{MAX_KEY_BYTES} bytes, got {key!r:.80}")
    return keys


def _checked_items(items) -> list[tuple[bytes, bytes]]:
    items = list(items)
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"put: each item must be a (key, payload) tuple, got {item!r:.80}")
        _checked_keys([item[0]], "put")
        if not isinstance(item[1], (bytes, bytearray, memoryview)):
            raise TypeError(f"put: payload must be bytes-like, got {type(item[1]).__name__}")
    return items
