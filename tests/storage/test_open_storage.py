"""open_storage: every documented URL form opens the right backend; bad ones say why."""

import pytest
import redis

from radixkv_server.storage import FileStorage, RedisStorage, open_storage


@pytest.mark.parametrize("form", ["file://{d}", "file://localhost{d}", "{d}"])
def test_file_forms(tmp_path, form):
    directory = tmp_path / "pages"
    backend = open_storage(form.format(d=directory))
    assert isinstance(backend, FileStorage)
    assert backend.directory == str(directory) and directory.is_dir()
    assert backend.fsync is False


def test_file_fsync_option(tmp_path):
    backend = open_storage(f"file://{tmp_path}/pages?fsync=1")
    assert backend.fsync is True
    assert backend.put([(b"k" * 32, b"durable")]) == 1
    assert backend.get([b"k" * 32]) == [b"durable"]


def test_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    backend = open_storage("cache/pages")
    assert backend.directory == str(tmp_path / "cache" / "pages")


@pytest.mark.parametrize("url, name", [
    ("redis://localhost:6379/0", "redis://localhost:6379/0"),
    ("redis://:pw@10.0.0.5:6380/2", "redis://10.0.0.5:6380/2"),
    ("rediss://user:pw@cache.example:6379", "rediss://cache.example:6379"),
    ("unix:///run/redis/redis.sock", "unix:///run/redis/redis.sock"),
    ("unix:///run/redis/redis.sock?db=3", "unix:///run/redis/redis.sock"),
])
def test_redis_forms_connect_lazily(url, name):
    backend = open_storage(url)  # nothing listens on these: opening must not connect
    assert isinstance(backend, RedisStorage)
    assert backend.name == name
    assert backend.key_prefix == b"radixkv:" and backend.ttl_seconds is None
    backend.close()


def test_redis_options(redis_url):
    backend = open_storage(f"{redis_url}?ttl=60&prefix=team-a:&socket_timeout=0.5")
    assert (backend.ttl_seconds, backend.key_prefix) == (60, b"team-a:")
    backend.put([(b"k" * 32, b"page")])
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.ttl(backend.redis_key(b"k" * 32)) <= 60
    assert backend.redis_key(b"k" * 32).startswith(b"team-a:")
    client.close()
    backend.close()


@pytest.mark.parametrize("url, message", [
    ("", "non-empty"),
    ("ftp://host/dir", "unsupported storage URL scheme 'ftp'"),
    ("file://otherhost/dir", "only local paths"),
    ("file://", "has no path"),
    ("file:///tmp/x?fsync=maybe", "fsync must be"),
    ("file:///tmp/x?compress=1", "unknown option"),
    ("unix://", "names no socket path"),
    ("redis://localhost?ttl=0", "ttl must be"),
    ("redis://localhost?ttl=1.5", "ttl must be"),
    ("redis://localhost?frobnicate=1", "unknown Redis URL option"),
    ("redis://localhost?db=1&db=2", "more than once"),
    ("redis://:hunter2@localhost?socket_timeout=soon", "bad Redis URL"),
])
def test_bad_urls_raise_value_error(url, message):
    with pytest.raises(ValueError, match=message) as info:
        open_storage(url)
    assert "hunter2" not in str(info.value)
