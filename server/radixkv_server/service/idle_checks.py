"""Invariant checks while the daemon is idle (`--invariant-check-interval`, 0 = off).

Every interval, once no engine call has been answered for `IDLE_S`, every namespace's
invariants are checked (`Daemon.check_invariants`, as the CheckInvariants RPC does): each
violation is logged (`invariants.violated`, ERROR) and counted in
`radixkv_invariant_violations_total`, so the alert on it sees a broken daemon without an
operator calling the RPC. A check walks every node of every tree on the event loop (tens
of milliseconds at a million cached pages), which is why it waits for a quiet moment; a
daemon never idle for `IDLE_S` is never checked.
"""

import asyncio
import logging
import time

from ..logs import log_event

log = logging.getLogger("radixkv.invariants")

IDLE_S = 1.0  # no engine call answered for this long: the daemon counts as idle


class IdleChecks:
    def __init__(self, daemon):
        self.daemon = daemon
        self.interval = daemon.config.invariant_check_interval
        self.runs = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Idempotent."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            while (idle := time.monotonic() - self.daemon.last_call) < IDLE_S:
                await asyncio.sleep(IDLE_S - idle)
            try:
                self.check()
            except Exception:  # a bug; the daemon must keep serving
                log.exception("checking invariants failed")

    def check(self) -> None:
        """Check every namespace now; log each violation."""
        start = time.perf_counter()
        violations = self.daemon.check_invariants("")
        self.runs += 1
        for v in violations:
            log_event(log, "invariants.violated", logging.ERROR, namespace=v.namespace, violation=v.message)
        log_event(log, "invariants.checked", logging.DEBUG, namespaces=len(self.daemon.namespaces),
                  violations=len(violations), seconds=round(time.perf_counter() - start, 4))


__all__ = ["IDLE_S", "IdleChecks"]
