"""A Mooncake master that accepts connections but does not answer (stopped, hung,
overloaded) never freezes the daemon that joins it: the store client's join holds the
GIL while it waits (~60 s), so the daemon asks the master an RPC of its own first. Health
answers throughout, and the storage tier comes up by itself once the master answers
again, without a restart."""

import os
import signal
import time

from tests.storage.fleet import MooncakeMaster
from tests.support.daemon import DaemonProcess, health_status, wait_for
from tests.support.engine import PS, EngineDouble, prompt

ANSWER_BOUND_S = 10.0  # a health check or Match on a busy 2-core machine (well under); a frozen daemon took ~60 s
CHECK_S = 1.0         # --storage-check-interval: the storage check tries to join every second
FROZEN_S = 3.0        # at least two tries meanwhile
DEADLINE_S = 30.0


def slowest_health(d: DaemonProcess, seconds: float) -> float:
    """Ask health every 0.2 s for `seconds`; the slowest answer (every one SERVING)."""
    worst, deadline = 0.0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.monotonic()
        assert health_status(d.target, "", timeout=5.0) == "SERVING"
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.2)
    return worst


def test_a_frozen_master_never_freezes_the_daemon_and_storage_comes_up_once_it_answers():
    m = MooncakeMaster(client_ttl_s=2)  # not started: the daemon starts without its master
    d = DaemonProcess("--storage", f"mooncake://{m.address}?segment=32MiB&buffer=16MiB&timeout=1",
                      "--storage-policy", "write_through", "--storage-check-interval", str(CHECK_S), metrics=True)
    engine = None
    try:
        d.start()
        wait_for(lambda: "storage.unavailable" in d.log(), DEADLINE_S, "the start's storage check")
        engine = EngineDouble.connect(d.target)
        m.start()
        os.kill(m.proc.pid, signal.SIGSTOP)  # listening, answering nothing
        assert slowest_health(d, FROZEN_S) < ANSWER_BOUND_S
        said = [line for line in d.log().splitlines() if "storage.master_unreachable" in line]
        assert any("did not answer within" in line and m.address in line for line in said)
        assert "radixkv_storage_up 0.0" in d.scrape()

        os.kill(m.proc.pid, signal.SIGCONT)  # the storage check joins within a second
        wait_for(lambda: "radixkv_storage_up 1.0" in d.scrape(), DEADLINE_S, "storage up once the master answers",
                 interval=0.5)
        engine.prefill(prompt(1))
        wait_for(lambda: engine.counters()["stored_tokens"] >= 8 * PS, DEADLINE_S, "the prefix stored")
        assert engine.client.match([prompt(1)], include_storage=True)[0].device_tokens == 8 * PS
    finally:
        if m.proc is not None:
            os.kill(m.proc.pid, signal.SIGCONT)
        if engine is not None:
            engine.close()
        if d.alive:
            assert d.stop() == 0
        log = d.log()
        print("\n".join(line for line in log.splitlines() if "event=storage" in line))  # shown on failure
        d.cleanup()
        m.cleanup()
    assert "Traceback" not in log
