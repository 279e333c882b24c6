"""Whether a Register fits the daemon's limits: --max-namespaces, --max-sessions and
the host memory budget (host_budget.py), for both kinds of namespace.

The check runs between awaits on the daemon's loop, holding only the registering
namespace's lock, while other namespaces' changes are under way: so it counts, besides
the registry, the room those changes hold (namespace_locks.py), and reserves its own.
"""

from __future__ import annotations

from . import host_budget, namespace_reclaim, reasons, registration
from .errors import ServiceError, exhausted


async def admit(daemon, reg: registration.Registration, ns, replacing: int = 0):
    """The daemon's limits for a Register joining namespace `ns` (None: creating it),
    checked before anything is taken: the namespace and session limits (the
    `replacing` sessions it replaces free their places) and, for a new namespace, the
    host memory budget its whole host pool counts against. A new namespace past the
    namespace limit or the budget drops the namespaces detached longest first
    (namespace_reclaim.py) until it fits. RESOURCE_EXHAUSTED past one still. Returns
    the new namespace's config; None when joining. What it admits (the session, a new
    pool) stays reserved until made (`Daemon.new_session`, `Daemon.add_namespace`) or
    the change ends. Call holding `reg.namespace`'s lock."""
    while True:
        try:
            config = _check_limits(daemon, reg, ns, replacing)
        except ServiceError as e:
            if ns is not None or not await namespace_reclaim.make_room(daemon, e, reg.namespace):
                raise
            continue
        daemon.locks.reserve(reg.namespace, session=True,
                             host_bytes=None if config is None else config.host_pages * config.host_layout.page_bytes)
        return config


def _check_limits(daemon, reg: registration.Registration, ns, replacing: int):
    limits = daemon.config
    pools = daemon.locks.pools()  # namespaces made or freed meanwhile (by other names: this one's lock is held)
    if ns is None and len(daemon.namespaces) + len(pools) >= limits.max_namespaces:
        raise exhausted(f"namespace limit reached ({limits.max_namespaces}), none of them detached for "
                        f"--reclaim-detached-after ({limits.reclaim_detached_after:g}s) to drop for this "
                        "one: raise --max-namespaces, or DropNamespace one no engine uses",
                        reasons.LIMIT_REACHED, limit="--max-namespaces")
    if len(daemon.sessions) + daemon.locks.sessions() - replacing >= limits.max_sessions:
        raise exhausted(f"session limit reached ({limits.max_sessions}); raise --max-sessions",
                        reasons.LIMIT_REACHED, limit="--max-sessions")
    if ns is not None:
        return None
    config = registration.namespace_config(limits, reg, daemon.storage is not None)
    held = {n: other.host_pool.nbytes for n, other in daemon.namespaces.items()} | pools
    host_budget.check_room(held, config.name, config.host_pages * config.host_layout.page_bytes,
                           daemon.host_memory_limit, daemon.host_memory_source, reg.sees)
    return config


__all__ = ["admit"]
