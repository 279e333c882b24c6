"""Timeouts for a slow or stuck engine: leases held past `lease_timeout` and load-backs
left unacknowledged past `ack_timeout` (0 = off).

Each is released or finished exactly as closing its session would release or finish
it, logged (`lease.expired`, `load_back.expired`), counted (Stats counters
`leases_expired` / `load_backs_expired`, metric `radixkv_expirations_total`) and
remembered, so the engine's later Release or ack gets NOT_FOUND saying it expired. The
session itself lives on, and nothing else waits for the stuck engine.

An expired load-back is finished once its copy completed; what that means for the
engine's device pages is then told to the engine, so no page is lost on either side:
an AckResponse with `expired` set (NOT_FOUND, `load_failed`; `failed_pages` when the
copy failed: those pages are the engine's again, the others stay with the cache) is
pushed at once on the session's ack stream (`unsolicited`), and answers its late ack.
"""

import asyncio
import logging
import time

from ..logs import log_event

log = logging.getLogger("radixkv.expiry")


class Expiry:
    def __init__(self, daemon):
        self.daemon = daemon
        self.lease_timeout = daemon.config.lease_timeout
        self.ack_timeout = daemon.config.ack_timeout
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Check a few times per timeout (at least once a second) while either is on."""
        timeouts = [t for t in (self.lease_timeout, self.ack_timeout) if t > 0]
        if timeouts and self._task is None:
            period = min(1.0, max(0.02, min(timeouts) / 4))
            self._task = asyncio.get_running_loop().create_task(self._run(period))

    async def stop(self) -> None:
        """Idempotent."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                self.expire(time.monotonic())
            except Exception:  # a bug; the daemon must keep serving
                log.exception("expiring leases and load-backs failed")

    def expire(self, now: float) -> None:
        """Release the overdue leases and finish the overdue load-backs of every session."""
        for session in self.daemon.sessions.all():
            if session.closing:
                continue  # its close releases everything anyway
            ns = session.namespace
            if self.lease_timeout:
                for lease in session.overdue_leases(now, self.lease_timeout):
                    ns.release(session, [lease])
                    self._expired(session, "lease", lease,
                                  f"expired: held longer than lease_timeout={self.lease_timeout:g}s")
            if self.ack_timeout:
                for tid in session.overdue_loads(now, self.ack_timeout):
                    session.acked(tid)
                    if not ns.has_transfer(tid):
                        continue
                    self._expired(session, "load_back", tid,
                                  f"expired: not acknowledged within ack_timeout={self.ack_timeout:g}s; "
                                  "treat its tokens as not loaded")
                    self.daemon.run_in_background(self._finish_load(session, tid))

    @staticmethod
    async def _finish_load(session, transfer: int) -> None:
        """As a close does: once the copy completed; then tell the engine. An ack that
        raced the expiry and finished it first got the answer itself."""
        result = await session.namespace.finish(transfer, None, missing_ok=True)
        if result is not None:
            session.finished_expired_load(transfer, result)
            if result.error is not None:
                log_event(log, "load_back.expired_failed", logging.WARNING, namespace=session.namespace.name,
                          session=session.id[:8], id=transfer, reason=result.error,
                          pages_returned=len(result.failed_pages) // 4)

    def _expired(self, session, kind: str, ident: int, why: str) -> None:
        session.remember_expired(kind, ident, why)
        session.namespace.expirations[kind] += 1
        metrics = self.daemon.metrics
        if metrics is not None:
            metrics.expirations.labels(session.namespace.name, kind).inc()
        log_event(log, f"{kind}.expired", logging.WARNING, namespace=session.namespace.name,
                  session=session.id[:8], id=ident, engine=session.engine)
