"""A page directory whose disk fills (no `max_size`, or one past the free space) makes
room instead of failing every store from then on: real files on a real 32 MiB tmpfs.

Before, the first ENOSPC failed that store and every later one, the tier's write outage
lasted until an operator removed pages by hand, and the newest KV was the KV lost."""

import hashlib
import logging
import os
import subprocess
import threading

import pytest

from radixkv_server.storage import FileStorage, StorageUnavailable

DISK = 32 << 20
PAGE = 1 << 10  # a 4 KiB block on the disk with its record header: ~8k pages (32 a shard) fill it
BLOCK = 4 << 10


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs mounted for the test (root only: skipped where mounts are refused)."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mountpoint)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def keys(n: int) -> list[bytes]:
    return [hashlib.sha256(b"page%d" % i).digest() for i in range(n)]


def payload(key: bytes) -> bytes:
    return key * (PAGE // len(key))


def test_a_full_disk_gives_up_its_oldest_pages_and_every_store_lands(small_disk, caplog):
    backend = FileStorage(small_disk / "pages")
    ks = keys(2 * DISK // BLOCK)  # twice what the disk holds
    with caplog.at_level(logging.WARNING, logger="radixkv.storage"):
        for i in range(0, len(ks), 128):
            batch = ks[i:i + 128]
            assert backend.put([(k, payload(k)) for k in batch]) == len(batch)

    newest = ks[-300:]
    assert backend.get(newest) == [payload(k) for k in newest]  # the KV just written is the KV kept
    oldest = ks[:300]
    assert backend.exists_prefix(oldest) == 0 and sum(b is not None for b in backend.get(oldest)) < 30
    assert backend.stats.evicted >= len(ks) // 2
    said = [r for r in caplog.records if r.getMessage() == "storage.disk_full"]
    assert len(said) == 1  # once a minute, not once a page
    assert said[0].fields["removed_pages"] >= 1
    fs = os.statvfs(small_disk)
    assert fs.f_bfree * fs.f_frsize < DISK // 4  # the disk stays used: room is made as needed, not in bulk
    backend.close()


def test_storage_threads_writing_at_once_on_a_full_disk_all_land(small_disk):
    """The daemon writes with several storage threads: one thread's relief may be filled
    by another's pages before its own write (a third of the stores failed with two)."""
    backend = FileStorage(small_disk / "pages")
    ks = keys(2 * DISK // BLOCK)
    failed = []

    def writer(part: list[bytes]) -> None:
        for i in range(0, len(part), 64):
            batch = part[i:i + 64]
            try:
                assert backend.put([(k, payload(k)) for k in batch]) == len(batch)
            except StorageUnavailable as e:
                failed.append(e)

    threads = [threading.Thread(target=writer, args=(ks[n::4],)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []
    newest = ks[-200:]
    assert backend.get(newest) == [payload(k) for k in newest]
    backend.close()


def test_a_disk_filled_by_something_else_fails_the_store_and_leaves_that_alone(small_disk):
    backend = FileStorage(small_disk / "pages")
    other = small_disk / "not-ours.bin"
    fd = os.open(other, os.O_WRONLY | os.O_CREAT, 0o600)
    fs = os.statvfs(small_disk)
    os.posix_fallocate(fd, 0, fs.f_bavail * fs.f_frsize)  # every block of the disk
    os.close(fd)
    size = other.stat().st_size

    with pytest.raises(StorageUnavailable, match="No space left"):
        backend.put([(k, payload(k)) for k in keys(4)])
    assert other.stat().st_size == size
    assert backend.stats.evicted == 0
    backend.close()
