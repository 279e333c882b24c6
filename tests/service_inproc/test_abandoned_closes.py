"""Closes whose callers give up halfway (a Close or DropNamespace past its deadline, a
replacing Register cancelled): the close runs to its end all the same, and whoever asks
again waits for that end. On an in-process daemon (see inproc.py), cancelled at exactly
the await a deadline would hit.

- A Close cancelled while a load-back copies: a retried Close is answered only once the
  copy ended and the session's holdings are gone (before: at once, with the copy still
  writing pages the engine had taken back, and the load's pins, locks and transfer kept
  for good, so every later Register of the namespace was refused UNAVAILABLE).
- A replacing Register cancelled while it closes the session it replaces: the same.
- A DropNamespace cancelled while its stores wait on a store that pauses writes: the
  namespace is closed all the same (before: gone from the registry, its host pool never
  freed, routers never told it was cleared).
- A Register of a namespace whose session is closing (its engine went) waits for that
  close instead of being refused as if the session were live; other namespaces'
  Registers do not wait behind it.
- A Close answered while a store of pages that stay is in flight (it waited for every
  store: a slow store held engines' Closes past their deadlines).
- A managed load-back whose copy could not start (CUDA) is answered with its transfer,
  whose ack reports the failure (before: INTERNAL with no transfer to acknowledge, and
  the load's pages held until the session ended).
"""

import asyncio

import pytest
import redis

from radixkv.types import pack, unpack
from radixkv_server.datapath import CopyError
from radixkv_server.core.transfers import TransferKind
from radixkv_server.datapath.copy_engine import CopyEngine
from radixkv_server.storage.open import open_storage

from tests.service_inproc.inproc import Engine, cancelled_at_first_await, prompt, run, running_daemon, until


async def loading(daemon, namespace: str) -> tuple[Engine, int]:
    """An engine whose 4-page prompt is on host only, and the transfer of the load-back
    of it into device pages 10-13, copying now (the daemon's copies are delayed)."""
    e = await Engine.register(daemon, namespace)
    e.fill([0, 1, 2, 3], 7)
    await e.insert(prompt(0, 4), [0, 1, 2, 3])
    await e.evict(4)
    m = await e.match(prompt(0, 4))
    lb = await e.ns.load_back(e.session, m.result.host_node, pack([10, 11, 12, 13]))
    assert lb.result.transfer
    return e, lb.result.transfer


def holds_nothing(ns) -> None:
    assert ns.cache.transfers == {}
    assert not [n.id for n in ns.cache.tree.iter_nodes() if n.full.lock_ref or n.full.pins]
    assert ns.check_invariants() == []


async def served_again(old: Engine, transfer: int) -> None:
    """`old`'s session is closed whole (its load finished, nothing held), and a new
    engine registering its namespace is served the prompt `loading` cached."""
    ns = old.ns
    assert transfer not in ns.cache.transfers, "answered while the load still copied"
    holds_nothing(ns)
    old.buffers.close()
    new = await Engine.register(old.daemon, ns.name)  # refused UNAVAILABLE for good before
    assert (await new.match(prompt(0, 4))).result.host_tokens == 16
    await new.close()


def test_a_close_whose_caller_gave_up_ends_before_a_retried_close_is_answered():
    async def scenario():
        async with running_daemon(fault_copy_delay=0.2) as daemon:
            e, transfer = await loading(daemon, "t/close")
            await cancelled_at_first_await(daemon.close_session(e.session, "closed by a Close call"))
            await daemon.close_session(e.session, "closed by a Close call")  # the client's retry
            await served_again(e, transfer)
    run(scenario())


def test_a_replacing_register_cut_short_still_ends_the_session_it_replaces():
    async def scenario():
        async with running_daemon(fault_copy_delay=0.2) as daemon:
            old, transfer = await loading(daemon, "t/replace")
            replacing = asyncio.ensure_future(Engine.register(daemon, "t/replace", replace=True))
            await until(lambda: old.session.closing, "the Register closing the session it replaces")
            replacing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await replacing
            await daemon.closed(old.session)
            await served_again(old, transfer)
    run(scenario())


def test_a_register_waits_for_the_close_of_a_session_whose_engine_went():
    async def scenario():
        async with running_daemon(fault_copy_delay=0.2) as daemon:
            gone, _ = await loading(daemon, "t/gone")
            daemon.close_in_background(gone.session, "its ack stream ended")  # the engine went
            await asyncio.sleep(0)
            assert gone.session.closing
            other = await Engine.register(daemon, "t/other")  # not held behind that close
            assert not gone.session.closer.done()
            new = await Engine.register(daemon, "t/gone")  # FAILED_PRECONDITION "live session" before
            assert new.session is not gone.session and gone.session.closer.done()
            await other.close()
            await new.close()
            gone.buffers.close()
    run(scenario())


def test_a_drop_cut_short_while_stores_wait_still_closes_the_namespace(private_redis):
    admin = redis.Redis(unix_socket_path=private_redis.socket)
    storage = open_storage(private_redis.url + "?socket_timeout=60")

    async def scenario():
        async with running_daemon(shutdown_store_timeout=0.05) as daemon:
            daemon.storage = storage
            e = await Engine.register(daemon, "t/drop", write_policy="write_through")
            await e.insert(prompt(0, 4), [0, 1, 2, 3])  # on host; stored only by the drop (write_back storage)
            await e.close()
            ns = e.ns
            admin.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
            try:
                drop = asyncio.ensure_future(daemon.drop_namespace("t/drop", store=True))
                await until(lambda: "t/drop" not in daemon.namespaces, "the drop waiting for its stores in flight")
                drop.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await drop
            finally:
                admin.execute_command("CLIENT", "UNPAUSE")
            again = await Engine.register(daemon, "t/drop")  # the drop's end comes first
            assert ns.host_pool.closed and ns.cache.residency_listener is None
            assert again.ns is not ns
            await again.close()
        assert ns.host_pool.closed  # the daemon's close knew only the registry's namespaces

    try:
        run(scenario())
    finally:
        storage.close()
        admin.close()


def test_a_load_back_whose_copy_cannot_start_is_answered_and_acknowledged_failed(monkeypatch):
    async def cannot_start(self, transfer):  # as the CUDA engine raises when enqueueing fails
        raise CopyError(f"copy of transfer {transfer} failed: cudaMemcpyAsync: invalid argument")

    async def scenario():
        async with running_daemon(fault_fail_loads=1.0) as daemon:
            e = await Engine.register(daemon, "t/enqueue")
            await e.insert(prompt(0, 4), [0, 1, 2, 3])
            await e.evict(4)
            m = await e.match(prompt(0, 4))
            monkeypatch.setattr(CopyEngine, "layer_events", cannot_start)
            lb = await e.ns.load_back(e.session, m.result.host_node, pack([10, 11, 12, 13]))
            assert lb.result.transfer and lb.layer_events == ()
            done = await e.ns.ack(e.session, lb.result.transfer)
            assert done.error and sorted(unpack(done.failed_pages)) == [10, 11, 12, 13]
            holds_nothing(e.ns)
            await e.insert(prompt(100, 4), [10, 11, 12, 13])  # the engine's pages again
            await e.close()
    run(scenario())


def test_a_close_waits_for_no_store_of_pages_that_stay(private_redis):
    """A store only reads host pages that outlive the engine's session: its Close is
    answered while a store to a store that pauses writes is still in flight (it waited
    for the store, past the engine's deadline with a slow one), and the store completes
    after it."""
    admin = redis.Redis(unix_socket_path=private_redis.socket)
    storage = open_storage(private_redis.url + "?socket_timeout=60")

    async def scenario():
        async with running_daemon(storage_policy="write_through") as daemon:
            daemon.storage = storage
            e = await Engine.register(daemon, "t/store", write_policy="write_through")
            ns = e.ns
            stores = lambda: [t for t in ns.cache.transfers.values() if t.kind is TransferKind.STORE]  # noqa: E731
            admin.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
            try:
                await e.insert(prompt(0, 4), [0, 1, 2, 3])
                await until(stores, "the backup settled, its store sent (and held by the paused server)")
                await asyncio.wait_for(e.close(), 10)  # waited for the store before
                assert stores(), "the store should still be in flight"
            finally:
                admin.execute_command("CLIENT", "UNPAUSE")
            await until(lambda: not stores(), "the store to end once the server answers")
            assert ns.counters()["stored_tokens"] == 16
            assert ns.check_invariants() == []

    try:
        run(scenario())
    finally:
        storage.close()
        admin.close()
