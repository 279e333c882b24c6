"""Store faults raise StorageUnavailable (never a raw error), and the same backend
object works again once the store is back."""

import os
import shutil
import signal

import pytest
import redis

from radixkv_server.storage import FileStorage, RedisStorage, StorageUnavailable, open_storage

KEY_A, KEY_B = b"a" * 32, b"b" * 32


def _assert_unavailable(call, store_name: str, operation: str) -> StorageUnavailable:
    with pytest.raises(StorageUnavailable) as info:
        call()
    exc = info.value
    assert exc.store == store_name and exc.operation == operation
    assert str(exc).startswith(f"storage {store_name} unavailable during {operation}: ")
    return exc


# -- Redis ----------------------------------------------------------------------------------

def test_redis_stopped_then_restarted(private_redis):
    backend = RedisStorage(private_redis.url, socket_timeout=1.0, connect_timeout=1.0, retries=1)
    assert backend.put([(KEY_A, b"before")]) == 1
    private_redis.stop()

    name = f"unix://{private_redis.socket}"
    for operation, call in [
        ("get", lambda: backend.get([KEY_A])),
        ("put", lambda: backend.put([(KEY_B, b"page")])),
        ("exists_prefix", lambda: backend.exists_prefix([KEY_A])),
        ("check", backend.check),
    ]:
        exc = _assert_unavailable(call, name, operation)
        assert isinstance(exc.__cause__, redis.ConnectionError)
        assert "ConnectionError" in str(exc)
    assert backend.stats.errors == 4

    private_redis.start()  # same socket, empty (no persistence)
    assert backend.generation == 0
    assert backend.put([(KEY_B, b"after")]) == 1
    assert backend.generation == 1  # a new server (its run_id): it may have lost pages
    assert backend.get([KEY_A, KEY_B]) == [None, b"after"]
    assert backend.exists_prefix([KEY_B]) == 1
    backend.close()


def test_a_redis_user_without_info_still_stores_and_reads(private_redis):
    """INFO is @dangerous to Redis's ACLs: a user or proxy refusing it only hides the
    server's run_id (every connection failed while the daemon asked it unguarded)."""
    admin = redis.Redis(unix_socket_path=str(private_redis.socket))
    admin.acl_setuser("kv", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@dangerous"])
    admin.close()
    backend = RedisStorage(f"unix://kv:pw@{private_redis.socket}", retries=0)
    try:
        assert backend.put([(KEY_A, b"page")]) == 1
        assert backend.exists_prefix([KEY_A]) == 1 and backend.get([KEY_A]) == [b"page"]
    finally:
        backend.close()


def test_redis_that_hangs_times_out(private_redis):
    backend = RedisStorage(private_redis.url, socket_timeout=0.3, connect_timeout=0.3, retries=0)
    backend.put([(KEY_A, b"page")])
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    try:
        exc = _assert_unavailable(lambda: backend.get([KEY_A]), f"unix://{private_redis.socket}", "get")
        assert isinstance(exc.__cause__, redis.TimeoutError)
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
    assert backend.get([KEY_A]) == [b"page"]
    backend.close()


def test_redis_connections_the_server_dropped_reconnect_on_the_next_call(private_redis):
    # Connections are not health-checked before use (that check nests a second retry
    # loop and stretches a hung server's calls); the command's own retry reconnects.
    backend = RedisStorage(private_redis.url, retries=1)
    assert backend.put([(KEY_A, b"page")]) == 1
    admin = redis.Redis(unix_socket_path=str(private_redis.socket))
    assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
    assert backend.get([KEY_A]) == [b"page"]
    assert backend.put([(KEY_B, b"page")]) == 1
    assert backend.stats.errors == 0
    admin.close()
    backend.close()


def test_redis_error_message_leaves_out_the_password():
    backend = open_storage("redis://user:s3cret@127.0.0.1:1/0?socket_connect_timeout=0.2")
    exc = _assert_unavailable(lambda: backend.get([KEY_A]), "redis://127.0.0.1:1/0", "get")
    assert "s3cret" not in str(exc) and "s3cret" not in repr(backend)
    backend.close()


# -- files ----------------------------------------------------------------------------------

def _all_calls(backend):
    return [
        ("get", lambda: backend.get([KEY_A])),
        ("put", lambda: backend.put([(KEY_B, b"page")])),
        ("exists_prefix", lambda: backend.exists_prefix([KEY_A, KEY_B])),
        ("check", backend.check),
    ]


def test_file_directory_removed_then_restored(tmp_path):
    directory = tmp_path / "pages"
    backend = FileStorage(directory)
    backend.put([(KEY_A, b"page")])
    shutil.rmtree(directory)

    for operation, call in _all_calls(backend):
        exc = _assert_unavailable(call, f"file://{directory}", operation)
        assert "missing or not a directory" in str(exc)
    assert not directory.exists()  # the backend did not recreate it

    directory.mkdir()
    assert backend.put([(KEY_B, b"again")]) == 1
    assert backend.get([KEY_A, KEY_B]) == [None, b"again"]


def test_file_directory_replaced_by_a_file(tmp_path):
    directory = tmp_path / "pages"
    backend = FileStorage(directory)
    shutil.rmtree(directory)
    directory.write_bytes(b"not a directory")
    for operation, call in _all_calls(backend):
        _assert_unavailable(call, f"file://{directory}", operation)


def test_file_directory_that_cannot_take_pages(tmp_path):
    # A regular file where the page's fan-out directory belongs: writes fail with
    # ENOTDIR for every user, root included (for whom mode bits would not matter).
    backend = FileStorage(tmp_path / "pages")
    (tmp_path / "pages" / KEY_B.hex()[:2]).write_bytes(b"obstruction")
    exc = _assert_unavailable(lambda: backend.put([(KEY_B, b"page")]), backend.name, "put")
    assert isinstance(exc.__cause__, NotADirectoryError)
    assert backend.put([(KEY_A, b"page")]) == 1  # other fan-out directories still work
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".tmp")]
    assert leftovers == []


def test_file_storage_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageUnavailable, match="during open"):
        open_storage(str(tmp_path / "file" / "pages"))


def test_a_page_file_that_cannot_be_read_is_a_miss_there_and_the_pages_before_it_are_served(tmp_path, caplog):
    """A directory where page 2 belongs (an operator's mistake, a half-restored backup):
    the pages before it are served and it is one miss, logged once; it was a tier-wide
    outage that threw away the whole prefix (and the probe counted it present)."""
    backend = FileStorage(tmp_path / "pages")
    keys = [bytes([i + 1]) * 32 for i in range(4)]
    payloads = [bytes([i + 1]) * 4096 for i in range(4)]
    assert backend.put(list(zip(keys, payloads))) == 4
    path = backend.path_for(keys[2])
    os.unlink(path)
    os.mkdir(path)
    assert backend.exists_prefix(keys) == 2
    for _ in range(2):
        pages = [bytearray(4096) for _ in keys]
        assert backend.get_into(keys, pages) == 2
        assert [bytes(p) for p in pages[:2]] == payloads[:2]
    [warning] = [r for r in caplog.records if r.getMessage() == "storage.page_unreadable"]
    assert warning.fields["path"] == path


class _BuggyClient(FileStorage):
    """A backend whose client library fails with an error none of its `faults` names
    (redis-py raised AttributeError mid-reshard, a bad option TypeError at every call)."""

    def _exists_prefix(self, keys):
        raise AttributeError("'NoneType' object has no attribute 'sendall'")


def test_an_error_outside_the_backends_faults_is_the_store_unavailable_logged_once(tmp_path, caplog):
    """Such an error reached the engine's Match and Prefetch as INTERNAL, on every call,
    with no lookup pause (the store operators' review)."""
    backend = _BuggyClient(str(tmp_path))
    with caplog.at_level("ERROR", logger="radixkv.storage"):
        for _ in range(3):
            exc = _assert_unavailable(lambda: backend.exists_prefix([KEY_A]), backend.name, "exists_prefix")
            assert "AttributeError" in str(exc)
    [logged] = [r for r in caplog.records if r.msg == "storage.unexpected_error"]
    assert "Traceback" in logged.fields["traceback"] and logged.fields["operation"] == "exists_prefix"
    assert backend.stats.errors == 3
    backend.close()
