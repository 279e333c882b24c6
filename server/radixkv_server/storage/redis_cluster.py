"""RedisClusterStorage: pages in a Redis or Valkey Cluster, shared by a fleet.

One page is one string key, `key_prefix + hex(key)`, with no hash tag: the pages of one
prefix hash to different slots and so spread over every shard, and a batch is one
pipeline that redis-py's cluster client splits per shard (every shard's commands are
written before any reply is read). Pages are written with SET NX [EX], as in
`RedisStorage`, so a present page is never rewritten.

Failure behaviour:
- a shard that is down or failing over: its commands fail; pages on other shards are
  still served. A get reads that shard's pages as misses (the prefix stops at the first),
  a put raises StorageUnavailable after the other shards stored theirs, and redis-py
  re-reads the slot map so the promoted replica is used once the cluster has one.
- `maxmemory` eviction removing a page in the middle of a prefix: that page is a miss,
  and prefetch and `exists_prefix` stop there.
- a cluster that stops answering (frozen nodes, dropped packets): a call fails after a
  socket timeout per shard its pipeline reaches, then one per startup node while
  redis-py refreshes the topology (3 frozen masters, defaults: a GET 8 s, a SET 14 s).
  The daemon's engine calls wait for no more than --storage-lookup-timeout
  (datapath/storage_mover.py); stores wait it out on the storage threads.
"""

from urllib.parse import unquote

from redis.backoff import EqualJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from .base import StorageBackend, StorageUnavailable


class RedisClusterStorage(StorageBackend):
    """Pages in the cluster reachable through any of `nodes` ((host, port) pairs).

    Connects on the first call (construction raises only ValueError): that call reads
    the slot map from the first node that answers. Thread-safe."""

    # RedisClusterException (no node reachable, a slot no node serves) is not a RedisError.
    faults = (RedisError, RedisClusterException, OSError)
    kind = "redis+cluster"

    def __init__(self, nodes: list[tuple[str, int]], key_prefix: bytes = b"radixkv:",
                 ttl_seconds: int | None = None, *, password: str | None = None, username: str | None = None,
                 socket_timeout: float = 2.0, retries: int = 2, batch: int = 256):
        if not nodes:
            raise ValueError("Redis Cluster needs at least one host:port")
        if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds < 1):
            raise ValueError(f"ttl_seconds must be None or an int >= 1, got {ttl_seconds!r}")
        if not isinstance(socket_timeout, (int, float)) or socket_timeout <= 0:
            raise ValueError(f"socket_timeout must be a positive number of seconds, got {socket_timeout!r}")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        super().__init__("redis+cluster://" + ",".join(f"{h}:{p}" for h, p in nodes))
        self.nodes = list(nodes)
        self.key_prefix = key_prefix
        self.ttl_seconds = ttl_seconds
        self.batch = batch
        self._options = dict(password=password, username=username, socket_timeout=socket_timeout,
                             socket_connect_timeout=socket_timeout, retries=retries)
        self._client: RedisCluster | None = None

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key that holds (or would hold) the page stored under `key`."""
        return self.key_prefix + key.hex().encode()

    # -- primitives -------------------------------------------------------------------

    def _exists_prefix(self, keys: list[bytes]) -> int:
        found = 0
        for i in range(0, len(keys), self.batch):
            replies = self._pipelined("exists", keys[i:i + self.batch], lambda pipe, k, _: pipe.exists(k))
            for present in replies:
                if present is not True and present != 1:
                    return found
                found += 1
        return found

    def _get_blobs(self, keys: list[bytes]) -> list[bytes | None]:
        blobs = []
        for i in range(0, len(keys), self.batch):
            replies = self._pipelined("get", keys[i:i + self.batch], lambda pipe, k, _: pipe.get(k))
            blobs += [None if isinstance(r, Exception) else r for r in replies]
        return blobs

    def _read_ahead(self, keys: list[bytes], page_bytes: int):
        # The GETs cost one round trip, as EXISTS would, and bring the pages along.
        return self._get_blobs(keys), None

    def _put_blobs(self, records: list[tuple[bytes, bytes]]) -> list[bool]:
        replies = self._pipelined("put", [k for k, _ in records],
                                  lambda pipe, k, i: pipe.set(k, records[i][1], nx=True, ex=self.ttl_seconds))
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed:
            raise StorageUnavailable(self.name, "put", detail=(
                f"{len(failed)} of {len(records)} pages not stored: {type(failed[0]).__name__}: {failed[0]}"))
        return [reply is True for reply in replies]

    def _discard(self, keys: list[bytes]) -> None:
        self._pipelined("discard", keys, lambda pipe, k, _: pipe.delete(k))

    def _check(self) -> None:
        self._connected().ping(target_nodes=RedisCluster.PRIMARIES)

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()

    # -- helpers ----------------------------------------------------------------------

    def _pipelined(self, operation: str, keys: list[bytes], command) -> list:
        """One cluster pipeline of `command(pipe, redis_key, index)` per key. Replies in order;
        a failed command's reply is its exception. Raises StorageUnavailable when every
        command failed (the cluster as a whole did not answer)."""
        pipe = self._connected().pipeline()
        for i, key in enumerate(keys):
            command(pipe, self.redis_key(key), i)
        replies = pipe.execute(raise_on_error=False)
        if replies and all(isinstance(r, Exception) for r in replies):
            raise StorageUnavailable(self.name, operation, replies[0])
        return replies

    def _connected(self) -> RedisCluster:
        if self._client is None:
            o = self._options
            retry = Retry(EqualJitterBackoff(cap=0.5, base=0.05), o["retries"])
            self._client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], require_full_coverage=False,
                retry=retry,
                socket_timeout=o["socket_timeout"], socket_connect_timeout=o["socket_connect_timeout"],
                password=o["password"], username=o["username"])
        return self._client


def open_url(url: str, parts, options: dict[str, str]) -> RedisClusterStorage:
    """`redis+cluster://[[user]:password@]host:port[,host:port...][?option=value&...]`:
    any nodes of the cluster (the rest are discovered). Options: prefix (key prefix,
    default radixkv:), ttl (seconds pages live), socket_timeout (seconds), retries, batch."""
    known = {"prefix", "ttl", "socket_timeout", "retries", "batch"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown Redis Cluster option(s) {unknown}; use {sorted(known)}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Redis Cluster nodes must be host:port[,host:port...], got {item!r}")
        nodes.append((host.strip("[]"), int(port)))
    try:
        return RedisClusterStorage(
            nodes, options.get("prefix", "radixkv:").encode(),
            int(options["ttl"]) if "ttl" in options else None,
            username=unquote(username) or None, password=unquote(password) or None,
            socket_timeout=float(options.get("socket_timeout", 2.0)),
            retries=int(options.get("retries", 2)), batch=int(options.get("batch", 256)))
    except ValueError as exc:
        raise ValueError(f"bad Redis Cluster option in storage URL: {exc}") from None
