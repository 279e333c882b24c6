"""A tenant's quota (`namespaces=`, `host=`, `sessions=` on its token file lines). The
namespaces its Registers create count against the first two, those another tenant
created do not; every session it holds counts against the last, wherever it is. A
Register past it is RESOURCE_EXHAUSTED naming the option and only the tenant's own
namespaces; room is made among the tenant's own detached namespaces, never another's.
Without a quota a tenant is bounded by the daemon's limits alone, as before."""

import asyncio
import time

import pytest

from radixkv_server.service import reasons
from radixkv_server.service.errors import ServiceError
from radixkv_server.service.token_file import Quota

from tests.service_inproc.inproc import HOST_PAGES, LAYOUT, Engine, run, running_daemon, until

ALICE, BOB = b"alice", b"bob"
POOL_BYTES = HOST_PAGES * LAYOUT.page_bytes


def as_tenant(owner: bytes, quota: Quota | None = None) -> dict:
    return dict(owner=owner, token=owner, quota=quota)


@pytest.mark.parametrize("quota, limit", [(Quota(namespaces=2), "namespaces="),
                                          (Quota(host_bytes=2 * POOL_BYTES), "host="),
                                          (Quota(sessions=2), "sessions=")])
def test_a_tenant_past_its_quota_is_refused_and_others_are_not(quota, limit):
    async def scenario():
        async with running_daemon(reclaim_detached_after=0) as daemon:
            bobs = await Engine.register(daemon, "bob/a", **as_tenant(BOB))  # not alice's: not in her count
            outcomes = await asyncio.gather(*(Engine.register(daemon, f"alice/{i}", **as_tenant(ALICE, quota))
                                              for i in range(3)), return_exceptions=True)
            engines = [o for o in outcomes if isinstance(o, Engine)]
            [refused] = [o for o in outcomes if isinstance(o, ServiceError)]
            assert len(engines) == 2 and refused.reason == reasons.LIMIT_REACHED
            assert refused.metadata["limit"] == limit and "bob/" not in str(refused)
            more_bobs = await Engine.register(daemon, "bob/b", **as_tenant(BOB))  # no quota: the daemon's limits
            for e in engines + [bobs, more_bobs]:
                await e.close()
            await daemon.drop_namespace(engines[0].ns.name)  # room again
            again = await Engine.register(daemon, "alice/again", **as_tenant(ALICE, quota))
            await again.close()
    run(scenario())


def test_room_past_a_quota_is_made_among_the_tenants_own_namespaces():
    """Bob's namespace was detached longest, but Alice's quota is hers: her own detached
    namespace goes, Bob's stays."""
    async def scenario():
        async with running_daemon(reclaim_detached_after=1e-6) as daemon:
            quota = Quota(namespaces=1)
            bobs = await Engine.register(daemon, "bob/old", **as_tenant(BOB))
            await bobs.close()
            hers = await Engine.register(daemon, "alice/old", **as_tenant(ALICE, quota))
            await hers.close()
            await until(lambda: all(daemon.detached.seconds(n, set(), time.monotonic()) > 1e-6
                                    for n in ("bob/old", "alice/old")), "both namespaces detached past the grace")
            new = await Engine.register(daemon, "alice/new", **as_tenant(ALICE, quota))
            assert sorted(daemon.namespaces) == ["alice/new", "bob/old"]
            await new.close()
    run(scenario())


def test_a_namespace_another_tenant_created_is_not_counted_when_joined():
    async def scenario():
        async with running_daemon() as daemon:
            bobs = await Engine.register(daemon, "shared/m", **as_tenant(BOB))
            await bobs.close()
            joined = await Engine.register(daemon, "shared/m", **as_tenant(ALICE, Quota(namespaces=1)))
            own = await Engine.register(daemon, "alice/m", **as_tenant(ALICE, Quota(namespaces=1)))
            assert daemon.namespaces["shared/m"].owner == BOB and daemon.namespaces["alice/m"].owner == ALICE
            for e in (joined, own):
                await e.close()
    run(scenario())


def test_a_tenants_sessions_are_bounded_in_every_namespace_and_a_replacement_fits():
    """`sessions=2`: her sessions in her own namespace and in one another tenant made
    count alike; a third is refused (Bob's are not counted, and his go on); an engine
    restart replacing one of hers fits at the quota; closing one makes room."""
    async def scenario():
        async with running_daemon() as daemon:
            quota = Quota(sessions=2)
            bobs = await Engine.register(daemon, "shared/m", **as_tenant(BOB))
            await bobs.close()
            joined = await Engine.register(daemon, "shared/m", **as_tenant(ALICE, quota))
            own = await Engine.register(daemon, "alice/m", **as_tenant(ALICE, quota))
            with pytest.raises(ServiceError) as refused:
                await Engine.register(daemon, "alice/other", **as_tenant(ALICE, quota))
            assert refused.value.reason == reasons.LIMIT_REACHED and refused.value.metadata["limit"] == "sessions="
            assert "alice/m, shared/m" in str(refused.value) and "alice/other" not in daemon.namespaces
            bobs = await Engine.register(daemon, "bob/m", **as_tenant(BOB))  # no quota of his
            restarted = await Engine.register(daemon, "alice/m", replace=True, **as_tenant(ALICE, quota))
            own.buffers.close()  # its session was replaced
            await joined.close()
            other = await Engine.register(daemon, "alice/other", **as_tenant(ALICE, quota))
            for e in (restarted, other, bobs):
                await e.close()
    run(scenario())
