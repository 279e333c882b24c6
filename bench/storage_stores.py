"""The stores the storage bench runs against, each with its own client's raw batched get
and put of the same bytes (the baselines): a page directory, one redis-server, a Redis
Cluster of 1 or 3 masters, and a Mooncake Store whose memory 1 or 3 lender processes
lend (the daemons lend none, so the pages outlive them).

`Store.raw_get(keys)` reads the records stored under those storage keys, one batch per
call, and returns the bytes read; `raw_put(keys, blob)` writes `blob` under each key
(fresh keys), one batch per call. Both skip everything the daemon adds: checksums,
copies into a host pool, the event loop. `holds_all(keys)` says whether the daemon's
record is in the store under every key, asked of the store alone and cheaply enough to
poll (a few ms for 2k keys), so a bench sees a daemon's stores land without putting work
on that daemon; `missing(keys)` names the keys without one (slower: a check afterwards).
A record counts once the store shows it whole: files are renamed into place, a Redis
SET and a Mooncake put (its put_end) are atomic.
"""

import os
import shutil
import subprocess
import tempfile

import numpy as np

from radixkv_server.storage.record import HEADER_BYTES, record_name
from tests.storage.fleet import Lender, MooncakeMaster, RedisCluster, poll


class FileStore:
    label = "file"

    def __init__(self, work: str, page_bytes: int):
        self.dir = os.path.join(work, "pages")
        self.url = f"file://{self.dir}"
        from radixkv_server.storage import FileStorage
        self._paths = FileStorage(self.dir)

    def raw_get(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            with open(self._paths.path_for(k), "rb") as f:
                n += len(f.read())
        return n

    def raw_put(self, keys: list[bytes], blob: bytes) -> None:
        for k in keys:
            path = self._paths.path_for(k) + ".raw"
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(blob)

    def holds_all(self, keys: list[bytes]) -> bool:
        return all(os.path.exists(self._paths.path_for(k)) for k in reversed(keys))  # the last stored last

    def missing(self, keys: list[bytes]) -> list[bytes]:
        return [k for k in keys if not os.path.exists(self._paths.path_for(k))]

    def close(self) -> None:
        pass


class RedisStore:
    label = "redis"

    def __init__(self, work: str, page_bytes: int):
        import redis
        sock = os.path.join(work, "redis.sock")
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/ensure-system-deps.sh)")
        self.proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700",
                                      "--save", "", "--appendonly", "no", "--dir", work],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"unix://{sock}"
        self.client = redis.Redis(unix_socket_path=sock)
        poll(self._pings, 20, "redis-server")

    def _pings(self) -> bool:
        import redis
        if self.proc.poll() is not None:
            raise RuntimeError("redis-server exited")
        try:
            return self.client.ping()
        except (redis.RedisError, OSError):
            return False

    def raw_get(self, keys: list[bytes]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(_name(k))
        return sum(len(v) for v in pipe.execute())

    def raw_put(self, keys: list[bytes], blob: bytes) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.set(b"raw:" + k.hex().encode(), blob)
        pipe.execute()

    def holds_all(self, keys: list[bytes]) -> bool:
        return self.client.exists(*[_name(k) for k in keys]) == len(keys)  # one command, counted by the server

    def missing(self, keys: list[bytes]) -> list[bytes]:
        return _missing_in(self.client.pipeline(transaction=False), keys)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)


class RedisClusterStore:
    def __init__(self, work: str, page_bytes: int, shards: int):
        self.label = f"redis_cluster@{shards}"
        self.cluster = RedisCluster(masters=shards, replicas=0).start()
        self.url = self.cluster.url
        import redis
        self.client = redis.RedisCluster(host="127.0.0.1", port=self.cluster.ports[0])
        self._raw_records = 0
        self._daemon_keys: set[bytes] = set()

    def raw_get(self, keys: list[bytes]) -> int:
        pipe = self.client.pipeline()
        for k in keys:
            pipe.get(_name(k))
        return sum(len(v) for v in pipe.execute())

    def raw_put(self, keys: list[bytes], blob: bytes) -> None:
        pipe = self.client.pipeline()
        for k in keys:
            pipe.set(b"raw:" + k.hex().encode(), blob)
        pipe.execute()
        self._raw_records += len(keys)

    def holds_all(self, keys: list[bytes]) -> bool:
        """One key: EXISTS. More: the masters' record count against the keys asked about so
        far plus the raw puts (the cluster holds nothing else), since a multi-key EXISTS
        must stay in one slot and a pipeline of 2k costs ~50-100 ms here."""
        if len(keys) == 1:
            return bool(self.client.exists(_name(keys[0])))
        self._daemon_keys.update(keys)
        records = sum(self.client.dbsize(target_nodes=n) for n in self.client.get_primaries())
        return records == self._raw_records + len(self._daemon_keys)

    def missing(self, keys: list[bytes]) -> list[bytes]:
        return _missing_in(self.client.pipeline(), keys)

    def close(self) -> None:
        self.client.close()
        self.cluster.cleanup()


class MooncakeStore:
    def __init__(self, work: str, page_bytes: int, segments: int, lend_bytes: int):
        self.label = f"mooncake@{segments}"
        self.master = MooncakeMaster(client_ttl_s=10).start()
        self.lenders = [Lender(self.master.address, lend_bytes, 0, 0, seed=0) for _ in range(segments)]
        self.url = f"mooncake://{self.master.address}?segment=0"
        from mooncake.store import MooncakeDistributedStore
        self.client = MooncakeDistributedStore()
        poll(lambda: self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "",
                                       self.master.address) == 0, 30, "the bench client to join")
        self.record = HEADER_BYTES + page_bytes
        self.buffer = np.zeros(256 * self.record, dtype=np.uint8)
        self.client.register_buffer(self.buffer.ctypes.data, self.buffer.nbytes)

    def _ptrs(self, n: int) -> list[int]:
        if n > 256:
            raise ValueError("the raw Mooncake client moves at most 256 pages a batch")
        return [self.buffer.ctypes.data + i * self.record for i in range(n)]

    def raw_get(self, keys: list[bytes]) -> int:
        codes = self.client.batch_get_into(["radixkv:" + record_name(k) for k in keys], self._ptrs(len(keys)),
                                           [self.record] * len(keys))
        if any(c != self.record for c in codes):
            raise RuntimeError(f"raw Mooncake get failed: {sorted(set(codes))}")
        return sum(codes)

    def raw_put(self, keys: list[bytes], blob: bytes) -> None:
        codes = self.client.batch_put_from(["raw:" + k.hex() for k in keys], self._ptrs(len(keys)),
                                           [self.record] * len(keys))
        if any(codes):
            raise RuntimeError(f"raw Mooncake put failed: {sorted(set(codes))}")

    def holds_all(self, keys: list[bytes]) -> bool:
        return not self.missing(keys)

    def missing(self, keys: list[bytes]) -> list[bytes]:
        codes = self.client.batch_is_exist(["radixkv:" + record_name(k) for k in keys])
        if keys and all(c < 0 for c in codes):
            raise RuntimeError(f"the Mooncake master did not answer batch_is_exist: {sorted(set(codes))}")
        return [k for k, c in zip(keys, codes) if c != 1]

    def close(self) -> None:
        self.client.close()
        for lender in self.lenders:
            lender.kill()
        self.master.cleanup()


def _missing_in(pipe, keys: list[bytes]) -> list[bytes]:
    """The keys without a daemon's record, by one pipeline of EXISTS (one key each, so a
    cluster pipeline sends each to its shard)."""
    for k in keys:
        pipe.exists(_name(k))
    return [k for k, n in zip(keys, pipe.execute()) if not n]


def _name(key: bytes) -> bytes:
    """The name of a daemon's record of `key` (the default prefix)."""
    return b"radixkv:" + record_name(key).encode()


def open_stores(page_bytes: int, total_bytes: int):
    """(label, factory) for every store the bench measures, in order."""
    lend = max(64 << 20, 3 * total_bytes)  # room for the daemon's pages and the raw puts
    return [
        ("file", lambda w: FileStore(w, page_bytes)),
        ("redis", lambda w: RedisStore(w, page_bytes)),
        ("redis_cluster@1", lambda w: RedisClusterStore(w, page_bytes, 1)),
        ("redis_cluster@3", lambda w: RedisClusterStore(w, page_bytes, 3)),
        ("mooncake@1", lambda w: MooncakeStore(w, page_bytes, 1, lend)),
        ("mooncake@3", lambda w: MooncakeStore(w, page_bytes, 3, lend // 3 + (16 << 20))),
    ]


def workdir() -> str:
    return tempfile.mkdtemp(prefix="rkv-bench-st-")


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
