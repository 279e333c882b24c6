"""gRPC health as probes and load balancers see it: liveness ("") and readiness
("radixkv.v1.RadixKV") SERVING while up, NOT_SERVING as soon as shutdown begins (seen
by polling while copies in flight hold the shutdown, and by Watch streams), and
watchers let go so they do not hold the shutdown for the grace period."""

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import READINESS, STOP_TIMEOUT_S, health_status, wait_for

from rawengine import LAYOUT, PAGE_SIZE, RawEngine, fresh_tokens

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Far past the 30 s that `DaemonProcess.wait` allows: a shutdown that waited for the
# grace period fails that wait instead of passing slowly.
GRACE_S = 300.0


class Watcher(threading.Thread):
    """Collects the statuses one health Watch stream delivers, until it ends."""

    def __init__(self, target: str, service: str):
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(target)
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=service))
        self.statuses: list[int] = []
        self.ended_with: grpc.StatusCode | None = None

    def run(self) -> None:
        try:
            for reply in self.call:
                self.statuses.append(reply.status)
            self.ended_with = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.ended_with = e.code()


def test_liveness_and_readiness_serving_while_up(daemon):
    assert health_status(daemon.target, "") == "SERVING"
    assert health_status(daemon.target, READINESS) == "SERVING"
    engine = RawEngine(daemon.target, "ops/health")
    try:
        engine.cycle(16)
        assert health_status(daemon.target, READINESS) == "SERVING"  # busy is still ready
        engine.close()
    finally:
        engine.release_memory()
    assert health_status(daemon.target, "unknown.Service").startswith("UNREACHABLE:NOT_FOUND")


def register_request(namespace: str) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        namespace=namespace, backend="shm", num_device_pages=8,
        layout=pb.KvLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                           head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, page_size=PAGE_SIZE))


def test_readiness_polls_not_serving_while_copies_hold_the_shutdown(daemon_factory):
    # Every copy waits 8 s before it starts: a write-through backup keeps the shutdown
    # in its "drain copies" step long enough to poll and to try a registration, on a
    # loaded machine too.
    daemon = daemon_factory("--fault-copy-delay", "8.0")
    engine = RawEngine(daemon.target, "ops/held", write_policy="write_through")
    try:
        engine.insert(fresh_tokens(16))  # returns at once; its backup copy is in flight
        daemon.signal()
        seen = []

        def stopping() -> bool:
            status = health_status(daemon.target, READINESS)
            seen.append(status)
            assert not status.startswith("UNREACHABLE"), f"daemon gone before NOT_SERVING was seen: {seen}"
            return status == "NOT_SERVING"

        wait_for(stopping, 10, "readiness NOT_SERVING")
        assert health_status(daemon.target, "") == "NOT_SERVING"
        # Still up, draining copies, and refusing new engines with a reason.
        with pytest.raises(grpc.RpcError) as refused:
            engine.stub.Register(register_request("ops/too-late"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "shutting down" in refused.value.details(), refused.value
        assert daemon.wait() == 0
        names = [line.split("event=")[1].split()[0] for line in daemon.log().splitlines()]
        assert names.index("daemon.stopping") < names.index("daemon.drained") < names.index("daemon.stopped")
    finally:
        engine.channel.close()
        engine.release_memory()


def test_shutdown_turns_health_not_serving_and_ends_watches(daemon_factory):
    daemon = daemon_factory("--shutdown-grace", str(GRACE_S))
    watchers = [Watcher(daemon.target, s) for s in ("", READINESS)]
    for w in watchers:
        w.start()
    wait_for(lambda: all(w.statuses == [SERVING] for w in watchers), 10, "both watches to report SERVING")
    engine = RawEngine(daemon.target, "ops/health-stop")  # a live session when shutdown begins
    try:
        daemon.signal()
        wait_for(lambda: all(NOT_SERVING in w.statuses for w in watchers), 10,
                 "both watches to report NOT_SERVING")
        with pytest.raises(grpc.RpcError) as refused:  # by the daemon, or a server no longer taking calls
            engine.stub.Register(register_request("ops/too-late"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        # The watches end by themselves (OK) instead of holding server.stop() for the grace.
        for w in watchers:
            w.join(10)
            assert not w.is_alive(), "a health Watch stream outlived the shutdown"
            assert w.statuses == [SERVING, NOT_SERVING] and w.ended_with == grpc.StatusCode.OK, (
                w.statuses, w.ended_with)
        assert daemon.wait(STOP_TIMEOUT_S) == 0  # fails (and kills it) if held for the grace
    finally:
        for w in watchers:
            w.channel.close()
        engine.channel.close()
        engine.release_memory()


def test_the_health_command_takes_a_bare_socket_path_and_names_an_unknown_service(daemon):
    """`radixkv-health` as probes run it: a socket given as a bare path (grpcurl's form;
    it was read as a host name), an unknown service said to be unknown by a daemon that
    answered (it said UNREACHABLE), and its version."""
    import subprocess
    import sys

    def health(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "radixkv_server.healthcheck", *args],
                              capture_output=True, text=True, timeout=60)

    path = daemon.target.removeprefix("unix://")
    ready = health("--address", path)
    assert ready.returncode == 0 and ready.stdout.strip() == f"{path} {READINESS}: SERVING", ready.stdout + ready.stderr
    unknown = health("--address", path, "--service", "bogus")
    assert unknown.returncode == 1 and "bogus: UNKNOWN SERVICE" in unknown.stdout, unknown.stdout
    from radixkv_server import __version__
    assert health("--version").stdout.strip() == f"radixkv-health {__version__}"


def test_the_health_command_loads_no_heavy_module():
    """A probe runs every few seconds: `radixkv-health` loads gRPC and its own module, not
    torch, numpy or zmq (a settings check the daemon's config gained made it load the
    KV-event package: its start went from 0.16 to 0.25 s)."""
    import subprocess
    import sys

    code = ("import sys, radixkv_server.healthcheck; "
            "print(sorted(m for m in ('torch', 'numpy', 'zmq', 'radixkv_server.config') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr
