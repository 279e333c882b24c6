"""Namespaces no engine is attached to, dropped to make room for a new one.

A namespace outlives its engines: its host tier stays warm for the model's next
engine. Under churn (a model retired without DropNamespace, replicas each with a name
of their own, an engine reconfigured onto a new name, a tenant that left) the
namespaces whose engines went keep their places under --max-namespaces and their
whole host pools under the host memory budget for good, and every new namespace is
refused until an operator drops them by hand. So when a new namespace's Register is
refused for either limit, the daemon drops the namespace detached the longest, one at
a time until the newcomer fits, among those detached for at least
--reclaim-detached-after seconds (an engine restarting keeps its namespace warm); its
host KV is lost (a storage tier keeps what it holds). 0 turns it off. A Register past
its tenant's quota (token_file.py) makes room the same way among that tenant's own
namespaces only.

`DetachedSince` only remembers when each namespace lost its last session; the daemon
decides (`admission.admit`), holding the newcomer's lock. A namespace another change holds
or waits for (a Register, a DropNamespace: namespace_locks.py) is never taken.
"""

from __future__ import annotations

import logging
import time

from ..logs import log_event
from . import reasons

log = logging.getLogger("radixkv.daemon")

QUOTAS = ("namespaces=", "host=")  # a tenant's quota (token_file.py): room made among its own namespaces


class DetachedSince:
    """When each namespace's last session ended (monotonic seconds). A namespace is
    detached while no session, live or closing, is attached to it: a mark older than a
    later attachment is ignored by `oldest` (the caller passes who is attached), and
    renewed when that session ends in turn."""

    def __init__(self):
        self._since: dict[str, float] = {}

    def mark(self, name: str, now: float) -> None:
        """Namespace `name` has no session from `now` on."""
        self._since[name] = now

    def forget(self, name: str) -> None:
        """`name` was dropped."""
        self._since.pop(name, None)

    def seconds(self, name: str, attached: set[str], now: float) -> float | None:
        """How long `name` has been detached; None while attached (or never marked)."""
        since = self._since.get(name)
        return None if since is None or name in attached else now - since

    def oldest(self, names, attached: set[str], now: float, grace: float, keep: str = "") -> str | None:
        """Of `names`, the one detached longest, for at least `grace` seconds; None when
        none is (`grace` 0: reclaiming is off). Never `keep` (the newcomer's own name)."""
        if grace <= 0:
            return None
        best, best_since = None, now - grace
        for name in names:
            since = self._since.get(name)
            if since is not None and since <= best_since and name not in attached and name != keep:
                best, best_since = name, since
        return best


async def make_room(daemon, refused, reg) -> bool:
    """After `refused` (a ServiceError of the daemon's limits) for the Register `reg` of
    a new namespace: when it is a refusal for room (--max-namespaces, the host memory
    budget; or its tenant's quota, `namespaces=` or `host=`: then among the tenant's own),
    drop the namespace detached longest, logged and counted; False when `refused` is
    another refusal or none may go. Holding `reg.namespace`'s lock; the one dropped is
    one no other change holds or waits for, so its lock is taken at once."""
    limit = refused.metadata.get("limit")
    if refused.reason != reasons.HOST_MEMORY_BUDGET and limit not in ("--max-namespaces", *QUOTAS):
        return False
    newcomer, now = reg.namespace, time.monotonic()
    attached = {s.namespace.name for s in daemon.sessions.all()}
    free = [name for name, ns in daemon.namespaces.items()
            if not daemon.locks.busy(name) and (limit not in QUOTAS or ns.owner == reg.owner)]
    name = daemon.detached.oldest(free, attached, now, daemon.config.reclaim_detached_after, keep=newcomer)
    if name is None:
        return False
    detached = daemon.detached.seconds(name, attached, now)
    async with daemon.locks.hold(name):  # free: taken without waiting
        dropped = await daemon.forget_namespace(daemon.namespaces[name], store=False)
    log_event(log, "namespace.reclaimed", logging.WARNING, namespace=name, for_namespace=newcomer,
              detached_seconds=round(detached, 1), host_tokens=dropped.host_tokens,
              freed_host_bytes=dropped.freed_host_bytes)
    if daemon.metrics is not None:
        daemon.metrics.namespaces_reclaimed.inc()
    return True
