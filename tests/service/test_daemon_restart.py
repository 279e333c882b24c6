"""The daemon killed and restarted: clients find out, get a new session, and say so.

What an engine relies on: while the daemon is down calls fail fast with Unavailable
(a miss, never a hang); load-backs that were pending fail, never succeed; once a new
daemon answers, exactly one call raises DaemonRestarted (and the on_session_lost
callback runs) so the engine drops its view of cached device pages; old transfer ids
never acknowledge a new daemon's transfers; then calls work again.
"""

import asyncio
import threading
import time

import pytest

from radixkv import errors
from radixkv.aio import AsyncClient
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.reconnect import Backoff
from radixkv.sim.kv import KvPattern, page_keys

from faultkit import LAYOUT, NUM_PAGES, tokens

FAST = Backoff(initial=0.05, maximum=0.2)


def cache_on_host(c: Client, kv: KvPattern, prompt: bytes) -> int:
    """Insert `prompt` (4 pages) and evict it to host; its host node."""
    kv.write([0, 1, 2, 3], page_keys(prompt, 4))
    c.insert(prompt, [0, 1, 2, 3])
    assert len(c.evict(4).freed_pages) == 4
    [m] = c.match([prompt])
    assert m.host_tokens == 16
    return m.host_node


def test_blocking_client_survives_a_daemon_kill(daemon_factory):
    d = daemon_factory("--fault-copy-delay", "1.0")
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    kv = KvPattern(LAYOUT, [buffers.buffer(i) for i in range(LAYOUT.num_buffers)], NUM_PAGES)
    lost: list[errors.SessionLost] = []
    c = Client(d.target, timeout=5, reconnect=FAST, on_session_lost=lost.append)
    try:
        first = c.register("restart/tp0", LAYOUT, buffers.specs(), NUM_PAGES, write_policy="write_back",
                           host_pool_pages=64)
        prompt = tokens(0, 4)
        node = cache_on_host(c, kv, prompt)
        lb = c.load_back(node, [8, 9, 10, 11])  # copying for a second
        outcome = {}
        waiter = threading.Thread(target=lambda: outcome.update(c.wait([lb.transfer], timeout=30)))
        waiter.start()
        d.kill()
        waiter.join(10)
        assert not outcome[lb.transfer].ok and outcome[lb.transfer].reason  # failed, never success

        for _ in range(3):  # down: each call is refused, never left to run out its deadline
            with pytest.raises(errors.RadixKVError) as down:
                c.match([prompt])
            # A call that waited for the dead daemon would end at the client's 5 s timeout
            # as DeadlineExceeded; Unavailable means it was answered (refused) before that.
            assert isinstance(down.value, errors.Unavailable), down.value
        assert lost == []

        d.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                c.match([prompt])
                pytest.fail("a call succeeded on the new daemon before DaemonRestarted was raised")
            except errors.DaemonRestarted as e:
                restarted = e
                break
            except errors.Unavailable:
                assert time.monotonic() < deadline, "no reconnect within 20s"
                time.sleep(0.05)
        assert lost == [restarted] and restarted.old_instance == first.daemon_instance
        assert restarted.new_instance != first.daemon_instance
        assert c.registration.session != first.session and c.registration == restarted.registration
        assert not c.wait([lb.transfer])[lb.transfer].ok  # an old id: refused without asking the daemon
        [m] = c.match([prompt])  # works again; the host tier died with the daemon
        assert (m.device_tokens, m.host_tokens) == (0, 0)
        node = cache_on_host(c, kv, prompt)
        assert c.reconnect(timeout=5) is None  # the session is alive
        lb2 = c.load_back(node, [8, 9, 10, 11])
        assert c.wait([lb2.transfer], timeout=10)[lb2.transfer].ok
        assert kv.mismatches(lb2.device_pages, page_keys(prompt, 4)) == (0, 0)
        assert c.check_invariants() == []
    finally:
        c.close()
        buffers.close()


def test_graceful_restart_and_reconnect(daemon_factory):
    """SIGTERM ends the sessions: the client notices from its ack stream and
    `reconnect` waits (with backoff) for the successor."""
    d = daemon_factory()
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    c = Client(d.target, timeout=5, reconnect=FAST)
    try:
        first = c.register("graceful/tp0", LAYOUT, buffers.specs(), NUM_PAGES, host_pool_pages=64)
        assert d.stop() == 0
        threading.Timer(0.5, d.start).start()
        lost = c.reconnect(timeout=30)
        assert isinstance(lost, errors.DaemonRestarted) and lost.old_instance == first.daemon_instance
        assert c.match([tokens(0, 1)])[0].device_tokens == 0
    finally:
        c.close()
        buffers.close()


def test_async_client_survives_a_daemon_kill(daemon_factory):
    d = daemon_factory()

    async def main():
        buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
        kv = KvPattern(LAYOUT, [buffers.buffer(i) for i in range(LAYOUT.num_buffers)], NUM_PAGES)
        try:
            async with AsyncClient(d.target, timeout=5, reconnect=FAST) as c:
                first = await c.register("aio-restart/tp0", LAYOUT, buffers.specs(), NUM_PAGES,
                                         write_policy="write_back", host_pool_pages=64)
                prompt = tokens(0, 4)
                kv.write([0, 1, 2, 3], page_keys(prompt, 4))
                await c.insert(prompt, [0, 1, 2, 3])
                await c.evict(4)
                [m] = await c.match([prompt])
                lb = await c.load_back(m.host_node, [4, 5, 6, 7])
                d.kill()
                assert not (await c.wait([lb.transfer], timeout=10))[lb.transfer].ok
                with pytest.raises(errors.Unavailable):
                    await c.match([prompt])
                await asyncio.get_running_loop().run_in_executor(None, d.start)
                lost = await c.reconnect(timeout=20)
                assert isinstance(lost, errors.DaemonRestarted) and lost.old_instance == first.daemon_instance
                assert not (await c.wait([lb.transfer]))[lb.transfer].ok
                [m] = await c.match([prompt])
                assert m.host_tokens == 0
        finally:
            buffers.close()

    asyncio.run(main())


def test_async_calls_in_flight_together_register_the_lost_session_once(daemon_factory):
    """Several tasks of one AsyncClient find the session lost at once (the daemon
    restarted): one of them registers again and raises DaemonRestarted, the others fail
    Unavailable meanwhile, and the daemon holds one session of the client, not one per task
    (a second registration would be a session nobody uses, keeping its leases)."""
    d = daemon_factory()

    def sessions() -> int:
        """The daemon's sessions (the probe registers none)."""
        with Client(d.target, reconnect=None) as probe:
            return probe.stats("aio-together").sessions

    async def main():
        async with AsyncClient(d.target, timeout=5, reconnect=FAST, stream=True) as c:
            first = await c.register("aio-together", LAYOUT, [], 0, device_tier="engine_managed", role="scheduler")
            assert (await c.match([tokens(0, 4)]))[0].host_tokens == 0
            d.kill()
            await asyncio.get_running_loop().run_in_executor(None, d.start)
            results = await asyncio.gather(*(c.match([tokens(i, 4)]) for i in range(6)), return_exceptions=True)
            restarted = [r for r in results if isinstance(r, errors.DaemonRestarted)]
            assert len(restarted) == 1 and restarted[0].old_instance == first.daemon_instance, results
            assert all(isinstance(r, (errors.DaemonRestarted, errors.Unavailable)) for r in results), results
            assert not any("None" in str(r) for r in results), results
            assert sessions() == 1
            assert (await c.match([tokens(0, 4)]))[0].host_tokens == 0  # and the session works

    asyncio.run(main())


def test_a_call_cancelled_while_it_registers_leaves_the_registering_to_the_next(daemon_factory):
    """A task cancelled while its call registers the lost session again (the daemon stopped
    answering: SIGSTOP) gives the registering up: once the daemon answers, a reconnect
    registers the session, instead of every call failing "another call is registering it
    again" for as long as the cancelled task is referenced."""
    import os
    import signal

    d = daemon_factory()

    async def main():
        async with AsyncClient(d.target, timeout=1, reconnect=FAST, stream=True) as c:
            await c.register("aio-cancel", LAYOUT, [], 0, device_tier="engine_managed", role="scheduler")
            os.kill(d.pid, signal.SIGSTOP)
            try:
                with pytest.raises(errors.DeadlineExceeded):
                    await c.match([tokens(0, 4)])  # unanswered: the session counts as lost
                stuck = asyncio.ensure_future(c.match([tokens(0, 4)]))  # registers: no answer either
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stuck), 0.5)
                stuck.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await stuck  # kept referenced, as a caller's task list would
            finally:
                os.kill(d.pid, signal.SIGCONT)
            lost = await c.reconnect(timeout=20)
            assert isinstance(lost, errors.SessionLost), lost
            assert (await c.match([tokens(0, 4)]))[0].host_tokens == 0

    asyncio.run(main())


def test_reconnect_keeps_its_timeout_against_a_daemon_that_does_not_answer(daemon_factory):
    """`reconnect(timeout)` against a daemon that takes connections but does not answer
    (frozen) raises Unavailable within about `timeout`, whatever the client's per-call
    timeout, saying what its last attempt met; with the session not known lost, it does
    not call a frozen daemon's session alive either."""
    import os
    import signal
    d = daemon_factory()
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    c = Client(d.target, timeout=30, reconnect=FAST)
    try:
        c.register("frozen/reconnect", LAYOUT, buffers.specs(), NUM_PAGES, host_pool_pages=16)
        os.kill(d.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            with pytest.raises(errors.Unavailable, match="did not answer within 1s"):
                c.reconnect(timeout=1.0)  # not known lost: the probe gets no answer
            assert time.monotonic() - began < 10, "reconnect waited for the 30 s call timeout"
            d.kill()
            d.start()
            c.wait_ready(10)  # the channel reaches the new daemon ...
            os.kill(d.pid, signal.SIGSTOP)  # ... which then stops answering
            began = time.monotonic()
            with pytest.raises(errors.Unavailable, match="no session after 1.0s.*the last attempt"):
                c.reconnect(timeout=1.0)
            assert time.monotonic() - began < 10, "reconnect waited for the 30 s call timeout"
        finally:
            os.kill(d.pid, signal.SIGCONT)
        assert isinstance(c.reconnect(timeout=10), errors.DaemonRestarted)
    finally:
        c.close()
        buffers.close()


@pytest.mark.parametrize("stream", [False, True])
def test_close_against_a_daemon_that_does_not_answer_takes_its_timeout_not_minutes(daemon_factory, stream):
    """A Close the frozen daemon does not answer ends the client's streams at once (a
    graceful end would wait for the daemon's side, 30 s a stream): `close` returns after
    about the client's timeout, and an ack still waited for fails."""
    import os
    import signal
    d = daemon_factory()
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    c = Client(d.target, timeout=1.0, stream=stream, reconnect=FAST)
    try:
        c.register("frozen/close", LAYOUT, buffers.specs(), NUM_PAGES, host_pool_pages=16)
        os.kill(d.pid, signal.SIGSTOP)
        began = time.monotonic()
        c.close()
        assert time.monotonic() - began < 15, "close waited for the streams' graceful end"
        with pytest.raises(errors.FailedPrecondition):
            c.match([tokens(0, 4)])
    finally:
        os.kill(d.pid, signal.SIGCONT)
        buffers.close()


def test_a_register_the_caller_stopped_waiting_for_leaves_no_session_behind(daemon_factory):
    """An engine bounds its Register (`asyncio.wait_for`), and gives up just after the
    daemon made the session: that session is closed once answered, so the namespace is
    free for the engine's next attempt (it held it for good, refusing every Register).
    The cut is swept across the Register's own duration to land in that window."""
    d = daemon_factory()
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)

    async def register(c, namespace):
        await c.register(namespace, LAYOUT, buffers.specs(), NUM_PAGES, host_pool_pages=16)

    async def main():
        c = AsyncClient(d.target, timeout=10)
        await c.wait_ready(10)
        began = time.monotonic()
        await register(c, "orphan/probe")
        took = time.monotonic() - began
        await c.close()
        cut_short = 0
        for i in range(40):
            c = AsyncClient(d.target, timeout=10)
            await c.wait_ready(10)
            try:
                await asyncio.wait_for(register(c, f"orphan/{i}"), took * (0.2 + 0.06 * i))
            except asyncio.TimeoutError:
                cut_short += 1
            await c.close()  # waits for a late answer and closes what it made
            again = AsyncClient(d.target, timeout=10)
            try:
                await register(again, f"orphan/{i}")  # refused while an orphan holds it
            finally:
                await again.close()
        assert cut_short, "no Register was cut short"

    try:
        asyncio.run(main())
    finally:
        buffers.close()


@pytest.mark.parametrize("shell", ["blocking", "asyncio"])
def test_a_register_past_the_clients_timeout_leaves_no_session_behind(daemon_factory, shell):
    """The client's timeout runs out while the daemon still makes the session (a host
    pool faulted in at Register takes ~10 ms; the timeout is 1 ms): the call raises
    DeadlineExceeded, the Register goes on in the daemon (no deadline on the wire), and
    the session it made is closed once answered: the client's own retry waits for that
    Close (it was refused "attached to a live session"), and another client's Register
    of the namespace is taken. (With a deadline on the wire, one running out while the answer
    was on its way lost the session's id, and that session refused every later Register.)"""
    d = daemon_factory("--host-pool-prefault", "true")
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    args = ("late/register", LAYOUT, buffers.specs(), NUM_PAGES)
    kwargs = dict(host_pool_pages=32768)  # 32 MiB of 1 KiB pages

    def blocking():
        c = Client(d.target, timeout=10)
        c.wait_ready(10)
        c.timeout = 0.001
        with pytest.raises(errors.DeadlineExceeded, match="Register: no answer within 0.001s"):
            c.register(*args, **kwargs)
        c.timeout = 10
        assert c.register(*args, **kwargs).session  # the retry waits for the abandoned one's Close
        c.close()
        with Client(d.target, timeout=10) as again:
            assert again.register(*args, **kwargs).session

    async def asynchronous():
        c = AsyncClient(d.target, timeout=10)
        await c.wait_ready(10)
        c.timeout = 0.001
        with pytest.raises(errors.DeadlineExceeded, match="Register: no answer within 0.001s"):
            await c.register(*args, **kwargs)
        c.timeout = 10
        assert (await c.register(*args, **kwargs)).session
        await c.close()
        async with AsyncClient(d.target, timeout=10) as again:
            assert (await again.register(*args, **kwargs)).session

    try:
        blocking() if shell == "blocking" else asyncio.run(asynchronous())
    finally:
        buffers.close()
