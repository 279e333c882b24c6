"""`open_storage(url)`: the one place that knows every storage backend: `file://`,
`redis://`, `rediss://`, `unix://` (Redis/Valkey), `redis+cluster://` and `rediss+cluster://` (options parsed
in `redis_cluster.py`) and `mooncake://` (`mooncake_url.py`).

`SCHEMES` maps a URL scheme to the function opening that backend; a backend module is
imported only when its scheme is opened (redis-py, a Mooncake client, ... load on
demand). To add a backend: write `_open_<name>(url, parts, options)` below and list
its schemes in `SCHEMES`. The backends import `base`, never this module.
"""

from collections.abc import Callable
from urllib.parse import SplitResult, parse_qs, unquote, urlencode, urlsplit

from ..units import parse_size
from .base import StorageBackend
from .errors import redact_url

Opener = Callable[[str, SplitResult, dict[str, str]], StorageBackend]


def open_storage(url: str) -> StorageBackend:
    """Open the store named by `url`. Accepted forms:

    - `file:///abs/dir` (or `file://localhost/abs/dir`) and a bare path (`/abs/dir`,
      `rel/dir`, `~/dir`): a directory of page files (`FileStorage`), created if absent.
      Options: `?fsync=1` to fsync each page and its directory before it becomes visible;
      `max_size=<bytes>` (e.g. `200GiB`) to keep the directory near that size, removing
      the pages used least recently.
    - `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS), and
      `unix:///path/redis.sock[?db=N]`: Redis or Valkey (`RedisStorage`), connected lazily.
      Options: `ttl=<seconds>` (pages expire that long after they are written),
      `prefix=<text>` (key prefix, default `radixkv:`), and redis-py's connection options
      (`socket_timeout`, `socket_connect_timeout`, `max_connections`, ...).

    Raises ValueError (naming the problem) for an empty URL, an unknown scheme, a missing
    path, or a bad option; StorageUnavailable if a file directory cannot be created.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"storage URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        from .file import FileStorage
        return FileStorage(url)
    parts = urlsplit(url)
    opener = SCHEMES.get(parts.scheme.lower())
    if opener is None:
        raise ValueError(
            f"unsupported storage URL scheme {parts.scheme!r} in {redact_url(url)}; use a bare path "
            f"or one of {', '.join(scheme + '://' for scheme in SCHEMES)}")
    return opener(url, parts, _query(parts.query, url))


def _open_file(url: str, parts: SplitResult, options: dict[str, str]) -> StorageBackend:
    from .file import FileStorage
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file storage URL {url!r} names host {parts.netloc!r}; only local paths work")
    path = unquote(parts.path)
    if not path:
        raise ValueError(f"file storage URL {url!r} has no path")
    fsync = options.pop("fsync", "0")
    max_size = options.pop("max_size", None)
    if options:
        raise ValueError(f"unknown option(s) {sorted(options)} in {url!r}; file storage takes fsync, max_size")
    if fsync not in ("0", "1", "true", "false"):
        raise ValueError(f"fsync must be 0, 1, true or false in {url!r}, got {fsync!r}")
    try:
        max_bytes = parse_size(max_size) if max_size is not None else None
    except ValueError as exc:
        raise ValueError(f"max_size in {url!r}: {exc}") from None
    return FileStorage(path, fsync=fsync in ("1", "true"), max_bytes=max_bytes)


def _open_redis(url: str, parts: SplitResult, options: dict[str, str]) -> StorageBackend:
    from .redis_store import RedisStorage
    ttl = options.pop("ttl", None)
    prefix = options.pop("prefix", "radixkv:")
    rest = url.split("?", 1)[0].split("#", 1)[0]
    if options:
        rest += "?" + urlencode(options)
    return RedisStorage(rest, key_prefix=prefix.encode(),
                        ttl_seconds=_positive_int(ttl, "ttl", url) if ttl is not None else None)


def _open_mooncake(url: str, parts: SplitResult, options: dict[str, str]) -> StorageBackend:
    from .mooncake_url import open_url
    return open_url(url, parts, options)


def _open_redis_cluster(url: str, parts: SplitResult, options: dict[str, str]) -> StorageBackend:
    from .redis_cluster import open_url
    return open_url(url, parts, options)


SCHEMES: dict[str, Opener] = {
    "mooncake": _open_mooncake,
    "redis+cluster": _open_redis_cluster,
    "rediss+cluster": _open_redis_cluster,
    "file": _open_file,
    "redis": _open_redis,
    "rediss": _open_redis,
    "unix": _open_redis,
}


def _query(query: str, url: str) -> dict[str, str]:
    try:
        pairs = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"malformed query string in storage URL {redact_url(url)}") from None
    repeated = [name for name, values in pairs.items() if len(values) > 1]
    if repeated:
        raise ValueError(f"option(s) {repeated} given more than once in {redact_url(url)}")
    return {name: values[0] for name, values in pairs.items()}


def _positive_int(text: str, name: str, url: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a whole number of seconds >= 1 in {redact_url(url)}, got {text!r}")
    return int(text)


__all__ = ["SCHEMES", "open_storage"]
