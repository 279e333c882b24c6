"""DiskBudget: keeps a page directory (FileStorage) under a size, removing the pages
used least recently.

The directory's first fan-out level splits it into 256 shards (`<dir>/<h[0:2]>/`); keys
are hashes, so pages spread evenly over them, and each shard is kept under 1/256 of the
budget on its own. A shard's size is counted as pages are written; once this process
has written a tenth of the shard's share since it last looked, the shard is measured
on disk again (so pages other daemons wrote into a shared directory count too), and if
it is over its share its oldest pages are removed until it is at 90% of it. Work per
look is one scan of one shard (a 256th of the directory), paid by the write that
crosses the mark, on a storage thread.

A page's age is the later of its last read and its write (atime and mtime): with the
`relatime` mount option, Linux's default, a read updates atime when it is the first
read since the page was written or a day has passed, so a page read since written, or
read today, counts as used. On `noatime` mounts the order is first-written,
first-removed. A scan also removes temporary files more than an hour old (left by a
writer that crashed mid-page).

A page counts as the disk space its file takes (its blocks, not its length: the record's
20-byte header takes a page of a power-of-two size one block past it), temporary files
too; the fan-out directories are not counted (256 x 256 of them at most, made as pages
land and never removed: up to ~260 MiB on ext4's 4 KiB directory blocks).

Between looks a shard may pass its share by a tenth (plus the page that crosses the
mark), and by another tenth for each other daemon writing into a shared directory.
Removing a page never disturbs a reader: one that has the file open reads it whole, one
that opens it after finds no file (a miss, the run ends there). A share should hold
many pages: with pages larger than a quarter of it, a warning says so once.
"""

import logging
import os
import threading
import time

from ..logs import log_event

log = logging.getLogger("radixkv.storage")

SHARDS = 256  # the first fan-out level: two hex digits
LOOK_EVERY = 0.1  # of a shard's share written by this process: measure the shard again
KEEP = 0.9  # of a shard's share left after removing pages
TMP_MAX_AGE_S = 3600.0
MIN_BYTES = SHARDS * 64 * 1024  # 16 MiB: a shard's share holds at least one 64 KiB page


class DiskBudget:
    """`max_bytes` for the page files under `directory` (names ending in `suffix`)."""

    def __init__(self, directory: str, max_bytes: int, suffix: str):
        if not isinstance(max_bytes, int) or max_bytes < MIN_BYTES:
            raise ValueError(f"max_size must be at least {MIN_BYTES >> 20}MiB, got {max_bytes!r}")
        self.directory = directory
        self.max_bytes = max_bytes
        self.share = max_bytes // SHARDS
        self._suffix = suffix
        self._written = [self.share] * SHARDS  # bytes written since the last look: look at first write
        self._locks = [threading.Lock() for _ in range(SHARDS)]
        self._warned = False

    def check_room(self) -> None:
        """Warn when the file system holding the directory is smaller than the bound:
        the disk then fills before the bound is reached, and each page it refuses then
        removes the oldest of its shard (`relieve_full_disk`), as full as the disk gets.
        Once, at open; a bound above the space free today is the operator's plan and is
        not warned about."""
        fs = os.statvfs(self.directory)
        size = fs.f_blocks * fs.f_frsize
        if self.max_bytes > size:
            log_event(log, "storage.max_size_past_disk", logging.WARNING, directory=self.directory,
                      max_size=self.max_bytes, disk_size=size,
                      note="the disk fills before max_size (then each page it refuses removes old ones); give it "
                      "a max_size below the disk's size (the fan-out directories take up to ~260 MiB more)")

    def wrote(self, path: str, nbytes: int) -> int:
        """A page file of `nbytes` was written at `path` (under the directory's shard
        level); measure and trim its shard when this process has written enough there.
        Returns the pages removed."""
        shard = int(path[len(self.directory) + 1:len(self.directory) + 3], 16)
        if nbytes * 4 > self.share and not self._warned:
            self._warned = True
            log_event(log, "storage.max_size_small", logging.WARNING, directory=self.directory, max_size=self.max_bytes,
                      shard_bytes=self.share, page_bytes=nbytes, suggested=SHARDS * 64 * nbytes,
                      note=f"each of the {SHARDS} shards holds under 4 pages: pages are removed soon after they "
                      "are written; give it at least the suggested size")
        with self._locks[shard]:
            self._written[shard] += nbytes
            if self._written[shard] < self.share * LOOK_EVERY:
                return 0
            self._written[shard] = 0
            try:
                return self._trim(shard)
            except OSError as e:  # the page itself was stored: say why the bound slips, go on
                log_event(log, "storage.trim_failed", logging.WARNING, directory=self.directory, shard=f"{shard:02x}",
                          shard_bytes=self.share, error=e)
                return 0

    def _trim(self, shard: int) -> int:
        pages, total = scan_shard(f"{self.directory}/{shard:02x}", self._suffix)
        if total <= self.share:
            return 0
        removed = remove_oldest(pages, total, self.share * KEEP)
        log.debug("storage %s: shard %02x over its %d bytes: removed %d pages", self.directory, shard,
                  self.share, removed)
        return removed


def relieve_full_disk(directory: str, path: str, suffix: str) -> int:
    """The disk under `directory` is full (a page for `path` could not be written): remove
    the pages used least recently in `path`'s shard until it holds 90% of what it held,
    at least one page. Pages are spread evenly over the shards by their hash, so one
    shard's oldest stand for the directory's; a tenth of one 256th of the directory is
    room for many pages. Returns the pages removed (0: the shard holds none, so what
    fills the disk is not this directory's; nothing to give back)."""
    shard_dir = path[:len(directory) + 3]
    pages, total = scan_shard(shard_dir, suffix)
    if not pages:
        return 0
    return remove_oldest(pages, total, total * KEEP)


def remove_oldest(pages: list[tuple[float, int, str]], total: int, goal: float) -> int:
    """Remove pages, the oldest first, until `total` (their bytes and others') is at most
    `goal`, at least one; returns how many."""
    pages.sort()  # oldest first
    removed = 0
    for _, size, path in pages:
        if removed and total <= goal:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:  # another daemon removed it first
            pass
        total -= size
        removed += 1
    return removed


def scan_shard(shard_dir: str, suffix: str) -> tuple[list[tuple[float, int, str]], int]:
    """(age, size, path) of every page in the shard, and their total size; removes
    stale temporary files on the way."""
    pages, total = [], 0
    now = time.time()
    try:
        subdirs = [e.path for e in os.scandir(shard_dir) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return pages, total
    for sub in subdirs:
        try:
            entries = list(os.scandir(sub))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            # The disk it takes, not its length (see the module's text); some FUSE
            # filesystems report no blocks: then at least its length.
            used = max(st.st_blocks * 512, st.st_size)
            if entry.name.endswith(suffix):
                pages.append((max(st.st_atime, st.st_mtime), used, entry.path))
                total += used
            elif entry.name.endswith(".tmp") and now - st.st_mtime > TMP_MAX_AGE_S:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
            elif entry.name.endswith(".tmp"):
                total += used  # a page being written (or a young one a crash left)
    return pages, total
