"""FileStorage: one file per page in a local (or shared) directory, the embedded default.

Layout: `<dir>/<h[0:2]>/<h[2:4]>/<h>.v2.page`, where h is the key in lowercase hex and
v2 the record format (record.py; version 1's files are `<h>.page`, left to `max_bytes`
or the operator); the two fan-out levels keep directories small at hundreds of millions
of pages. A file holds one `record` (header + payload).

Writes are atomic: a page is written to `.<h>.v2.page.<random>.tmp` in its final directory
and renamed into place, so a reader sees either no file or a whole one, and readers never
need a lock. A present page is not rewritten. Two writers racing on the same absent key
may both rename; the later rename wins with an equal page (keys are content addresses),
and no reader sees a mix. A writer that crashes mid-page leaves only its `.tmp` file,
which nothing reads; an operator may delete old ones
(`find <dir> -name '.*.tmp' -mmin +60 -delete`).

With `max_bytes` the directory is kept near that size, the pages used least recently
removed first (file_budget.py); without, it grows until the disk is full. A page the
full disk refuses (ENOSPC, EDQUOT) makes room: the oldest pages of its shard go (a
tenth of it) and it is written again (again while other writers take the room, a few
times at most); only when its shard holds none of our pages does the store fail (reads
go on).

The top directory is created when the backend opens and never again: if it disappears
later (an unmounted volume, an operator's `rm -r`), every call raises StorageUnavailable
instead of quietly refilling the underlying filesystem; it works again once the
directory is back.

A page file that cannot be read while its directory can (another owner's file without
read permission, a directory where the page belongs) is that page's miss, logged once per
path: the run before it is served.
"""

import errno
import itertools
import logging
import os
import secrets
import stat
import threading
import time

from ..logs import log_event
from .base import Read, StorageBackend
from .errors import StorageUnavailable
from .file_budget import DiskBudget, relieve_full_disk
from .record import HEADER_BYTES, NAME_TAG, header

SUFFIX = ".page"
# Errors of one page file, not of the directory or the disk: that page is a miss.
_PAGE_ERRORS = frozenset({errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP})
_LOGGED_PATHS = 1024  # unreadable page files remembered (the probe skips them) and logged once each, at most
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
DISK_FULL_LOG_EVERY_S = 60.0
MAKE_ROOM_TRIES = 8  # reliefs one page's write may make on a full disk

log = logging.getLogger("radixkv.storage")


class FileStorage(StorageBackend):
    """Pages as files under `directory`. `fsync=True` flushes each page and its directory
    to disk before the page becomes visible (durable across power loss; slower).
    Without it a crash can lose recent pages, and a page damaged by one reads as a miss.
    `max_bytes` bounds the directory (DiskBudget; None: no bound). Raises
    StorageUnavailable if the directory cannot be created, ValueError for a bad bound."""

    faults = (OSError,)
    kind = "file"

    def __init__(self, directory: str | os.PathLike, *, fsync: bool = False, max_bytes: int | None = None):
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        super().__init__(f"file://{self.directory}")
        self.fsync = fsync
        self.budget = DiskBudget(self.directory, max_bytes, SUFFIX) if max_bytes is not None else None
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(self.name, "open", exc) from exc
        if not os.path.isdir(self.directory):
            raise StorageUnavailable(self.name, "open", detail=f"{self.directory} is not a directory")
        if self.budget is not None:
            self.budget.check_room()
        # Temporary names: unique per process without a random draw per page; O_EXCL
        # still refuses a clash (another host sharing the directory).
        self._tmp_tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._tmp_count = itertools.count()
        self._unreadable_paths: set[str] = set()
        self._full_lock = threading.Lock()  # one storage thread makes room on a full disk at a time
        self._full_said = -DISK_FULL_LOG_EVERY_S  # when the last disk-full line was logged
        self._full_removed = 0  # pages removed for a full disk since that line

    def path_for(self, key: bytes) -> str:
        """The file that holds (or would hold) the page stored under `key`."""
        h = key.hex()
        return f"{self.directory}/{h[0:2]}/{h[2:4]}/{h}.{NAME_TAG}{SUFFIX}"  # os.path.join, without its cost per page

    # -- primitives -------------------------------------------------------------------

    def _exists_prefix(self, keys: list[bytes]) -> int:
        for i, key in enumerate(keys):
            try:
                path = self.path_for(key)
                directory = stat.S_ISDIR(os.stat(path).st_mode)
            except FileNotFoundError:
                self._require_directory("exists_prefix")
                return i
            if directory or (path in self._unreadable_paths and not self._readable_again(path)):
                return i  # not a page, or one `_unreadable` met
        return len(keys)

    def _get_blobs(self, keys: list[bytes]) -> list[bytes | None]:
        blobs = [self._read(self.path_for(key)) for key in keys]
        if any(blob is None for blob in blobs):
            self._require_directory("get")
        return blobs

    def _get_into(self, keys: list[bytes], pages: list) -> list[Read]:
        """Each file is read with one readv: its header into a small buffer, its payload
        straight into the page (no intermediate copy); then checked in place. A run
        ends at the first page that is not a hit (the caller uses the leading run)."""
        reads = []
        head, spare = bytearray(HEADER_BYTES), bytearray(1)
        for key, page in zip(keys, pages):
            path = self.path_for(key)
            got = self._read_into(path, head, page, spare)
            if got is None:
                read = Read.MISS
            elif got is False:  # a file of another length: damaged, or another layout
                read = self._place(key, self._read(path) or b"", page)
            else:
                read = self._verified(key, head, page)
            reads.append(read)
            if read is not Read.HIT:
                break
        if Read.MISS in reads:
            self._require_directory("get")
        return reads + [Read.MISS] * (len(keys) - len(reads))

    def _read_into(self, path: str, head: bytearray, page, spare: bytearray) -> bool | None:
        """Fill head and page from the file; None if absent (or unreadable, `_unreadable`),
        False if its size is not exactly header + page (the caller then reads it whole to
        tell why). One readv also asks for a byte past the page: a longer file fills it."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._unreadable(path, exc)
        try:
            return os.readv(fd, [head, page, spare]) == HEADER_BYTES + memoryview(page).nbytes
        except OSError as exc:
            return self._unreadable(path, exc)
        finally:
            os.close(fd)

    def _readable_again(self, path: str) -> bool:
        """Whether a page file `_unreadable` met can be read now (its mode fixed)."""
        if os.access(path, os.R_OK):
            self._unreadable_paths.discard(path)
            return True
        return False

    def _unreadable(self, path: str, why) -> None:
        """A page file this process cannot read: a miss, logged once per path. Errors
        that are not about the one file (EIO, a lost mount) are the tier's: raised."""
        if isinstance(why, OSError) and why.errno not in _PAGE_ERRORS:
            raise why
        if path not in self._unreadable_paths and len(self._unreadable_paths) < _LOGGED_PATHS:
            self._unreadable_paths.add(path)
            log_event(log, "storage.page_unreadable", logging.WARNING, store=self.name, path=path, error=why,
                      note="a miss there, and for every page after it in a prefix; remove it to let it be written "
                      "again")
        return None

    def _put_pages(self, items: list[tuple[bytes, bytes]]) -> list[bool]:
        """Each page is written with one writev of its record header and the page itself
        (no record copy)."""
        return self._put_blobs([(key, (header(key, payload), payload)) for key, payload in items])

    def _put_blobs(self, records: list[tuple[bytes, bytes | tuple]]) -> list[bool]:
        stored = []
        for key, blob in records:
            path = self.path_for(key)
            present = os.path.exists(path)
            if not present:
                parts = blob if isinstance(blob, tuple) else (blob,)
                self._write_making_room(path, parts)
                if self.budget is not None:
                    self._count(evicted=self.budget.wrote(path, sum(memoryview(p).nbytes for p in parts)))
            stored.append(not present)
        return stored

    def _write_making_room(self, path: str, parts: tuple) -> None:
        """`_write`, making room on a full disk (`_make_room`) and trying again while that
        removes pages: other storage threads (other daemons) may fill what one relief
        freed before this write gets it. At most MAKE_ROOM_TRIES reliefs; then, or when
        nothing of ours is left to remove, the disk's error is the store's."""
        for tries in itertools.count(1):
            try:
                self._write(path, parts)
                return
            except OSError as exc:
                if exc.errno not in _DISK_FULL or tries > MAKE_ROOM_TRIES or not self._make_room(path):
                    raise

    def _make_room(self, path: str) -> bool:
        """The disk is full (ENOSPC, or the user's quota): remove the pages used least
        recently in `path`'s shard (`relieve_full_disk`), as a bound would have; whether
        any went. Said at most once a minute (`storage.disk_full`), with the pages removed
        since; counted as evicted pages."""
        with self._full_lock:
            removed = relieve_full_disk(self.directory, path, SUFFIX)
            self._full_removed += removed
            now = time.monotonic()
            if now - self._full_said >= DISK_FULL_LOG_EVERY_S:
                self._full_said, said, self._full_removed = now, self._full_removed, 0
                log_event(log, "storage.disk_full", logging.WARNING, store=self.name, removed_pages=said,
                          note="pages used least recently removed to make room" + (
                              "" if removed else "; none of ours left where this page goes: its store fails") +
                          "; give the directory a max_size below the disk's free space to keep room")
        self._count(evicted=removed)
        return removed > 0

    def _discard(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                os.unlink(self.path_for(key))
            except FileNotFoundError:
                pass

    def _check(self) -> None:
        self._require_directory("check")
        probe = os.path.join(self.directory, f".probe.{secrets.token_hex(8)}.tmp")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.unlink(probe)

    # -- helpers ----------------------------------------------------------------------

    def _read(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._unreadable(path, exc)

    def _write(self, path: str, parts: tuple) -> None:
        """Write the concatenation of `parts` to `path`, atomically (a temporary file
        renamed into place)."""
        directory, name = os.path.split(path)
        tmp = f"{directory}/.{name}.{self._tmp_tag}-{next(self._tmp_count)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask decides who else may read pages
        except FileNotFoundError:
            self._make_fanout(directory)
            fd = os.open(tmp, flags, 0o666)
        try:
            try:
                _write_all(fd, [memoryview(p).cast("B") for p in parts])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self.fsync:
            _fsync_directory(directory)

    def _make_fanout(self, directory: str) -> None:
        """Create the two fan-out levels below the top directory, never the top itself."""
        self._require_directory("put")
        level1 = os.path.dirname(directory)
        for path in (level1, directory):
            try:
                os.mkdir(path)
            except FileExistsError:
                pass

    def _require_directory(self, operation: str) -> None:
        if not os.path.isdir(self.directory):
            raise StorageUnavailable(
                self.name, operation, detail=f"directory {self.directory} is missing or not a directory")


def _write_all(fd: int, views: list[memoryview]) -> None:
    """writev until every byte of `views` is written (a short write resumes where it stopped)."""
    while views:
        done = os.writev(fd, views)
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
