"""SIGTERM while engines are busy: a clean exit, in the documented order, with the
engines' shared memory untouched."""

import json
import os
import threading
import time

import grpc
from tests.support.daemon import wait_for

from rawengine import RawEngine

WORKERS = 4
GRACE_S = 10.0  # --shutdown-grace, the default
WARMUP_CYCLES = 5
# What an engine may see once the daemon is stopping: UNAVAILABLE (refused, or the server
# gone), CANCELLED (a call cut at the end of the grace period), UNAUTHENTICATED (its
# session already closed by the shutdown).
SHUTDOWN_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAUTHENTICATED}


class Worker(threading.Thread):
    """One engine looping insert / evict / match / load-back + ack until the daemon goes."""

    def __init__(self, target: str, index: int):
        super().__init__(daemon=True)
        self.engine = RawEngine(target, f"ops/load-{index}", num_pages=96, host_pool_pages=128)
        self.cycles = 0
        self.error: BaseException | None = None
        self.error_at = 0.0

    def run(self) -> None:
        try:
            while True:
                assert self.engine.cycle(16) == 16
                self.engine.match(list(range(64)))
                self.cycles += 1
        except BaseException as e:  # the daemon stopping ends every worker
            self.error, self.error_at = e, time.monotonic()


def events(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.strip()]


def test_sigterm_under_load_exits_cleanly_in_order(daemon_factory):
    daemon = daemon_factory("--log-format", "json")
    workers = [Worker(daemon.target, i) for i in range(WORKERS)]
    for w in workers:
        w.start()
    wait_for(lambda: all(w.cycles >= WARMUP_CYCLES for w in workers) or any(w.error for w in workers),
             30, f"{WARMUP_CYCLES} cycles on each of {WORKERS} engines")
    assert not any(w.error for w in workers), [repr(w.error) for w in workers if w.error]

    sigterm_at = time.monotonic()
    daemon.signal()
    code = daemon.wait()
    stopped_in = time.monotonic() - sigterm_at
    for w in workers:
        w.join(30)
        assert not w.is_alive(), "an engine thread hung after the daemon exited"
    report = "\n".join([f"exit {code} after {stopped_in:.2f}s"] + [
        f"worker {i}: {w.cycles} cycles, stopped {w.error_at - sigterm_at:+.2f}s by {w.error!r}"
        for i, w in enumerate(workers)] + daemon.log().splitlines()[-30:])
    assert code == 0, report
    # Nothing in flight may hold the shutdown for the whole grace period (10 s).
    assert stopped_in < GRACE_S * 0.8, report

    # Every engine stopped because of the shutdown, not before it, and with a shutdown's error.
    for w in workers:
        assert w.error is not None and w.error_at >= sigterm_at, report
        if isinstance(w.error, grpc.RpcError):
            assert w.error.code() in SHUTDOWN_CODES, report
        else:  # its ack stream ended under a waiting ack
            assert isinstance(w.error, ConnectionError), report

    assert not os.path.exists(daemon.socket), "the socket file was left behind"
    log = daemon.log()
    assert "Traceback" not in log
    with open(daemon.out_path) as f:
        assert f.read() == ""
    lines = events(log)
    assert all(e["level"] in ("info", "debug") for e in lines), [e for e in lines if e["level"] not in ("info",)]
    names = [e["event"] for e in lines]
    steps = ["daemon.stopping", "daemon.drained", "grpc.stopped", "daemon.stopped"]
    assert all(names.count(s) == 1 for s in steps), names
    positions = [names.index(s) for s in steps]
    assert positions == sorted(positions), f"shutdown steps out of order: {names[positions[0]:]}"
    assert names[-1] == "daemon.stopped"
    # Each session registered was closed exactly once, during the shutdown.
    closed = [e for e in lines if e["event"] == "session.closed"]
    assert sorted(e["namespace"] for e in closed) == sorted(f"ops/load-{i}" for i in range(WORKERS))
    assert all(names.index("daemon.stopping") < i for i, n in enumerate(names) if n == "session.closed")

    # The engines' KV memory is theirs and intact: segments present, untouched bytes unchanged.
    for w in workers:
        assert os.path.exists(f"/dev/shm/{w.engine.device.shm_name}")
        assert w.engine.sentinel_intact()
        w.engine.channel.close()
        w.engine.release_memory()
        assert not os.path.exists(f"/dev/shm/{w.engine.device.shm_name}")


def test_a_second_signal_as_the_daemon_exits_changes_nothing(daemon_factory):
    """operations.md: a second SIGTERM while stopping changes nothing, and the exit code
    is 0. One that lands after `daemon.stopped`, while the interpreter winds down (about
    0.2 s of torch's teardown), killed the process by the signal (exit 143)."""
    daemon = daemon_factory()
    daemon.signal()
    wait_for(lambda: "daemon.stopped" in daemon.log(), 30, "the daemon's stop")
    daemon.signal()
    assert daemon.wait() == 0
