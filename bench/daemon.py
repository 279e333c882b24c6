"""A real radixkv daemon subprocess for the RPC-level sections, and engine-side helpers."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.v1 import radixkv_pb2 as pb

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """`python -m radixkv_server` on a temporary unix socket (and, with `tcp`, on
    127.0.0.1:<free port>). Use as a context manager; logs go to `log_path`."""

    def __init__(self, *flags: str, tcp: bool = False, workdir: str | None = None,
                 cpus: set[int] | None = None):
        """`cpus`: run the daemon (every thread of it) on these cores only."""
        self.dir = workdir or tempfile.mkdtemp(prefix="rkv-bench-")
        self._own_dir = workdir is None
        self.unix = f"unix://{os.path.join(self.dir, 'radixkv.sock')}"
        self.tcp = f"127.0.0.1:{free_port()}" if tcp else None
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.flags = ("--metrics-port", "0", "--log-level", "warning", *flags)
        self.proc: subprocess.Popen | None = None
        self.cpus = cpus

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "DaemonProcess":
        listen = ["--listen", self.unix] + (["--listen", self.tcp] if self.tcp else [])
        with open(self.log_path, "ab") as log:
            pin = (lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None
            self.proc = subprocess.Popen([sys.executable, "-m", "radixkv_server", *listen, *self.flags],
                                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin)
        deadline = time.monotonic() + READY_TIMEOUT_S
        with grpc.insecure_channel(self.unix) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    r = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"daemon not ready after {READY_TIMEOUT_S}s:\n{self.log()}")
                time.sleep(0.05)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> int:
        """SIGTERM, then kill after 30 s; the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                  ("grpc.max_send_message_length", 64 << 20)])


def layout_pb(layout) -> pb.KvLayout:
    return pb.KvLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim, dtype=layout.dtype, page_size=layout.page_size,
                       kv_format=layout.kv_format)


def register(stub, namespace: str, layout, buffers, num_pages: int, **fields) -> pb.RegisterResponse:
    """Register `buffers` (a ShmKvBuffers) under `namespace` with the raw stub."""
    return stub.Register(pb.RegisterRequest(
        namespace=namespace, layout=layout_pb(layout), backend="shm",
        buffers=[pb.DeviceBuffer(handle=s.handle, offset=s.offset, size=s.size) for s in buffers.specs()],
        num_device_pages=num_pages, engine="radixkv bench", **fields))


class AckChannel:
    """The session's Acks stream, one ack at a time: `ack(t)` returns the daemon's answer."""

    def __init__(self, stub, session: str):
        import queue
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._session = session
        self._call = stub.Acks(iter(self._q.get, None))
        self._first = True

    def ack(self, transfer: int) -> pb.AckResponse:
        self._q.put(pb.AckRequest(session=self._session if self._first else "", transfer=transfer))
        self._first = False
        return next(self._call)

    def close(self) -> None:
        self._q.put(None)
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass
