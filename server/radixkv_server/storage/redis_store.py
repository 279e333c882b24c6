"""RedisStorage: pages in Redis or Valkey, shareable by many daemons.

Only basic commands are needed (EXISTS, MGET, SET NX [EX], DEL, PING), so any Redis >=
2.6.12 or Valkey works, as does a managed service that disables scripting. Each new
connection also asks `INFO server` for the server's run_id (a restarted server may have
lost every page); a user or proxy that refuses INFO only loses that. One page is one
string value under `key_prefix + "v2:" + hex(key)` (record.record_name); SET NX keeps the
first writer's page, so pages are never rewritten and concurrent daemons agree on every key's value.

For a bounded cache, give the server `maxmemory` with `maxmemory-policy allkeys-lru`
(usage-based), or pass `ttl_seconds` (pages expire that long after they are written,
whether used or not).

Every batch is one round trip (a non-transactional pipeline). A lost connection is retried
by redis-py with jittered exponential backoff, at most `retries` times; a call that still
fails raises StorageUnavailable. A call against a server that stopped answering (SIGSTOP)
fails after about `(retries + 1) * socket_timeout` (6.2 s with the defaults). Connections
are not health-checked before use: redis-py's check runs its own retry loop inside the
command's, which made a call on a connection idle for the check's interval fail only
after 10-18 s; a connection the server dropped fails its command instead, which the
command's retry reconnects.
"""

from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import EqualJitterBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from .base import StorageBackend
from .errors import redact_url
from .record import record_name

# Options redis-py reads from a URL, beyond those it parses by type above.
_URL_OPTIONS = frozenset(URL_QUERY_ARGUMENT_PARSERS) | {
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile",
    "ssl_password", "client_name", "username", "password",
}


class RedisStorage(StorageBackend):
    """Pages in the Redis or Valkey named by `url` (`redis://`, `rediss://`, `unix://`).

    Connects lazily: construction raises only ValueError (bad URL or argument), and the
    first call that cannot reach the server raises StorageUnavailable. Thread-safe: calls
    share a blocking connection pool of `max_connections`. `batch` caps the keys of one
    MGET or EXISTS run so one huge prompt does not stall the server for other clients.
    """

    faults = (RedisError, OSError)
    kind = "redis"

    def __init__(
        self,
        url: str,
        key_prefix: bytes = b"radixkv:",
        ttl_seconds: int | None = None,
        *,
        socket_timeout: float = 2.0,
        connect_timeout: float = 2.0,
        retries: int = 2,
        max_connections: int = 32,
        batch: int = 64,
    ):
        super().__init__(redact_url(url))
        _check_arguments(url, key_prefix, ttl_seconds, socket_timeout, connect_timeout,
                         retries, max_connections, batch)
        self.key_prefix = key_prefix
        self.ttl_seconds = ttl_seconds
        self.batch = batch
        retry = Retry(EqualJitterBackoff(cap=0.5, base=0.05), retries)
        try:
            pool = redis.BlockingConnectionPool.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                retry=retry, max_connections=max_connections, timeout=socket_timeout,
                health_check_interval=0, redis_connect_func=self._connected)
        except ValueError as exc:
            raise ValueError(f"bad Redis URL {self.name}: {exc}") from None
        self._client = redis.Redis(connection_pool=pool)
        self._run_id: bytes | None = None  # the server's, as the first connection saw it

    def _connected(self, conn) -> None:
        """Each new connection's handshake (redis-py's own), then the server's run_id: a
        new one is a restarted server, which may have lost every page (`lost_contents`;
        one restarted from a snapshot keeps some, and stores them again skip those)."""
        conn.on_connect()
        try:
            conn.send_command("INFO", "server")
            info = conn.read_response()
        except ResponseError:  # INFO refused (an ACL without @dangerous, a proxy): run_id unknown
            return
        self._refuse_cluster_node(conn)
        run_id = info_field(info, b"run_id")
        if run_id is None:
            return
        previous, self._run_id = self._run_id, run_id
        if previous is not None and previous != run_id:
            self.lost_contents(f"the Redis server restarted (run_id {previous[:8].decode()} -> {run_id[:8].decode()})")

    def _refuse_cluster_node(self, conn) -> None:
        """A server in cluster mode holds only its slots' keys: every other page would be
        refused MOVED, one call after another. Refused at connection, saying what to use."""
        try:
            conn.send_command("INFO", "cluster")
            info = conn.read_response()
        except ResponseError:  # refused (an ACL): the pages' own commands will say
            return
        if info_field(info, b"cluster_enabled") == b"1":
            conn.disconnect()
            where = getattr(conn, "path", None) or f"{conn.host}:{conn.port}"
            raise RedisConnectionError(f"{where} is a Redis Cluster node: name the cluster "
                                       "with redis+cluster://host:port[,host:port...]")

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key that holds (or would hold) the page stored under `key`."""
        return self.key_prefix + record_name(key).encode()

    # -- primitives -------------------------------------------------------------------

    def _exists_prefix(self, keys: list[bytes]) -> int:
        found = 0
        for chunk in self._chunks(keys):
            pipe = self._client.pipeline(transaction=False)
            for key in chunk:
                pipe.exists(self.redis_key(key))
            for present in pipe.execute():
                if not present:
                    return found
                found += 1
        return found

    def _get_blobs(self, keys: list[bytes]) -> list[bytes | None]:
        pipe = self._client.pipeline(transaction=False)
        for chunk in self._chunks(keys):
            pipe.mget([self.redis_key(key) for key in chunk])
        return [blob for values in pipe.execute() for blob in values]

    def _read_ahead(self, keys: list[bytes], page_bytes: int):
        # The GETs cost one round trip, as EXISTS would, and bring the pages along.
        return self._get_blobs(keys), None

    def _put_blobs(self, records: list[tuple[bytes, bytes]]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key, blob in records:
            pipe.set(self.redis_key(key), blob, nx=True, ex=self.ttl_seconds)
        return [reply is True for reply in pipe.execute()]

    def _discard(self, keys: list[bytes]) -> None:
        self._client.delete(*(self.redis_key(key) for key in keys))

    def _check(self) -> None:
        self._client.ping()

    def _close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()

    def _chunks(self, keys: list[bytes]):
        for i in range(0, len(keys), self.batch):
            yield keys[i:i + self.batch]


def info_field(reply, name: bytes) -> bytes | None:
    """The value of `name:` in a reply to INFO (bytes or text), or None."""
    info = reply if isinstance(reply, bytes) else str(reply).encode()
    prefix = name + b":"
    return next((line[len(prefix):].strip() for line in info.splitlines() if line.startswith(prefix)), None)


def _check_arguments(url, key_prefix, ttl_seconds, socket_timeout, connect_timeout,
                     retries, max_connections, batch) -> None:
    if not isinstance(url, str):
        raise ValueError(f"Redis URL must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"Redis URL {redact_url(url)} must start with redis://, rediss:// or unix://")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError(f"Redis URL {redact_url(url)} names no socket path")
    unknown = sorted(set(parse_qs(parts.query, keep_blank_values=True)) - _URL_OPTIONS)
    if unknown:
        raise ValueError(f"unknown Redis URL option(s) {unknown} in {redact_url(url)}")
    if not isinstance(key_prefix, bytes):
        raise ValueError(f"key_prefix must be bytes, got {type(key_prefix).__name__}")
    if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds < 1):
        raise ValueError(f"ttl_seconds must be None or an int >= 1, got {ttl_seconds!r}")
    for name, value in (("socket_timeout", socket_timeout), ("connect_timeout", connect_timeout)):
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    for name, value, low in (("retries", retries, 0), ("max_connections", max_connections, 1),
                             ("batch", batch, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
