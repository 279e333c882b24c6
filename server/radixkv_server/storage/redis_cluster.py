"""RedisClusterStorage: pages in a Redis or Valkey Cluster, shared by a fleet.

One page is one string key, `key_prefix + "v2:" + hex(key)`, with no hash tag: the pages of one
prefix hash to different slots and so spread over every shard. A batch is split per
node by redis-py's slot map and every node's commands are written before any reply is
read (redis_cluster_batch.ClusterBatch). Pages are written with SET NX [EX], as in
`RedisStorage`, so a present page is never rewritten.

Failure behaviour (each node is asked once per call; no command is re-sent on its own):
- a shard whose master is down, frozen or failing over: its pages are misses for get and
  exists_prefix (the prefix stops at the first), while pages on other shards are served;
  a put stores the other shards' pages, then raises StorageUnavailable naming how many
  were not stored. The call costs at most about a socket timeout per failed node. The
  node's failure is logged once, and its recovery once.
- no key of a batch got an answer (the whole cluster is unreachable or frozen, or every
  key is on a failed shard): StorageUnavailable.
- the slot map is re-read (at most once per call, at most once per REFRESH_INTERVAL_S
  over all calls) after a node failed, a slot moved or a slot was uncovered; a failed
  node's keys that the new map puts elsewhere (a replica promoted) are sent there in the
  same call. The re-read costs a socket timeout for each node it asks that does not
  answer. A key answered MOVED or ASK is sent once to the node named (after ASKING for
  ASK), else is a miss: it is never read from a node that does not hold it.
- `maxmemory` eviction removing a page in the middle of a prefix: that page is a miss,
  and prefetch and `exists_prefix` stop there.
- a call longer than `deadline` (default 4 socket timeouts) sends no further batch; the
  keys left are misses (not stored, for a put). The daemon's engine calls wait for no
  more than --storage-lookup-timeout (datapath/storage_mover.py).
- a node that comes back empty at its address (a master restarted within the node
  timeout, so no failover: it and its replica hold nothing) is seen by its run_id, as a
  single Redis server is: `lost_contents`. Writes a promoted replica had not received
  (asynchronous replication) are not seen.
"""

import logging
import math
import threading
import time
from contextlib import contextmanager
from urllib.parse import unquote

from redis.backoff import EqualJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError, SlotNotCoveredError
from redis.retry import Retry

from ..logs import log_event
from .base import StorageBackend
from .errors import StorageUnavailable
from .record import record_name
from .redis_cluster_batch import NODE_FAILURES, ClusterBatch, DeadlineExceeded
from .redis_store import info_field

REFRESH_INTERVAL_S = 0.25  # the least time between two re-reads of the slot map (~2 ms each)
# A reply that says nothing of the key: its node, its slot or the call failed.
_NO_ANSWER = NODE_FAILURES + (SlotNotCoveredError, DeadlineExceeded)
log = logging.getLogger("radixkv.storage")


class RedisClusterStorage(StorageBackend):
    """Pages in the cluster reachable through any of `nodes` ((host, port) pairs).

    Connects on the first call (construction raises only ValueError): that call reads
    the slot map from the first node that answers. `retries` applies to that and to
    `check` only: page commands are sent to each node once. `deadline` (seconds,
    default 4 * socket_timeout) bounds the batches one call starts. Thread-safe."""

    # RedisClusterException (no node reachable, a slot no node serves) is not a RedisError.
    faults = (RedisError, RedisClusterException, OSError)
    kind = "redis+cluster"

    def __init__(self, nodes: list[tuple[str, int]], key_prefix: bytes = b"radixkv:",
                 ttl_seconds: int | None = None, *, password: str | None = None, username: str | None = None,
                 socket_timeout: float = 2.0, retries: int = 2, batch: int = 256,
                 deadline: float | None = None, ssl: dict | None = None, max_connections: int | None = None,
                 client_name: str | None = None):
        _check_arguments(nodes, key_prefix, ttl_seconds, socket_timeout, retries, batch, deadline, max_connections)
        scheme = "rediss+cluster://" if ssl else "redis+cluster://"
        super().__init__(scheme + ",".join(f"{h}:{p}" for h, p in nodes))
        self.nodes = list(nodes)
        self.key_prefix = key_prefix
        self.ttl_seconds = ttl_seconds
        self.batch = batch
        self.deadline = 4 * socket_timeout if deadline is None else deadline
        self._options = dict(password=password, username=username, socket_timeout=socket_timeout,
                             socket_connect_timeout=socket_timeout, retries=retries,
                             client_name=client_name, **({"max_connections": max_connections} if max_connections else {}),
                             **(ssl or {}))
        self._client: RedisCluster | None = None
        # Guards _refreshed_at and _down, which every calling thread reads and updates.
        self._topology_lock = threading.Lock()
        self._refreshed_at = float("-inf")
        self._down: set[str] = set()  # nodes whose failure was logged and not yet their return
        self._run_ids: dict[str, bytes] = {}  # each node's (host:port) server, as its last connection saw it

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key that holds (or would hold) the page stored under `key`."""
        return self.key_prefix + record_name(key).encode()

    # -- primitives -------------------------------------------------------------------

    def _exists_prefix(self, keys: list[bytes]) -> int:
        found = 0
        with self._batches("exists") as run:
            for i in range(0, len(keys), self.batch):
                for present in run([("EXISTS", self.redis_key(k)) for k in keys[i:i + self.batch]]):
                    if present is not True and present != 1:  # a failed node's key is a miss
                        return found
                    found += 1
        return found

    def _get_blobs(self, keys: list[bytes]) -> list[bytes | None]:
        blobs = []
        with self._batches("get") as run:
            for i in range(0, len(keys), self.batch):
                replies = run([("GET", self.redis_key(k)) for k in keys[i:i + self.batch]])
                blobs += [None if isinstance(r, Exception) else r for r in replies]
        return blobs

    def _read_ahead(self, keys: list[bytes], page_bytes: int):
        # The GETs cost one round trip, as EXISTS would, and bring the pages along.
        return self._get_blobs(keys), None

    def _put_blobs(self, records: list[tuple[bytes, bytes]]) -> list[bool]:
        expiry = () if self.ttl_seconds is None else ("EX", self.ttl_seconds)
        with self._batches("put") as run:
            replies = run([("SET", self.redis_key(k), blob, "NX", *expiry) for k, blob in records])
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed:
            raise StorageUnavailable(self.name, "put", detail=(
                f"{len(failed)} of {len(records)} pages not stored: {type(failed[0]).__name__}: {failed[0]}"))
        return [reply is True for reply in replies]

    def _discard(self, keys: list[bytes]) -> None:
        with self._batches("discard") as run:
            run([("DEL", self.redis_key(k)) for k in keys])

    def _check(self) -> None:
        self._connected().ping(target_nodes=RedisCluster.PRIMARIES)

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()

    # -- helpers ----------------------------------------------------------------------

    @contextmanager
    def _batches(self, operation: str):
        """A `run(commands) -> replies` for one call (ClusterBatch.run: its batches share
        the failed nodes, the deadline and one re-read of the slot map). Raises
        StorageUnavailable when a batch got no answer at all; on leaving, logs the nodes
        that failed or came back."""
        batch = ClusterBatch(self._connected(), time.monotonic() + self.deadline, self._refresh)

        def run(commands: list[tuple]) -> list:
            replies = batch.run(commands)
            if replies and all(isinstance(r, Exception) for r in replies):
                raise StorageUnavailable(self.name, operation, replies[0])
            return replies

        try:
            yield run
        finally:
            self._note_nodes(batch)

    def _note_nodes(self, batch: ClusterBatch) -> None:
        with self._topology_lock:
            failed = set(batch.failed) - self._down
            back = batch.answered & self._down
            self._down = (self._down | failed) - back
        for name in sorted(failed):
            error = batch.failed[name]
            log_event(log, "storage.node_failed", logging.WARNING, store=self.name, node=name,
                      error=f"{type(error).__name__}: {error}",
                      note="its pages read as misses and are not stored until it answers")
        for name in sorted(back):
            log_event(log, "storage.node_back", store=self.name, node=name)

    def _refresh(self) -> None:
        """Re-read the slot map, unless a call did less than REFRESH_INTERVAL_S ago. A
        failure is logged and the current map kept."""
        with self._topology_lock:
            now = time.monotonic()
            if now - self._refreshed_at < REFRESH_INTERVAL_S:
                return
            self._refreshed_at = now
        try:
            self._client.nodes_manager.initialize()
        except (RedisError, RedisClusterException, OSError) as e:
            log_event(log, "storage.slot_map_failed", logging.WARNING, store=self.name,
                      error=f"{type(e).__name__}: {e}", note="the current slot map is kept")

    def _connected(self) -> RedisCluster:
        if self._client is None:
            o = dict(self._options)
            retry = Retry(EqualJitterBackoff(cap=0.5, base=0.05), o.pop("retries"))
            self._client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], require_full_coverage=False,
                retry=retry, redis_connect_func=self._node_connected, **o)
        return self._client

    def _node_connected(self, conn) -> None:
        """Each new connection to a node (after redis-py's handshake): that node's run_id
        and role. A new run_id at an address seen before is a server restarted there; as
        a master it serves its slots with none of the pages it had (`lost_contents`). As a
        replica (a failed master back after its replica took over, which kept the pages)
        it serves nothing. Any thread."""
        try:
            conn.send_command("INFO", "server")
            server = conn.read_response()
            conn.send_command("INFO", "replication")
            replication = conn.read_response()
        except ResponseError:  # INFO refused (an ACL without it): run_id unknown
            return
        run_id = info_field(server, b"run_id")
        if run_id is None:
            return
        node = f"{conn.host}:{conn.port}"
        with self._topology_lock:
            previous, self._run_ids[node] = self._run_ids.get(node), run_id
        if previous is not None and previous != run_id and info_field(replication, b"role") == b"master":
            self.lost_contents(f"the Redis Cluster master {node} restarted "
                               f"(run_id {previous[:8].decode()} -> {run_id[:8].decode()})")


MAX_BATCH = 4096  # pages one pipeline may carry per call (each node's part packed in memory at once)
_SSL_OPTIONS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"}


def _check_arguments(nodes, key_prefix, ttl_seconds, socket_timeout, retries, batch, deadline,
                     max_connections) -> None:
    """ValueError naming the first argument a cluster client could not use as meant."""
    if not nodes:
        raise ValueError("Redis Cluster needs at least one host:port")
    for host, port in nodes:
        if not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"node {host}:{port}: the port must be 1..65535")
    if b"{" in key_prefix or b"}" in key_prefix:
        raise ValueError(f"prefix {key_prefix.decode(errors='replace')!r} holds a hash tag brace: every page "
                         "would hash to one slot, so one shard would hold them all")
    if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds < 1):
        raise ValueError(f"ttl_seconds must be None or an int >= 1, got {ttl_seconds!r}")
    for name, value in (("socket_timeout", socket_timeout), ("deadline", deadline)):
        if (value is not None or name != "deadline") and (
                not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    for name, value, low, high in (("retries", retries, 0, 100), ("batch", batch, 1, MAX_BATCH),
                                   ("max_connections", max_connections, 1, 1 << 16)):
        if (value is not None or name != "max_connections") and (
                not isinstance(value, int) or not low <= value <= high):
            raise ValueError(f"{name} must be an int in {low}..{high}, got {value!r}")


def open_url(url: str, parts, options: dict[str, str]) -> RedisClusterStorage:
    """`redis+cluster://` (or `rediss+cluster://`, TLS)
    `[[user]:password@]host:port[,host:port...][?option=value&...]`: any nodes of the
    cluster (the rest are discovered). Options: prefix (key prefix, default radixkv:, no
    hash tag braces), ttl (seconds pages live), socket_timeout (seconds), retries, batch
    (pages per call, at most MAX_BATCH), deadline (seconds one call may start batches
    for), max_connections (per node), client_name (in CLIENT LIST); with TLS,
    ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs (required, optional, none)."""
    tls = parts.scheme == "rediss+cluster"
    known = {"prefix", "ttl", "socket_timeout", "retries", "batch", "deadline", "max_connections",
             "client_name"} | (_SSL_OPTIONS if tls else set())
    unknown = sorted(set(options) - known)
    if unknown:
        extra = " (ssl_* options need rediss+cluster://)" if set(unknown) & _SSL_OPTIONS else ""
        raise ValueError(f"unknown Redis Cluster option(s) {unknown}; use {sorted(known)}{extra}")
    if parts.path not in ("", "/"):
        raise ValueError(f"a Redis Cluster URL names no database ({parts.path!r}): a cluster has database 0 only")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Redis Cluster nodes must be host:port[,host:port...], got {item!r}")
        nodes.append((host.strip("[]"), int(port)))
    ssl = None
    if tls:
        ssl = {"ssl": True, **{k: options[k] for k in _SSL_OPTIONS if k in options}}
        if ssl.get("ssl_cert_reqs", "required") not in ("required", "optional", "none"):
            raise ValueError(f"ssl_cert_reqs must be required, optional or none, got {ssl['ssl_cert_reqs']!r}")
    try:
        return RedisClusterStorage(
            nodes, options.get("prefix", "radixkv:").encode(),
            int(options["ttl"]) if "ttl" in options else None,
            username=unquote(username) or None, password=unquote(password) or None,
            socket_timeout=float(options.get("socket_timeout", 2.0)),
            retries=int(options.get("retries", 2)), batch=int(options.get("batch", 256)),
            deadline=float(options["deadline"]) if "deadline" in options else None, ssl=ssl,
            max_connections=int(options["max_connections"]) if "max_connections" in options else None,
            client_name=options.get("client_name") or None)
    except ValueError as exc:
        raise ValueError(f"bad Redis Cluster option in storage URL: {exc}") from None
