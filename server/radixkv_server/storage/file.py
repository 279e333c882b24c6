"""FileStorage: one file per page in a local (or shared) directory, the embedded default.

Layout: `<dir>/<h[0:2]>/<h[2:4]>/<h>.page`, where h is the key in lowercase hex; the
two fan-out levels keep directories small at hundreds of millions of pages. A file holds
one `record` (header + payload).

Writes are atomic: a page is written to `.<h>.page.<random>.tmp` in its final directory
and renamed into place, so a reader sees either no file or a whole one, and readers never
need a lock. A present page is not rewritten. Two writers racing on the same absent key
may both rename; the later rename wins with an equal page (keys are content addresses),
and no reader sees a mix. A writer that crashes mid-page leaves only its `.tmp` file,
which nothing reads; an operator may delete old ones
(`find <dir> -name '.*.tmp' -mmin +60 -delete`).

The top directory is created when the backend opens and never again: if it disappears
later (an unmounted volume, an operator's `rm -r`), every call raises StorageUnavailable
instead of quietly refilling the underlying filesystem; it works again once the
directory is back.
"""

import os
import secrets

from .base import Read, StorageBackend, StorageUnavailable
from .record import HEADER_BYTES

SUFFIX = ".page"


class FileStorage(StorageBackend):
    """Pages as files under `directory`. `fsync=True` flushes each page and its directory
    to disk before the page becomes visible (durable across power loss; slower).
    Without it a crash can lose recent pages, and a page damaged by one reads as a miss.
    Raises StorageUnavailable if the directory cannot be created."""

    faults = (OSError,)

    def __init__(self, directory: str | os.PathLike, *, fsync: bool = False):
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        super().__init__(f"file://{self.directory}")
        self.fsync = fsync
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(self.name, "open", exc) from exc
        if not os.path.isdir(self.directory):
            raise StorageUnavailable(self.name, "open", detail=f"{self.directory} is not a directory")

    def path_for(self, key: bytes) -> str:
        """The file that holds (or would hold) the page stored under `key`."""
        h = key.hex()
        return os.path.join(self.directory, h[0:2], h[2:4], h + SUFFIX)

    # -- primitives -------------------------------------------------------------------

    def _exists_prefix(self, keys: list[bytes]) -> int:
        for i, key in enumerate(keys):
            try:
                os.stat(self.path_for(key))
            except FileNotFoundError:
                self._require_directory("exists_prefix")
                return i
        return len(keys)

    def _get_blobs(self, keys: list[bytes]) -> list[bytes | None]:
        blobs = [self._read(self.path_for(key)) for key in keys]
        if any(blob is None for blob in blobs):
            self._require_directory("get")
        return blobs

    def _get_into(self, keys: list[bytes], pages: list) -> list[Read]:
        """Each file is read with one readv: its header into a small buffer, its payload
        straight into the page (no intermediate copy); then checked in place."""
        reads = []
        for key, page in zip(keys, pages):
            head = bytearray(HEADER_BYTES)
            got = self._read_into(self.path_for(key), head, page)
            if got is None:
                reads.append(Read.MISS)
            elif got is False:  # a file of another length: damaged, or another layout
                reads.append(self._place(key, self._read(self.path_for(key)) or b"", page))
            else:
                reads.append(self._verified(key, head, page))
        if Read.MISS in reads:
            self._require_directory("get")
        return reads

    @staticmethod
    def _read_into(path: str, head: bytearray, page) -> bool | None:
        """Fill head and page from the file; None if absent, False if its size is not
        exactly header + page (the caller then reads it whole to tell why)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            want = HEADER_BYTES + memoryview(page).nbytes
            if os.fstat(fd).st_size != want:
                return False
            return os.readv(fd, [head, page]) == want
        finally:
            os.close(fd)

    def _put_blobs(self, records: list[tuple[bytes, bytes]]) -> list[bool]:
        stored = []
        for key, blob in records:
            path = self.path_for(key)
            present = os.path.exists(path)
            if not present:
                self._write(path, blob)
            stored.append(not present)
        return stored

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

    @staticmethod
    def _read(path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _write(self, path: str, blob: bytes) -> None:
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask decides who else may read pages
        except FileNotFoundError:
            self._make_fanout(directory)
            fd = os.open(tmp, flags, 0o666)
        try:
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
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


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
