"""Timeouts for a slow, stuck or vanished engine: leases held past `lease_timeout`,
load-backs (and an engine-managed namespace's asynchronous saves) left unacknowledged
past `ack_timeout`, and sessions that never opened a stream and made no call for
`idle_session_timeout` (each 0 = off).

A stream's end closes its session, so a dead engine's session goes with its stream; an
engine that died between Register's answer and opening its stream left a session that
nothing would close, holding its namespace (and the engine's device buffers) and a
place under `--max-sessions`. Such a session is closed as a Close would close it, with
the reason its later calls are told (`session.expired`, WARNING; Stats counter
`sessions_expired`; metric kind "session").

Each is released or finished exactly as closing its session would release or finish
it, logged (`lease.expired`, `load_back.expired`, `save.expired`), counted (Stats
counters `leases_expired` / `load_backs_expired` / `saves_expired`, metric
`radixkv_expirations_total`) and remembered, so the engine's later Release or ack gets
NOT_FOUND saying it expired. The session itself lives on, and nothing else waits for
the stuck engine.

An expired transfer is finished once its copy completed; what became of it is then told
to the engine, so no page is lost on either side: an AckResponse with `expired` set
(NOT_FOUND) is pushed at once on the session's ack stream (`unsolicited`), and answers
its late ack. A load-back's says `load_failed` (its tokens count as not loaded; when its
copy failed, `failed_pages` are the engine's again, the others stay with the cache); an
engine-managed save's says whether its pages were stored.
"""

import asyncio
import logging
import time
from dataclasses import dataclass

from ..core.transfers import TransferKind
from ..logs import log_event

log = logging.getLogger("radixkv.expiry")


class Expiry:
    def __init__(self, daemon):
        self.daemon = daemon
        self.lease_timeout = daemon.config.lease_timeout
        self.ack_timeout = daemon.config.ack_timeout
        self.idle_session_timeout = daemon.config.idle_session_timeout
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Check while any timeout is on: a few times per lease or ack timeout (at least
        once a second), ten times per idle-session timeout (an idle daemon on the
        defaults wakes every 30 s, not every second)."""
        periods = [min(1.0, t / 4) for t in (self.lease_timeout, self.ack_timeout) if t > 0]
        if self.idle_session_timeout > 0:
            periods.append(self.idle_session_timeout / 10)
        if periods and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(max(0.02, min(periods))))

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
                log.exception("expiring leases, load-backs and idle sessions failed")

    def expire(self, now: float) -> None:
        """Release the overdue leases and finish the overdue load-backs of every session;
        close the sessions idle with no stream."""
        for session in self.daemon.sessions.all():
            if session.closing:
                continue  # its close releases everything anyway
            ns = session.namespace
            if self.idle_session_timeout and session.idle_without_stream(now) > self.idle_session_timeout:
                self._count(session, "session")
                reason = (f"expired: no Acks or Session stream opened and no call for "
                          f"{self.idle_session_timeout:g}s (--idle-session-timeout)")
                log_event(log, "session.expired", logging.WARNING, namespace=ns.name, session=session.id[:8],
                          engine=session.engine, reason=reason)
                self.daemon.close_in_background(session, reason)
                continue
            if self.lease_timeout:
                for lease in session.overdue_leases(now, self.lease_timeout):
                    ns.release(session, [lease])
                    self._expired(session, "lease", lease,
                                  f"expired: held longer than --lease-timeout={self.lease_timeout:g}s")
            if self.ack_timeout:
                for tid in session.overdue_loads(now, self.ack_timeout):
                    session.acked(tid)
                    transfer = ns.cache.transfers.get(tid)
                    if transfer is None:
                        continue
                    kind = "save" if transfer.kind is TransferKind.SAVE else "load_back"
                    meaning = ("the daemon finished the save itself" if kind == "save"
                               else "treat its tokens as not loaded")
                    self._expired(session, kind, tid, f"expired: not acknowledged within "
                                  f"--ack-timeout={self.ack_timeout:g}s; {meaning}", key="transfer")
                    self.daemon.run_in_background(self._finish(session, tid, transfer.kind))

    @staticmethod
    async def _finish(session, transfer: int, kind: TransferKind) -> None:
        """As a close does: once the copy completed; then tell the engine. An ack that
        raced the expiry and finished it first got the answer itself."""
        result = await session.namespace.finish(transfer, None, missing_ok=True)
        if result is None:
            return
        why = session.expired_reason("transfer", transfer) or "expired"
        session.finished_expired(transfer, expired_outcome(kind, why, result))
        if result.error is not None:
            event = "save.expired_failed" if kind is TransferKind.SAVE else "load_back.expired_failed"
            log_event(log, event, logging.WARNING, namespace=session.namespace.name,
                      session=session.id[:8], id=transfer, reason=result.error,
                      pages_returned=len(result.failed_pages) // 4)

    def _expired(self, session, kind: str, ident: int, why: str, key: str = "") -> None:
        session.remember_expired(key or kind, ident, why)
        self._count(session, kind)
        log_event(log, f"{kind}.expired", logging.WARNING, namespace=session.namespace.name,
                  session=session.id[:8], id=ident, engine=session.engine)

    def _count(self, session, kind: str) -> None:
        session.namespace.expirations[kind] += 1
        metrics = self.daemon.metrics
        if metrics is not None:
            metrics.expirations.labels(session.namespace.name, kind).inc()


@dataclass(frozen=True, slots=True)
class ExpiredTransfer:
    """What the engine is told of a transfer the daemon finished at its ack_timeout.
    `message`: why, and what became of it; `load_failed`: its tokens count as not loaded
    (a load); `failed_pages`: device pages that are the engine's again (a managed
    namespace's load whose copy failed)."""

    message: str
    load_failed: bool
    failed_pages: bytes


def expired_outcome(kind: TransferKind, why: str, result) -> ExpiredTransfer:
    """The answer for an expired transfer of `kind` finished with `result` (FinishResult)."""
    failed = f"; its copy failed ({result.error})" if result.error is not None else ""
    if kind is TransferKind.SAVE:
        fate = f"{failed}: nothing of it is stored" if failed else "; its pages were stored"
        return ExpiredTransfer(why + fate, False, b"")
    if kind is TransferKind.ENGINE_LOAD:  # the engine's pages are its own either way
        return ExpiredTransfer(why + failed, True, b"")
    pages = result.failed_pages
    fate = (f"{failed}: its {len(pages) // 4} device pages are the engine's again" if failed
            else "; its device pages stay with the cache")
    return ExpiredTransfer(why + fate, True, pages)
