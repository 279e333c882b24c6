"""A page directory with `max_size` stays near that size, removing the pages used least
recently (DiskBudget): real files in a temporary directory, ages set with os.utime."""

import hashlib
import os
import time

import pytest

from radixkv_server.storage import FileStorage, open_storage
from radixkv_server.storage.file_budget import SHARDS
from radixkv_server.storage.record import HEADER_BYTES

BUDGET = 16 << 20  # the smallest: 64 KiB per shard
PAGE = 8 << 10
RECORD = HEADER_BYTES + PAGE
SLACK = SHARDS * (RECORD + 4096)  # a shard may pass its mark by the page that crosses it (in blocks)


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


def payload(key: bytes) -> bytes:
    return key * (PAGE // len(key))


def put(backend: FileStorage, ks: list[bytes]) -> None:
    assert backend.put([(k, payload(k)) for k in ks]) == len(ks)


def on_disk(directory) -> tuple[int, int]:
    """(page files, the disk they take, as `du` counts it) under `directory`. A page of
    8 KiB and its header take 12 KiB of a 4 KiB-block filesystem (counting lengths, the
    budget let the disk hold half as much again)."""
    files = [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names if f.endswith(".page")]
    return len(files), sum(os.stat(f).st_blocks * 512 for f in files)


def test_the_directory_stays_near_its_budget_and_keeps_the_pages_used_last(tmp_path):
    old, read = keys("old", 512), keys("read", 128)
    put(FileStorage(tmp_path), old + read)  # written before, by a daemon with no budget
    backend = FileStorage(tmp_path, max_bytes=BUDGET)
    now = time.time()
    for k in old:  # written long ago, never read
        os.utime(backend.path_for(k), (now - 7200, now - 7200))
    for k in read:  # written long ago, read since (atime after every later write)
        os.utime(backend.path_for(k), (now + 3600, now - 7200))
    new = keys("new", 3456)  # with the rest, twice the budget
    put(backend, new)
    _, size = on_disk(tmp_path)
    assert 0.75 * BUDGET <= size <= 1.1 * BUDGET + SLACK
    present = lambda k: os.path.exists(backend.path_for(k))  # noqa: E731
    survivors = [k for k in new if present(k)]
    # Within a shard the least recently used went first: where any new page was
    # removed, no old one is left (a shard that never filled up kept everything).
    trimmed = {k[0] for k in new if not present(k)}
    assert not [k for k in old if k[0] in trimmed and present(k)]
    assert sum(1 for k in old if not present(k)) > 0.9 * len(old)
    assert backend.get(read) == [payload(k) for k in read]
    assert len(survivors) > 1000 and backend.get(survivors) == [payload(k) for k in survivors]
    assert backend.stats.evicted == sum(1 for k in old + new if not present(k))


def test_a_directory_filled_before_opening_is_trimmed_as_pages_are_written(tmp_path):
    put(FileStorage(tmp_path), keys("before", 4096))  # 32 MiB, no budget yet
    backend = FileStorage(tmp_path, max_bytes=BUDGET)
    put(backend, keys("after", 1024))  # about four per shard: each shard is measured at its first
    _, size = on_disk(tmp_path)
    assert size <= 1.1 * BUDGET + SLACK


def test_daemons_sharing_a_directory_keep_it_within_budget_together(tmp_path):
    a, b = FileStorage(tmp_path, max_bytes=BUDGET), FileStorage(tmp_path, max_bytes=BUDGET)
    ka, kb = keys("a", 2048), keys("b", 2048)
    for i in range(0, 2048, 64):
        put(a, ka[i:i + 64])
        put(b, kb[i:i + 64])
    _, size = on_disk(tmp_path)
    assert size <= 1.2 * BUDGET + 2 * SLACK  # a tenth of a share per daemon between looks


def test_temporary_files_a_crashed_writer_left_are_removed_when_their_shard_is_measured(tmp_path):
    backend = FileStorage(tmp_path, max_bytes=BUDGET)
    key = bytes.fromhex("abcd") + bytes(30)
    stale, fresh = (tmp_path / "ab" / "cd" / n for n in (".x.page.1-0.tmp", ".y.page.1-1.tmp"))
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"torn"), fresh.write_bytes(b"being written")
    os.utime(stale, (time.time() - 7200,) * 2)
    put(backend, [key])  # the shard's first write measures it
    assert not stale.exists() and fresh.exists()


def test_the_url_option_and_its_limits(tmp_path):
    assert open_storage(f"file://{tmp_path}?max_size=1GiB").budget.max_bytes == 1 << 30
    assert open_storage(f"file://{tmp_path}").budget is None
    with pytest.raises(ValueError, match="at least 16MiB"):
        open_storage(f"file://{tmp_path}?max_size=1MiB")
    with pytest.raises(ValueError, match="max_size"):
        open_storage(f"file://{tmp_path}?max_size=lots")


def test_a_bound_past_the_file_systems_size_is_warned_about_at_open(tmp_path, caplog):
    """The disk would fill before the bound (seen on a 24 MiB tmpfs with max_size=64MiB:
    no word until the first ENOSPC; now the full disk makes room, test_file_disk_full)."""
    fs = os.statvfs(tmp_path)
    size = fs.f_blocks * fs.f_frsize
    with caplog.at_level("WARNING", logger="radixkv.storage"):
        open_storage(f"file://{tmp_path}/a?max_size={size // 2}").close()
        assert "storage.max_size_past_disk" not in caplog.text
        open_storage(f"file://{tmp_path}/b?max_size={size + (1 << 30)}").close()
    [said] = [r for r in caplog.records if r.getMessage() == "storage.max_size_past_disk"]
    assert said.fields["disk_size"] == size
