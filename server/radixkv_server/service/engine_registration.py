"""Registering a session on an engine-managed namespace (device_tier ENGINE_MANAGED).

Any number of sessions share such a namespace: each engine instance's SCHEDULER session
and its ENGINE rank sessions. Every session presents the namespace's layout and
`tp_size` (FAILED_PRECONDITION otherwise, naming both); the first one creates the
namespace. Called by `Daemon.register` holding the namespace's lock
(namespace_locks.py).
"""

import logging

from ..logs import log_event
from . import admission, reasons, registration
from .engine_namespace import SCHEDULER, EngineNamespace
from .errors import precondition

log = logging.getLogger("radixkv.daemon")


def check_compatible(ns, reg: registration.Registration) -> None:
    """FAILED_PRECONDITION unless `reg` may join the existing namespace `ns`."""
    registration.check_compatible(ns, reg, reg.write_policy or ns.config.cache.write_policy.value)
    if ns.tp_size != reg.tp_size:
        raise precondition(reason=reasons.NAMESPACE_MISMATCH, field="tp_size", message=f"namespace {ns.name} is sharded over tp_size {ns.tp_size} ranks, this session says "
                           f"tp_size {reg.tp_size}: every engine sharing a namespace uses one tensor-parallel size")


async def register(daemon, reg: registration.Registration) -> registration.Registered:
    """Attach a SCHEDULER or ENGINE session to the engine-managed namespace `reg` names,
    creating it for the first one. Errors change nothing."""
    ns = daemon.namespaces.get(reg.namespace)
    if ns is not None:
        check_compatible(ns, reg)
    config = await admission.admit(daemon, reg, ns)
    device = None if reg.role == SCHEDULER else await registration.open_device(reg)
    try:
        warm = ns is not None
        if ns is None:
            ns = daemon.add_namespace(await EngineNamespace.open(
                config, metrics=daemon.metrics, storage=daemon.storage), reg)
        session = daemon.new_session(ns, reg)
        session.role, session.rank, session.instance = reg.role, reg.tp_rank, reg.instance
        session.device_pages = reg.num_device_pages
        ns.add_session(session, device)
        ns.page_geometry = ns.page_geometry or registration.page_geometry(reg)
    except BaseException:
        if device is not None:
            device.close()
        raise
    log_event(log, "session.registered", namespace=ns.name, session=session.id[:8], engine=reg.engine,
              device_tier="engine_managed", role=reg.role, tp_rank=reg.tp_rank, tp_size=reg.tp_size,
              instance=reg.instance, device_pages=reg.num_device_pages, warm=warm)
    return registration.Registered(session, warm, 0)


__all__ = ["register"]
