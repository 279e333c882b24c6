"""Whether a Register fits the daemon's limits: its tenant's quota (`namespaces=`,
`host=`, `sessions=` in the token file: token_file.py), --max-namespaces, --max-sessions
and the host memory budget (host_budget.py), for both kinds of namespace.

The check runs between awaits on the daemon's loop, holding only the registering
namespace's lock, while other namespaces' changes are under way: so it counts, besides
the registry, the room those changes hold (namespace_locks.py), and reserves its own.
"""

from __future__ import annotations

from . import host_budget, namespace_reclaim, reasons, registration
from .errors import ServiceError, exhausted


async def admit(daemon, reg: registration.Registration, ns, replacing: int = 0):
    """The daemon's limits for a Register joining namespace `ns` (None: creating it),
    checked before anything is taken: for a new namespace its tenant's quota, then the
    namespace and session limits (the `replacing` sessions it replaces free their
    places) and, for a new namespace, the host memory budget its whole host pool counts
    against. A new namespace past the namespace limit or the budget drops the namespaces
    detached longest first (namespace_reclaim.py) until it fits; past its tenant's
    quota, the tenant's own. RESOURCE_EXHAUSTED past one still. Returns the new
    namespace's config; None when joining. What it admits (the session, a new pool)
    stays reserved until made (`Daemon.new_session`, `Daemon.add_namespace`) or the
    change ends. Call holding `reg.namespace`'s lock."""
    while True:
        try:
            config = _check_limits(daemon, reg, ns, replacing)
        except ServiceError as e:
            if ns is not None or not await namespace_reclaim.make_room(daemon, e, reg):
                raise
            continue
        daemon.locks.reserve(reg.namespace, session=True, owner=reg.owner,
                             host_bytes=None if config is None else config.host_pool_bytes)
        return config


def _check_limits(daemon, reg: registration.Registration, ns, replacing: int):
    limits = daemon.config
    config = None if ns is not None else registration.namespace_config(limits, reg, daemon.storage is not None)
    if config is not None and reg.quota is not None:
        _check_quota(daemon, reg, config.host_pool_bytes)
    pools = daemon.locks.pools()  # namespaces made or freed meanwhile (by other names: this one's lock is held)
    if ns is None and len(daemon.namespaces) + len(pools) >= limits.max_namespaces:
        raise exhausted(f"namespace limit reached ({limits.max_namespaces}), none of them detached for "
                        f"--reclaim-detached-after ({limits.reclaim_detached_after:g}s) to drop for this "
                        "one: raise --max-namespaces, or DropNamespace one no engine uses",
                        reasons.LIMIT_REACHED, limit="--max-namespaces")
    if len(daemon.sessions) + daemon.locks.sessions() - replacing >= limits.max_sessions:
        raise exhausted(f"session limit reached ({limits.max_sessions}); raise --max-sessions",
                        reasons.LIMIT_REACHED, limit="--max-sessions")
    if reg.quota is not None and reg.quota.sessions is not None:
        _check_session_quota(daemon, reg, replacing)
    if ns is not None:
        return None
    held = {n: other.host_pool.nbytes for n, other in daemon.namespaces.items()} | pools
    host_budget.check_room(held, config.name, config.host_pool_bytes,
                           daemon.host_memory_limit, daemon.host_memory_source, reg.sees)
    return config


def _check_session_quota(daemon, reg: registration.Registration, replacing: int) -> None:
    """RESOURCE_EXHAUSTED (LIMIT_REACHED, `limit` sessions=) when one more session would
    take the caller's tenant past its quota; the `replacing` sessions it replaces (its
    own: registration.check_may_replace) free their places."""
    mine = [s for s in daemon.sessions.all() if s.owner == reg.owner]
    held = len(mine) + daemon.locks.sessions(reg.owner) - replacing
    if held >= reg.quota.sessions:
        where = sorted({s.namespace.name for s in mine})
        raise exhausted(f"this token's tenant holds {held} sessions, its quota (sessions={reg.quota.sessions} in the "
                        f"token file), in {', '.join(where) or 'namespaces being registered'}; close an engine "
                        "(its sessions end with it), or ask the operator for more",
                        reasons.LIMIT_REACHED, limit="sessions=")


def _check_quota(daemon, reg: registration.Registration, nbytes: int) -> None:
    """RESOURCE_EXHAUSTED (LIMIT_REACHED, `limit` the token file's option) when a new
    namespace with a pool of `nbytes` would take the caller's tenant past its quota.
    Names only the tenant's own namespaces."""
    quota = reg.quota
    mine = {n: other.host_pool.nbytes for n, other in daemon.namespaces.items() if other.owner == reg.owner}
    mine |= daemon.locks.pools(reg.owner)
    if quota.namespaces is not None and len(mine) >= quota.namespaces:
        raise exhausted(f"this token's tenant holds {len(mine)} namespaces, its quota (namespaces={quota.namespaces} "
                        f"in the token file): {', '.join(sorted(mine))}; DropNamespace one of them, or ask the "
                        "operator for more", reasons.LIMIT_REACHED, limit="namespaces=")
    total = sum(mine.values()) + nbytes
    if quota.host_bytes is not None and total > quota.host_bytes:
        raise exhausted(f"a host pool of {nbytes} bytes for namespace {reg.namespace} would take this token's "
                        f"tenant's host pools to {total} bytes, past its quota (host={quota.host_bytes} in the "
                        f"token file); its pools: {', '.join(f'{n}: {b}' for n, b in sorted(mine.items())) or 'none'}. "
                        "Register with fewer host_pool_pages or DropNamespace one of them",
                        reasons.LIMIT_REACHED, limit="host=")


__all__ = ["admit"]
