"""Registering a rank of a tensor-parallel managed-device namespace (`tp_size` > 1).

Every rank of the engine registers on the one namespace with its own buffers and the
same layout, `tp_size`, page count and page split; the first one creates it (host
pages of every rank's shard). The group gathers until every rank is in
(`rank_group.RankGroup`). A rank's place taken by a live session is refused unless the
Register says `replace_existing`: then the whole group holding it is closed first (a
restarted engine restarts every rank). Called by `Daemon.register` holding the
namespace's lock, once no session of the namespace is closing.
"""

import logging
import time

from ..logs import log_event
from . import admission, reasons, registration
from .errors import REPLACED, precondition, unavailable
from .namespace import Namespace
from .sessions import Session

log = logging.getLogger("radixkv.daemon")


def check_not_closing(daemon, name: str) -> None:
    """UNAVAILABLE while a session of namespace `name` is closing: a group's sessions end
    together, and the device tier they leave is detached only once their closes ended."""
    if any(s.closing and s.namespace.name == name for s in daemon.sessions.all()):
        raise unavailable(f"namespace {name}'s ranks are closing (a rank of its engine went); register again",
                          reasons.NAMESPACE_BUSY)


def sessions_to_replace(ns: Namespace, reg: registration.Registration) -> list[Session]:
    """FAILED_PRECONDITION unless `reg` may join the existing namespace `ns` (the ranks
    in it share its page count; a new group may bring another); the group's sessions to
    close first, when the rank's place is taken or the group is another engine's
    (`instance`) and `replace_existing` asks."""
    registration.check_compatible(ns, reg, reg.write_policy or ns.config.cache.write_policy.value)
    members = list(ns.group.sessions.values())
    holder = ns.group.sessions.get(reg.tp_rank)
    other = next((s for s in members if s.instance != reg.instance), None)
    if holder is None and other is None:
        if members and reg.num_device_pages != ns.num_device_pages:
            raise precondition(reason=reasons.NAMESPACE_MISMATCH, field="num_device_pages",
                               message=f"namespace {ns.name}'s ranks hold {ns.num_device_pages} device pages each, this "
                               f"rank {reg.num_device_pages}: the ranks of an engine share one page table")
        return []
    if not reg.replace_existing:
        if holder is not None:
            raise precondition(
                reason=reasons.NAMESPACE_ATTACHED, message=f"rank {reg.tp_rank} of namespace {reg.namespace} is attached to a live session (engine "
                f"{holder.engine or 'unnamed'}); after an engine restart pass replace_existing (it replaces "
                "every rank of that engine)")
        raise precondition(
            reason=reasons.NAMESPACE_ATTACHED, message=f"namespace {reg.namespace}'s ranks belong to engine instance {other.instance!r}, this rank to "
            f"{reg.instance!r}: the ranks of one engine register with one instance; after an engine restart "
            "pass replace_existing")
    registration.check_may_replace(reg, members)
    return members


async def register(daemon, reg: registration.Registration) -> registration.Registered:
    """Join rank `reg.tp_rank` to the namespace `reg` names, creating it for the first
    rank. Run holding the namespace's lock, to its end whoever waits
    (`Daemon.register`). Errors change nothing; a join that fails closes its session
    (and its group)."""
    check_not_closing(daemon, reg.namespace)
    ns = daemon.namespaces.get(reg.namespace)
    replaced = sessions_to_replace(ns, reg) if ns is not None else []
    config = await admission.admit(daemon, reg, ns, len(replaced))
    device = await registration.open_device(reg)  # before the live sessions go: errors change nothing
    try:
        if not replaced:
            check_not_closing(daemon, reg.namespace)  # a rank's stream may have broken meanwhile
        for old in replaced:
            await daemon.close_session(old, REPLACED, replaced=True)
        warm = ns is not None  # for the group's first rank: `RankGroup.warm` answers them all
        if ns is None:
            ns = daemon.add_namespace(await Namespace.open(
                config, None, num_device_pages=reg.num_device_pages, metrics=daemon.metrics,
                storage=daemon.storage), reg)
    except BaseException:
        device.close()
        raise
    session = daemon.new_session(ns, reg)
    session.rank, session.device_pages, session.instance = reg.tp_rank, reg.num_device_pages, reg.instance
    ns.page_geometry = ns.page_geometry or registration.page_geometry(reg)
    try:
        dropped = await ns.join_rank(session, device, warm)  # owns the buffers from here
    except BaseException:
        daemon.close_in_background(session, "its Register failed")  # with its group: one engine's ranks
        raise
    log_event(log, "session.registered", namespace=ns.name, session=session.id[:8], engine=reg.engine,
              backend=reg.backend, device_pages=reg.num_device_pages, host_pages=ns.host_pool.num_pages,
              tp_rank=reg.tp_rank, tp_size=reg.tp_size, instance=reg.instance, waiting_for=ns.group.missing(),
              warm=ns.group.warm, dropped_tokens=dropped)
    return registration.Registered(session, ns.group.warm, dropped)


async def wait_for_ranks(daemon, done: registration.Registered, timeout: float) -> registration.Registered:
    """`done`, once its group formed or after `timeout` seconds (RegisterRequest's
    wait_for_ranks_ms), with the tokens the group's attach dropped. UNAVAILABLE when the
    group ended first. A caller that leaves meanwhile never learns its session: it is
    closed, with its group."""
    done.session.waiting_for_ranks = True  # not idle: --idle-session-timeout counts from the answer
    try:
        dropped = await done.session.namespace.group.wait_formed(done.session, timeout)
    except BaseException:
        daemon.close_in_background(done.session, "its Register's caller left before the answer")
        raise
    finally:
        done.session.waiting_for_ranks = False
        done.session.last_call = time.monotonic()
    return done if dropped is None else registration.Registered(done.session, done.warm, dropped)


__all__ = ["check_not_closing", "register", "sessions_to_replace", "wait_for_ranks"]
