"""Which of gRPC's two I/O layers the daemon uses: gRPC makes the choice once, when it is
first imported, from the environment variable GRPC_EXPERIMENTS.

gRPC (1.85) moves bytes through its EventEngine by default, which reads and writes on
threads of its own and hands every message over to the thread that waits for it; its
older polling I/O (iomgr) reads on that thread itself. With the daemon's listener on the
polling I/O, the daemon's CPU per engine step fell by a fifth here (8 engines, unary and
Session stream alike; docs/performance.md, 2026-12-04 evening), and every call is quicker.

Only the daemon's process asks for it (`radixkv_server.cli` runs `prefer_polling_io()`
before anything there imports gRPC); engines keep gRPC's default. With the clients on the
polling I/O too, calls were quicker still, but the chaos test's engines came back from
daemon restarts seconds late: on the polling I/O a channel's reconnect timers run only
while some thread polls it, and a blocking client whose calls fail fast leaves that to
gRPC's backup poller, every 5 s (GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS=100 made the
test pass). The EventEngine runs those timers on threads of its own.
A GRPC_EXPERIMENTS set in the daemon's environment, even empty, is left as it is.
"""

import os
import sys

POLLING_IO = "-event_engine_client,-event_engine_listener"


def prefer_polling_io() -> bool:
    """Ask for gRPC's polling I/O unless the environment decides or gRPC is imported
    already (too late); True if this call set GRPC_EXPERIMENTS."""
    if "GRPC_EXPERIMENTS" in os.environ or "grpc" in sys.modules:
        return False
    os.environ["GRPC_EXPERIMENTS"] = POLLING_IO
    return True


def polling_io_in_effect() -> bool:
    """Whether GRPC_EXPERIMENTS asks for the polling I/O (as gRPC read it, when it was
    set before gRPC's import)."""
    asked = {e.strip() for e in os.environ.get("GRPC_EXPERIMENTS", "").split(",")}
    return set(POLLING_IO.split(",")) <= asked


__all__ = ["POLLING_IO", "polling_io_in_effect", "prefer_polling_io"]
