"""Real fleet stores on localhost for tests and benchmarks: a `mooncake_master` (from
the `mooncake` extra) and a Redis Cluster of redis-server processes (3 masters with one
replica each by default). Every wait polls against a deadline; nothing sleeps to
synchronise. Used by tests/storage and tests/service (`from tests.storage.fleet import ...`).
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import redis

from radixkv_server.storage.mooncake_probe import probe_master

START_TIMEOUT_S = 30.0


def free_port(span: int = 0) -> int:
    """A TCP port free now on 127.0.0.1 (and port + span too, e.g. a Redis cluster bus)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span < 65536 and (span == 0 or _free(port + span)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _another_port(taken: set[int]) -> int:
    while (port := free_port()) in taken:
        pass
    return port


def poll(condition, timeout: float, what: str, interval: float = 0.05):
    """condition() until truthy (returned); RuntimeError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def _stop(proc: subprocess.Popen | None, sig=signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def mooncake_master_exe() -> str | None:
    """The `mooncake_master` next to this Python (the wheel's), or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.access(here, os.X_OK) else shutil.which("mooncake_master")


class MooncakeMaster:
    """A `mooncake_master` on 127.0.0.1; kill() and start() again keep the same port,
    as a restarted master would (it comes back empty)."""

    def __init__(self, client_ttl_s: int = 2):
        self.exe = mooncake_master_exe()
        if self.exe is None:
            raise RuntimeError("mooncake_master is not installed (pip install -e '.[mooncake]')")
        self.dir = tempfile.mkdtemp(prefix="rkv-mc-")
        # All three chosen now and kept distinct: a metrics port drawn later could be the
        # RPC port just released, and the master then serves HTTP where RPC was expected.
        self.port = free_port()
        self.metrics_port = _another_port({self.port})
        self.http_port = _another_port({self.port, self.metrics_port})
        self.client_ttl_s = client_ttl_s
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "MooncakeMaster":
        log = open(os.path.join(self.dir, "master.log"), "ab")
        self.proc = subprocess.Popen(
            [self.exe, f"--rpc_port={self.port}", f"--metrics_port={self.metrics_port}",
             f"--http_metadata_server_port={self.http_port}", f"--client_ttl={self.client_ttl_s}",
             "--rpc_address=127.0.0.1", "--rpc_thread_num=2", "--enable_metric_reporting=false"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        try:
            poll(self._listening, START_TIMEOUT_S, f"mooncake_master on port {self.port}")
        except BaseException:
            self.kill()
            raise
        return self

    def _listening(self) -> bool:
        """The master answers an RPC on its port (a bare connect can succeed before it
        listens: a socket connected to itself)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {self.log_tail()}")
        return probe_master(self.address, 1.0) is None

    def kill(self) -> None:
        _stop(self.proc, signal.SIGKILL)
        self.proc = None

    def log_tail(self) -> str:
        with open(os.path.join(self.dir, "master.log"), "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def cleanup(self) -> None:
        """SIGKILL (a master takes a second to exit on SIGTERM, ~18 times a run; how it
        exits is not what any test looks at) and remove its directory."""
        _stop(self.proc, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


class Ticker:
    """A thread that notes the longest gap between its 10 ms ticks: how long every
    Python thread of this process was kept from running (a store call holding the GIL)."""

    def __init__(self):
        self.worst, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        last = time.monotonic()
        while not self._stop.wait(0.01):
            now = time.monotonic()
            self.worst, last = max(self.worst, now - last), now

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.worst


LENDER = r"""
import sys, time, numpy as np
from radixkv_server.storage.mooncake_store import MooncakeStorage
master, segment, n, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
b = MooncakeStorage(master, segment_bytes=segment, buffer_bytes=16 << 20, timeout=5)
pool = np.random.default_rng(seed).integers(0, 256, size=(max(n, 1), size), dtype=np.uint8)
b.attach_memory(pool.ctypes.data, pool.nbytes)
for attempt in range(100):  # joins the store (lending the segment); bounded
    try:
        b.check()
        break
    except Exception:
        if attempt == 99:
            raise
        time.sleep(0.1)
keys = [seed.to_bytes(4, "little") + i.to_bytes(28, "little") for i in range(n)]
stored = b.put([(k, memoryview(pool[i])) for i, k in enumerate(keys)])
print("READY", stored, flush=True)
sys.stdin.read()  # until the test closes stdin, or kills this process
b.close()
"""


class Lender:
    """Another node: a process that joins the store lending `segment` bytes and stores
    `n` pages of `size` random bytes (seeded; `pages()` rebuilds them) under keys
    `lender_keys(seed, n)`. kill() is SIGKILL; stop() closes it cleanly."""

    def __init__(self, master: str, segment: int, n: int, size: int, seed: int):
        self.n, self.size, self.seed = n, size, seed
        self.proc = subprocess.Popen([sys.executable, "-c", LENDER, master, str(segment), str(n), str(size), str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        line = self.proc.stdout.readline()  # bounded by the lender's own 5 s call timeout
        if not line.startswith("READY"):
            self.kill()
            raise RuntimeError(f"lender did not start: {line!r}")
        self.stored = int(line.split()[1])

    def keys(self) -> list[bytes]:
        return lender_keys(self.seed, self.n)

    def pages(self) -> list[bytes]:
        import numpy as np
        pool = np.random.default_rng(self.seed).integers(0, 256, size=(max(self.n, 1), self.size), dtype=np.uint8)
        return [pool[i].tobytes() for i in range(self.n)]

    def kill(self) -> None:
        _stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def lender_keys(seed: int, n: int) -> list[bytes]:
    return [seed.to_bytes(4, "little") + i.to_bytes(28, "little") for i in range(n)]


class _NodeExited(RuntimeError):
    pass


def _distinct_ports(n: int) -> list[int]:
    """n free ports, no two alike (a port drawn twice would start one node over another)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(span=10000)
        if port not in ports:
            ports.append(port)
    return ports


class RedisCluster:
    """`masters` redis-servers in cluster mode with `replicas` replicas each, on
    127.0.0.1, created with `redis-cli --cluster create`. node_timeout_ms is how long a
    master may be silent before its replica is promoted. With `tls` ({"ca", "cert",
    "key"}: PEM files), every node speaks TLS only, to clients and to the other nodes.
    `flavor` "valkey": valkey-server and valkey-cli instead (the same protocol and flags)."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000, tls: dict | None = None,
                 flavor: str = "redis"):
        self.server, self.cli = f"{flavor}-server", f"{flavor}-cli"
        for exe in (self.server, self.cli):
            if shutil.which(exe) is None:
                raise RuntimeError(f"{exe} is not installed (scripts/ensure-system-deps.sh)")
        self.dir = tempfile.mkdtemp(prefix="rkv-rc-")
        self.masters, self.replicas, self.node_timeout_ms, self.tls = masters, replicas, node_timeout_ms, tls
        self.ports = _distinct_ports(masters * (1 + replicas))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{p}" for p in self.ports[:self.masters])
        return f"rediss+cluster://{nodes}?ssl_ca_certs={self.tls['ca']}" if self.tls else f"redis+cluster://{nodes}"

    def start(self) -> "RedisCluster":
        """Start every node and form the cluster. A node that exits at once (a port taken
        by another process between choosing and binding it) gets the cluster started
        again on fresh ports, twice at most."""
        for attempt in range(3):
            try:
                return self._start()
            except _NodeExited as e:
                self._stop_nodes()
                if attempt == 2:
                    self.cleanup()
                    raise RuntimeError(str(e)) from None
                self.ports = _distinct_ports(len(self.ports))
            except BaseException:
                self.cleanup()  # no server outlives a failed start
                raise
        raise AssertionError("unreachable")

    def _stop_nodes(self) -> None:
        for proc in self.procs.values():
            _stop(proc, signal.SIGKILL)
        self.procs.clear()

    def _start(self) -> "RedisCluster":
        for port in self.ports:
            self._start_node(port)
        for port in self.ports:
            poll(lambda p=port: self._pings(p), START_TIMEOUT_S, f"{self.server} on {port}")
        if self.masters < 3:  # redis-cli creates clusters of 3 masters or more
            self._assign_slots()
        else:
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            extra = ["--cluster-replicas", str(self.replicas)] if self.replicas else []
            if self.tls:
                extra += ["--tls", "--cacert", self.tls["ca"]]
            subprocess.run([self.cli, "--cluster", "create", *nodes, *extra, "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
        self.wait_ok()
        # "ok" comes before gossip has told every node which ones became replicas
        poll(lambda: len(self.primaries()) == self.masters, START_TIMEOUT_S, f"{self.masters} masters in the view")
        poll(self._replicas_synced, START_TIMEOUT_S, "every replica in sync with its master")
        return self

    def _assign_slots(self) -> None:
        """A cluster of 1 or 2 masters (no replicas) made by hand: slots split evenly, MEET."""
        if self.replicas:
            raise ValueError("clusters of fewer than 3 masters are made without replicas here")
        step = 16384 // self.masters
        for i, port in enumerate(self.ports):
            with self.client(port) as c:
                last = 16383 if i == self.masters - 1 else (i + 1) * step - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
                for other in self.ports[:i]:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", other)

    def _replicas_synced(self) -> bool:
        for port in self.ports:
            try:
                with self.client(port) as c:
                    info = c.info("replication")
            except (redis.RedisError, OSError):
                return False
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def _start_node(self, port: int) -> None:
        log = open(os.path.join(self.dir, f"{port}.log"), "ab")
        listen = ["--port", str(port)]
        if self.tls:
            listen = ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
                      "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                      "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "no"]
        self.procs[port] = subprocess.Popen(
            [self.server, *listen, "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
             "--save", "", "--appendonly", "no", "--dir", self.dir,
             # replicas sync at once, and may take over however long they were cut off
             "--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def client(self, port: int) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": self.tls["ca"]} if self.tls else {}
        return redis.Redis("127.0.0.1", port, socket_timeout=2, **tls)

    def _pings(self, port: int) -> bool:
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is not None:
            with open(os.path.join(self.dir, f"{port}.log"), "rb") as f:
                tail = f.read()[-500:].decode(errors="replace")
            raise _NodeExited(f"{self.server} on {port} exited with {proc.returncode}: {tail}")
        try:
            with self.client(port) as c:
                return c.ping()
        except (redis.RedisError, OSError):
            return False

    def _info(self, port: int) -> dict:
        try:
            with self.client(port) as c:
                return c.cluster("info")
        except (redis.RedisError, OSError):
            return {}

    def wait_ok(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every live node reports cluster_state:ok with all slots assigned."""
        live = [p for p, proc in self.procs.items() if proc.poll() is None]
        poll(lambda: all(self._info(p).get("cluster_state") == "ok" for p in live), timeout, "cluster_state ok")

    def primaries(self) -> list[int]:
        """Ports of the live masters, from a live node's view."""
        for port, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    with self.client(port) as c:
                        nodes = c.cluster("nodes")
                    return sorted(int(addr.split(":")[1].split("@")[0]) for addr, n in nodes.items()
                                  if "master" in n["flags"] and "fail" not in n["flags"] and n["connected"])
                except (redis.RedisError, OSError):
                    continue
        return []

    def kill(self, port: int) -> None:
        _stop(self.procs[port], signal.SIGKILL)

    def set_all(self, *args) -> None:
        """CONFIG SET on every live node."""
        for port, proc in self.procs.items():
            if proc.poll() is None:
                with self.client(port) as c:
                    c.config_set(*args)

    def cleanup(self) -> None:
        for proc in self.procs.values():
            _stop(proc)
        shutil.rmtree(self.dir, ignore_errors=True)
