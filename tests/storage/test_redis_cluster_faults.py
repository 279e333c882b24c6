"""Redis Cluster: pages spread over shards; a master killed and its replica promoted
while readers and writers run; maxmemory eviction in the middle of a prefix. Misses
and StorageUnavailable are allowed, wrong bytes never, and no call outlives its bound."""

import signal
import threading
import time

import numpy as np
import pytest
import redis

from radixkv_server.storage import StorageUnavailable, open_storage
from radixkv_server.storage.redis_cluster import RedisClusterStorage
from tests.storage.fleet import RedisCluster, lender_keys, poll

PAGE = 8 << 10
CALL_BOUND_S = 6.0  # socket_timeout 1 s x (1 + retries 2) plus backoff, on a busy machine


@pytest.fixture
def cluster():
    c = RedisCluster(node_timeout_ms=1000).start()
    yield c
    c.cleanup()


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, PAGE), dtype=np.uint8)


def test_pages_of_one_prefix_spread_over_every_shard(redis_cluster):
    backend = open_storage(f"{redis_cluster.url}?prefix=spread:")
    keys = lender_keys(1, 64)
    data = pages(64, 1)
    assert backend.put([(k, memoryview(data[i])) for i, k in enumerate(keys)]) == 64
    per_master = []
    for port in redis_cluster.primaries():
        with redis_cluster.client(port) as c:
            per_master.append(sum(1 for _ in c.scan_iter(match=b"spread:*")))
    assert len(per_master) == 3 and all(n > 0 for n in per_master) and sum(per_master) == 64
    backend.close()


def test_master_killed_and_replica_promoted_while_engines_run(cluster):
    url = f"{cluster.url}?socket_timeout=1&retries=2"
    writer, reader = open_storage(url), open_storage(url)
    data = pages(48, 2)
    keys = lender_keys(2, 48)
    assert writer.put([(k, memoryview(data[i])) for i, k in enumerate(keys)]) == 48
    stop, mismatches, slow, errors, reads = threading.Event(), [], [], [], [0]

    def engine():
        out = np.zeros((48, PAGE), dtype=np.uint8)
        while not stop.is_set():
            start = time.monotonic()
            try:
                n = reader.get_into(keys, [memoryview(out[i]) for i in range(48)])
                mismatches.extend(i for i in range(n) if not np.array_equal(out[i], data[i]))
                reads[0] += 1
            except StorageUnavailable as exc:
                errors.append(exc)
            if time.monotonic() - start > CALL_BOUND_S:
                slow.append(time.monotonic() - start)

    threads = [threading.Thread(target=engine) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        poll(lambda: reads[0] >= 4, 20, "engines reading before the failure")
        victim = cluster.primaries()[0]
        cluster.kill(victim)
        poll(lambda: len(cluster.primaries()) == 3 and victim not in cluster.primaries(), 30,
             "a replica promoted in place of the killed master")
        cluster.wait_ok()
        before = reads[0]
        poll(lambda: reads[0] >= before + 4, 30, "engines reading after the promotion")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert mismatches == [] and slow == []
    # After the promotion the store serves again, writes included.
    more = lender_keys(3, 16)
    poll(lambda: _put(writer, more, data), 30, "puts after the promotion")
    out = np.zeros((16, PAGE), dtype=np.uint8)
    # The reader's slot map may still name the killed master (re-read at most every
    # REFRESH_INTERVAL_S, after a call met a failed node): misses until it is re-read.
    poll(lambda: reader.get_into(more, [memoryview(out[i]) for i in range(16)]) == 16, 30,
         "the reader to read from the promoted replica")
    assert np.array_equal(out, data[:16])
    writer.close()
    reader.close()


def _put(backend, keys, data) -> bool:
    try:
        backend.put([(k, memoryview(data[i])) for i, k in enumerate(keys)])
        return True
    except StorageUnavailable:
        return False


def test_a_failed_master_back_as_a_replica_is_no_loss_of_contents(cluster):
    """Its replica took over with every page; the old master restarts at its address and
    rejoins as a replica. A new run_id there read as a loss: every namespace stored every
    page again and routers heard the pages removed (the review of the day's diff)."""
    backend = open_storage(f"{cluster.url}?socket_timeout=1&retries=2&prefix=back:")
    keys, data = lender_keys(5, 64), [bytes([i]) * 1024 for i in range(64)]
    assert backend.put(list(zip(keys, data))) == 64 and backend.get(keys) == data
    victim = cluster.primaries()[0]
    cluster.kill(victim)
    poll(lambda: victim not in cluster.primaries() and len(cluster.primaries()) == 3, 30, "the replica promoted")
    cluster.wait_ok()
    poll(lambda: _serves(backend, keys, data), 30, "every page served by the promoted replica")
    cluster._start_node(victim)
    poll(lambda: cluster._pings(victim), 10, "the old master back")
    poll(cluster._replicas_synced, 30, "the old master in sync as a replica")
    with cluster.client(victim) as node:
        restarted = node.info("server")["run_id"].encode()

    def seen_again() -> bool:  # slot-map refreshes (redis-py's, on MOVED or errors) connect to it again
        backend._client.nodes_manager.initialize()
        assert backend.get(keys) == data
        return backend._run_ids.get(f"127.0.0.1:{victim}") == restarted
    poll(seen_again, 30, "the backend connected to the restarted node")
    assert backend.generation == 0
    backend.close()


@pytest.fixture
def valkey_cluster():
    c = RedisCluster(node_timeout_ms=1000, flavor="valkey").start()
    yield c
    c.cleanup()


@pytest.mark.parametrize("flavor", ["cluster", "valkey_cluster"])
def test_maxmemory_eviction_in_the_middle_of_a_prefix_stops_it_there(request, flavor):
    cluster = request.getfixturevalue(flavor)
    backend = open_storage(cluster.url)
    keys, data = lender_keys(4, 64), pages(64, 4)
    assert backend.put([(k, memoryview(data[i])) for i, k in enumerate(keys)]) == 64
    cluster.set_all("maxmemory-policy", "allkeys-random")
    cluster.set_all("maxmemory", str(8 << 20))
    filler = pages(1, 5)
    checker = redis.RedisCluster(host="127.0.0.1", port=cluster.primaries()[0])

    def first_gap() -> int | None:
        pipe = checker.pipeline()
        for k in keys:
            pipe.exists(backend.redis_key(k))
        present = pipe.execute()
        gap = present.index(0) if 0 in present else None
        return gap if gap not in (None, 0) else None

    batch = 0
    while first_gap() is None:  # bounded: fills until eviction hits the prefix past page 0
        batch += 1
        assert batch < 200, "eviction never reached the middle of the prefix"
        try:
            # Random eviction may take the prefix's first page first (then no gap past it can
            # ever show): put the missing pages back and keep filling.
            if not checker.exists(backend.redis_key(keys[0])):
                backend.put([(k, memoryview(data[i])) for i, k in enumerate(keys)])
            backend.put([(k, memoryview(filler[0])) for k in lender_keys(1000 + batch, 128)])
        except StorageUnavailable:
            pass  # OOM answers while the server evicts are fine here
    gap = first_gap() or 64
    out = np.zeros((64, PAGE), dtype=np.uint8)
    n = backend.get_into(keys, [memoryview(out[i]) for i in range(64)])
    # Reads over maxmemory may evict more (Redis evicts before each command), never less,
    # and nothing writes these keys: the run ends at or before the gap, at a page that is gone.
    assert n <= gap
    assert np.array_equal(out[:n], data[:n])
    assert not checker.exists(backend.redis_key(keys[n]))
    assert backend.exists_prefix(keys) <= n
    checker.close()
    backend.close()


def test_a_cluster_that_stops_answering_raises_storage_unavailable_then_works_again():
    # redis-py says "no node reachable" with RedisClusterException, which is no RedisError.
    c = RedisCluster(masters=3, replicas=0, node_timeout_ms=3_600_000).start()  # no node marks another failed
    try:
        backend = open_storage(f"{c.url}?socket_timeout=0.2&retries=0&prefix=frozen:")
        keys = lender_keys(2, 8)
        data = pages(8, 2)
        assert backend.put([(k, memoryview(data[i])) for i, k in enumerate(keys)]) == 8
        for proc in c.procs.values():
            proc.send_signal(signal.SIGSTOP)
        try:
            for call in (lambda: backend.get(keys), lambda: backend.exists_prefix(keys),
                         lambda: backend.put([(lender_keys(3, 1)[0], b"page")])):
                with pytest.raises(StorageUnavailable):
                    call()
        finally:
            for proc in c.procs.values():
                proc.send_signal(signal.SIGCONT)
        poll(lambda: _serves(backend, keys, [bytes(row) for row in data]), 10, "the cluster serving again")
        backend.close()
    finally:
        c.cleanup()


def _serves(backend, keys, data) -> bool:
    try:
        return backend.get(keys) == data
    except StorageUnavailable:
        return False


def test_url_forms():
    b = open_storage("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001?prefix=t:&ttl=60&socket_timeout=0.5")
    assert isinstance(b, RedisClusterStorage)
    assert b.nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert (b.key_prefix, b.ttl_seconds) == (b"t:", 60)
    assert "pw" not in b.name
    b.close()


def test_tls_and_connection_options_reach_the_cluster_client():
    """A managed or TLS-only cluster (ElastiCache/MemoryDB, Valkey with tls-cluster) was
    refused: no rediss+cluster scheme, no ssl options (the store operators' review)."""
    b = open_storage("rediss+cluster://10.0.0.1:7000?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required"
                     "&max_connections=8&client_name=radixkv-node1")
    assert b.name == "rediss+cluster://10.0.0.1:7000" and b.kind == "redis+cluster"
    options = b._options
    assert (options["ssl"], options["ssl_ca_certs"], options["ssl_cert_reqs"]) == (True, "/etc/ca.pem", "required")
    assert (options["max_connections"], options["client_name"]) == (8, "radixkv-node1")
    b.close()


@pytest.mark.parametrize("url, message", [
    ("redis+cluster://host", "host:port"),
    ("redis+cluster://h:1?db=2", "unknown Redis Cluster option"),
    ("redis+cluster://h:1?ttl=0", "ttl_seconds must be"),
    # values that passed and failed every later call (raw TypeError, OverflowError, nan deadlines)
    ("redis+cluster://h:1?retries=-1", "retries must be an int in 0..100"),
    ("redis+cluster://h:1?socket_timeout=nan", "socket_timeout must be a positive, finite"),
    ("redis+cluster://h:1?socket_timeout=inf", "socket_timeout must be a positive, finite"),
    ("redis+cluster://h:1?deadline=inf", "deadline must be a positive, finite"),
    ("redis+cluster://h:99999", "port must be 1..65535"),
    ("redis+cluster://h:1/3", "names no database"),
    ("redis+cluster://h:1?batch=100000", "batch must be an int in 1..4096"),
    ("redis+cluster://h:1?prefix={rkv}:", "hash tag brace"),
    ("redis+cluster://h:1?ssl_ca_certs=/ca.pem", "need rediss\\+cluster"),
    ("rediss+cluster://h:1?ssl_cert_reqs=maybe", "ssl_cert_reqs must be"),
    ("redis+cluster://h:1?max_connections=0", "max_connections must be"),
])
def test_bad_urls(url, message):
    with pytest.raises(ValueError, match=message):
        open_storage(url)
