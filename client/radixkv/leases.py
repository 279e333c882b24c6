"""Releasing leases, as a plan (`radixkv.session`). The daemon releases a batch all or
nothing: one lease no session holds (released, expired) or another session's fails the
whole call. An engine's step releases its leases in one batch, so one stale lease would
leave the others pinning their pages; the batch is then sent again a lease a call."""

from collections.abc import Iterable

from . import messages as msg
from .errors import NotFound, PermissionDenied
from .plans import Plan


def release_leases(call, session: str, leases: Iterable[int]) -> Plan[None]:
    """Release `leases` of `session` through `call` (the session's call path). A batch
    refused whole is sent again a lease a call: the others are released, the refusal
    raised with `leases`, the ids refused (none raised when the stale one went meanwhile)."""
    req = msg.release_request(session, leases)
    try:
        if req.leases:
            yield from call("Release", req)
        return
    except (NotFound, PermissionDenied) as err:
        refused = err
    refused.leases = tuple(req.leases)
    if len(req.leases) > 1:
        refused.leases = ()
        for lease in req.leases:
            try:
                yield from call("Release", msg.release_request(session, [lease]))
            except (NotFound, PermissionDenied):
                refused.leases += (lease,)
    if refused.leases:
        raise refused


__all__ = ["release_leases"]
