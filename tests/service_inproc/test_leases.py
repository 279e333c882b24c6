"""Lease and session rules of the service layer, on an in-process daemon (see inproc.py):
a lease keeps its path from eviction until released, once; a lease is its session's
alone; a timed-out lease is released and says so; closing a session releases its leases
and finishes its load-backs."""

import time

import grpc
import pytest

from radixkv.types import pack, unpack
from radixkv_server.core import CacheError
from radixkv_server.service.errors import ServiceError, status_of

from tests.service_inproc.inproc import Engine, prompt, run, running_daemon

NOT_HELD = "is not held by this session"


def refused(exc_info) -> tuple[grpc.StatusCode, str]:
    """The status the servicer would answer for this error."""
    return status_of(exc_info.value)[:2]


def test_a_lease_keeps_its_path_on_device_until_released():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/lease")
            p = prompt(0, 4)
            await e.insert(p, [0, 1, 2, 3])
            m = await e.match(p, lease=True)
            assert m.lease and m.result.device_tokens == 16
            assert (await e.evict(4)).freed_pages == b""  # the leased path stays
            assert (await e.match(p)).result.device_tokens == 16
            e.release([m.lease])
            freed = await e.evict(4)
            assert sorted(unpack(freed.freed_pages)) == [0, 1, 2, 3]
            assert freed.written_back_pages == 4  # write_back: copied to host first
            after = (await e.match(p)).result
            assert (after.device_tokens, after.host_tokens) == (0, 16)
            assert e.ns.check_invariants() == []
            await e.close()
    run(scenario())


def test_releasing_a_lease_twice_is_not_found_and_changes_nothing():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/twice")
            p = prompt(0, 2)
            await e.insert(p, [0, 1])
            kept = (await e.match(p, lease=True)).lease
            once = (await e.match(p, lease=True)).lease
            e.release([once])
            with pytest.raises(ServiceError) as info:
                e.release([once])
            code, message = refused(info)
            assert code == grpc.StatusCode.NOT_FOUND and f"lease {once} {NOT_HELD}" in message
            with pytest.raises(ServiceError) as info:
                e.release([kept, kept])
            assert refused(info)[0] == grpc.StatusCode.INVALID_ARGUMENT
            assert (await e.evict(2)).freed_pages == b""  # `kept` still holds the path
            assert e.ns.check_invariants() == []
            await e.close()
    run(scenario())


def test_a_lease_belongs_to_its_session():
    async def scenario():
        async with running_daemon() as daemon:
            a = await Engine.register(daemon, "t/a")
            b = await Engine.register(daemon, "t/b")
            p = prompt(0, 2)
            await a.insert(p, [0, 1])
            lease = (await a.match(p, lease=True)).lease
            with pytest.raises(ServiceError) as info:
                b.release([lease])
            assert refused(info) == (grpc.StatusCode.PERMISSION_DENIED, f"lease {lease} belongs to another session")
            with pytest.raises(ServiceError) as info:  # nor can b's insert release it
                await b.insert(prompt(100, 1), [5], release_lease=lease)
            assert refused(info)[0] == grpc.StatusCode.PERMISSION_DENIED
            assert (await b.match(prompt(100, 1))).result.device_tokens == 0  # refused before inserting
            assert (await a.evict(2)).freed_pages == b""
            a.release([lease])
            assert len(unpack((await a.evict(2)).freed_pages)) == 2
            await a.close()
            await b.close()
    run(scenario())


def test_an_expired_lease_is_released_and_later_release_says_it_expired():
    async def scenario():
        async with running_daemon(lease_timeout=5.0) as daemon:
            e = await Engine.register(daemon, "t/expiry")
            p = prompt(0, 2)
            await e.insert(p, [0, 1])
            lease = (await e.match(p, lease=True)).lease
            daemon.expiry.expire(time.monotonic() + 1.0)  # not yet due
            assert (await e.evict(2)).freed_pages == b""
            daemon.expiry.expire(time.monotonic() + 10.0)
            assert len(unpack((await e.evict(2)).freed_pages)) == 2
            with pytest.raises(ServiceError) as info:
                e.release([lease])
            assert refused(info) == (grpc.StatusCode.NOT_FOUND,
                                     f"lease {lease} expired: held longer than --lease-timeout=5s")
            assert e.ns.expirations["lease"] == 1
            await e.close()
    run(scenario())


def test_closing_a_session_releases_its_leases_and_finishes_its_loads():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/close")
            p = prompt(0, 4)
            await e.insert(p, [0, 1, 2, 3])
            await e.evict(4)  # write back: the prefix is on host only
            m = await e.match(p, lease=True)
            lb = await e.ns.load_back(e.session, m.result.host_node, pack([8, 9, 10, 11]))
            assert lb.result.transfer and lb.result.loaded_tokens == 16
            ns, session = e.ns, e.session
            await e.close()  # neither acked nor released
            assert ns.session is None and ns.cache.pending_loads(session.id) == []
            assert not ns.cache.transfers and ns.check_invariants() == []
            with pytest.raises(ServiceError) as info:
                daemon.session(session.id)
            assert refused(info) == (grpc.StatusCode.UNAUTHENTICATED,
                                     f"session {session.id} was closed (closed by the test); register again")
            # The host copy outlived the engine; nothing it held pins it any more.
            again = await Engine.register(daemon, "t/close")
            assert again.session.namespace is ns
            assert (await again.match(p)).result.host_tokens == 16
            assert ns.cache.evict_host(4) == 4
            await again.close()
    run(scenario())


def test_a_load_back_copies_the_bytes_and_is_acked_once():
    async def scenario():
        async with running_daemon() as daemon:
            e = await Engine.register(daemon, "t/bytes")
            p = prompt(0, 2)
            e.fill([0, 1], seed=3)
            want = e.page_bytes([0, 1])
            await e.insert(p, [0, 1])
            await e.evict(2)
            e.fill([0, 1], seed=99)  # the engine reuses the freed pages
            m = await e.match(p)
            lb = await e.ns.load_back(e.session, m.result.host_node, pack([20, 21]))
            done = await e.ns.ack(e.session, lb.result.transfer)
            assert done.error is None
            assert e.page_bytes([20, 21]) == want
            with pytest.raises(CacheError) as info:
                await e.ns.ack(e.session, lb.result.transfer)
            assert refused(info)[0] == grpc.StatusCode.NOT_FOUND
            assert (await e.match(p)).result.device_tokens == 8
            await e.close()
    run(scenario())


def test_room_a_call_holds_while_it_waits_counts_against_the_lease_limit():
    """An Insert with `lease` checks --max-leases-per-session, waits for copies, then
    takes its lease: concurrent Inserts of one session all passed the check while the
    first waited, and took the session past its limit."""
    from radixkv_server.service.sessions import SessionRegistry

    s = SessionRegistry(max_leases=2).new(namespace=None, engine="e")
    s.add_lease(7)
    with s.lease_room(1):  # one Insert waits for a copy before it takes its lease
        with pytest.raises(ServiceError, match="holds 1 leases and this call would take 1 more"):
            s.check_lease_room(1)  # a second one is refused meanwhile
    s.check_lease_room(1)  # the first ended: its room is the session's again
    with s.lease_room(-1):  # an Insert that releases one lease and takes one holds no room
        s.check_lease_room(1)
