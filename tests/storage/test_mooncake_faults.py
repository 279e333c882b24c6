"""Mooncake Store failures, on a real `mooncake_master` and lender processes ("other
nodes"): each ends in a miss or StorageUnavailable within the configured timeout, never
in wrong bytes or a hang. Facts of the 0.3.13 wheel: see storage/mooncake_store.py."""

import logging
import os
import signal
import time

import numpy as np
import pytest

from radixkv_server.storage import StorageFull, StorageTimeout, StorageUnavailable, open_storage
from radixkv_server.storage.mooncake_store import CLOSE_GRACE_S, MooncakeStorage, _close_store
from tests.storage.fleet import Lender, MooncakeMaster, Ticker, lender_keys, poll

PAGE = 16 << 10
TIMEOUT_S = 1.0
SLACK_S = 1.0  # scheduling on a busy 2-core machine
GIL_BOUND_S = 5.0  # the longest a ticking thread may wait for the GIL (setup() held it ~60 s)


@pytest.fixture
def master():
    m = MooncakeMaster(client_ttl_s=2).start()
    yield m
    m.cleanup()


@pytest.fixture
def lenders():
    started = []
    yield started.append
    for lender in started:
        lender.kill()


def reader(master, **options) -> tuple[MooncakeStorage, np.ndarray]:
    """A backend lending nothing, with a 'host pool' of 64 pages attached; joined."""
    options.setdefault("timeout", TIMEOUT_S)
    b = MooncakeStorage(master.address, segment_bytes=options.pop("segment_bytes", 0), **options)
    pool = np.zeros((64, PAGE), dtype=np.uint8)
    b.attach_memory(pool.ctypes.data, pool.nbytes)
    poll(lambda: _joined(b), 20, "the backend to join the store")
    return b, pool


def _joined(b) -> bool:
    try:
        b.check()
        return True
    except StorageUnavailable:
        return False


def timed(call):
    start = time.monotonic()
    try:
        return call(), time.monotonic() - start
    except StorageUnavailable as exc:
        return exc, time.monotonic() - start


def test_what_one_node_stored_another_serves_byte_exact(master, lenders):
    a = Lender(master.address, 64 << 20, 32, PAGE, seed=11)
    lenders(a)
    assert a.stored == 32
    b, pool = reader(master)
    assert b.exists_prefix(a.keys()) == 32
    assert b.get_into(a.keys(), [memoryview(pool[i]) for i in range(32)]) == 32
    assert [pool[i].tobytes() for i in range(32)] == a.pages()
    b.close()


def test_full_store_refuses_puts_and_keeps_what_it_holds_exact(master, lenders):
    lenders(Lender(master.address, 16 << 20, 0, 0, seed=0))  # the smallest segment: ~1000 pages
    b, pool = reader(master)
    pool[:] = np.random.default_rng(5).integers(0, 256, size=pool.shape, dtype=np.uint8)
    stored, full = {}, None
    for batch in range(40):
        keys = lender_keys(1000 + batch, 64)
        try:
            b.put([(k, memoryview(pool[i])) for i, k in enumerate(keys)])
            stored.update({k: i for i, k in enumerate(keys)})
        except StorageUnavailable as exc:
            full = exc
            break
    assert isinstance(full, StorageFull) and "store full" in str(full)  # a refusal, not an outage
    mismatches = 0
    out = np.zeros((1, PAGE), dtype=np.uint8)
    for key, row in stored.items():  # evicted in the background or exact, never other bytes
        b.attach_memory(out.ctypes.data, out.nbytes)
        if b.get_into([key], [memoryview(out[0])]) == 1 and not np.array_equal(out[0], pool[row]):
            mismatches += 1
    assert mismatches == 0
    b.close()


def test_killed_segment_owner_turns_its_pages_into_misses(master, lenders, caplog):
    a = Lender(master.address, 64 << 20, 16, PAGE, seed=12)
    lenders(a)
    b, pool = reader(master, timeout=2 * TIMEOUT_S)
    pages = [memoryview(pool[i]) for i in range(16)]
    assert b.get_into(a.keys(), pages) == 16
    pool[:] = 0
    a.kill()
    # The store fails a transfer to a dead peer it was connected to after about 1 s: one
    # node of the pool failed, not the store, so its pages are misses (a fault would
    # pause the daemon's lookups of every node's pages).
    read, seconds = timed(lambda: b.get_into(a.keys(), pages))
    assert read == 0 and seconds < 2 * TIMEOUT_S + SLACK_S
    assert not pool.any()  # nothing was written
    assert "storage.segment_owner_lost" in caplog.text
    # Once the master drops the dead client (client_ttl), its keys are plainly absent.
    poll(lambda: b.exists_prefix(a.keys()) == 0, 20, "the master to drop the dead owner's keys")
    b.close()


def test_each_segment_owner_death_is_logged_not_only_the_first(master, lenders, caplog):
    caplog.set_level(logging.WARNING)
    b, pool = reader(master, timeout=2 * TIMEOUT_S)
    pages = [memoryview(pool[i]) for i in range(8)]
    told = []
    for seed in (31, 32):
        a = Lender(master.address, 64 << 20, 8, PAGE, seed=seed)
        lenders(a)
        assert b.get_into(a.keys(), pages) == 8  # a clean read: the last outage (if any) ended
        a.kill()
        for _ in range(2):  # the second read, in the same outage, is not logged again
            assert b.get_into(a.keys(), pages) == 0
        told.append(caplog.text.count("storage.segment_owner_lost"))
        poll(lambda: b.exists_prefix(a.keys()) == 0, 20, "the master to drop the dead owner")
    assert told == [1, 2]
    b.close()


def test_frozen_segment_owner_or_master_never_blocks_past_the_timeout(master, lenders):
    a = Lender(master.address, 64 << 20, 8, PAGE, seed=13)
    lenders(a)
    b, pool = reader(master)
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        exc, seconds = timed(lambda: b.get_into(a.keys(), [memoryview(pool[i]) for i in range(8)]))
        assert isinstance(exc, StorageTimeout) and seconds < TIMEOUT_S + SLACK_S
        assert not exc.settled.done()  # the store's call is still out: its pages must stay reserved
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    os.kill(master.proc.pid, signal.SIGSTOP)
    try:
        found, seconds = timed(lambda: b.exists_prefix(lender_keys(77, 4)))
        assert seconds < TIMEOUT_S + SLACK_S
        assert found == 0 or isinstance(found, StorageUnavailable)  # a miss or an error, in time
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    b.close()


def test_master_killed_and_restarted_loses_keys_and_then_works_again(master):
    b, pool = reader(master, segment_bytes=32 << 20)
    told = []
    b.on_lost(lambda: told.append(b.generation))
    pool[:] = np.random.default_rng(6).integers(0, 256, size=pool.shape, dtype=np.uint8)
    old, new = lender_keys(21, 8), lender_keys(22, 8)
    assert b.put([(k, memoryview(pool[i])) for i, k in enumerate(old)]) == 8
    assert b.exists_prefix(old) == 8
    poll(lambda: b._client().is_exist(b.sentinel.key) == 1, 10, "the sentinel placed")  # noqa: SLF001
    assert told == []
    master.kill()
    for call in (lambda: b.exists_prefix(old), lambda: b.put([(new[0], memoryview(pool[0]))])):
        exc, seconds = timed(call)
        assert isinstance(exc, StorageUnavailable) and seconds < TIMEOUT_S + SLACK_S
    master.start()  # same port, empty; the client re-mounts its segment by itself
    poll(lambda: _put_ok(b, new, pool), 30, "puts to work after the master restart")
    assert b.exists_prefix(old) == 0
    poll(lambda: told == [1], 10, "the backend to say the store came back empty")
    assert b.exists_prefix(new) == 8 and told == [1]  # once
    assert b.get_into(new, [memoryview(pool[32 + i]) for i in range(8)]) == 8
    assert np.array_equal(pool[32:40], pool[:8])
    b.close()


def test_a_live_master_never_reads_as_lost_and_close_takes_the_sentinel_out(master):
    lender, _ = reader(master, segment_bytes=32 << 20)  # holds the pages, and the sentinel
    b, pool = reader(master)
    b.sentinel.interval = 0  # look on every call
    told = []
    b.on_lost(lambda: told.append(b.generation))
    keys = lender_keys(23, 4)
    for _ in range(5):
        b.put([(k, memoryview(pool[i])) for i, k in enumerate(keys)])
        assert b.exists_prefix(keys) == 4
    poll(lambda: lender._client().is_exist(b.sentinel.key) == 1, 10, "the sentinel placed")  # noqa: SLF001
    b.close()
    assert told == [] and b.generation == 0
    assert lender._client().is_exist(b.sentinel.key) == 0  # noqa: SLF001
    lender.close()


def _put_ok(b, keys, pool) -> bool:
    try:
        b.put([(k, memoryview(pool[i])) for i, k in enumerate(keys)])
        return b.exists_prefix(keys) == len(keys)
    except StorageUnavailable:
        return False


def test_unreachable_master_is_unavailable_at_once_and_joins_when_it_appears():
    m = MooncakeMaster()
    b = MooncakeStorage(m.address, segment_bytes=0, timeout=TIMEOUT_S)
    try:
        exc, seconds = timed(b.check)
        assert isinstance(exc, StorageUnavailable) and seconds < TIMEOUT_S + SLACK_S
        m.start()
        poll(lambda: _joined(b), 60, "joining once the master listens")
    finally:
        b.close()
        m.cleanup()


def test_frozen_master_never_freezes_the_process_joining_it_and_it_joins_once_resumed(caplog):
    m = MooncakeMaster().start()
    os.kill(m.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    b = MooncakeStorage(m.address, segment_bytes=0, timeout=TIMEOUT_S)
    ticker = Ticker()
    try:
        for _ in range(3):  # each a join attempt (one a second at most)
            exc, seconds = timed(b.check)
            assert isinstance(exc, StorageUnavailable) and seconds < TIMEOUT_S + SLACK_S
            time.sleep(1.1)
        assert ticker.stop() < GIL_BOUND_S  # setup() was never called: it would hold the GIL ~60 s
        told = [r.fields for r in caplog.records if r.levelno >= logging.WARNING
                and r.getMessage() == "storage.master_unreachable"]
        assert len(told) == 1  # once per outage, not once per retry
        assert told[0]["master"] == m.address and "did not answer within" in told[0]["error"]
        os.kill(m.proc.pid, signal.SIGCONT)
        poll(lambda: _joined(b), 20, "joining once the master answers")
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)
        b.close()
        m.cleanup()


def test_closing_while_the_master_is_frozen_never_freezes_the_process(master):
    b, _ = reader(master, segment_bytes=32 << 20)  # lending: closing unmounts it at the master
    store = b._member._store
    os.kill(master.proc.pid, signal.SIGSTOP)
    ticker = Ticker()
    try:
        _, seconds = timed(b.close)  # the store's close() would hold the GIL ~60 s: skipped
        # Asking the master takes TIMEOUT_S; a store call the freeze caught (the sentinel's
        # check, every 5 s) is waited for up to the close's grace first (it took 2.0 s
        # against a bound of TIMEOUT_S + SLACK_S once in a whole run).
        assert seconds < max(CLOSE_GRACE_S, TIMEOUT_S) + SLACK_S and ticker.stop() < GIL_BOUND_S
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
        # The skipped close, made now that the master answers and no store call the
        # freeze caught still runs: a store left open pings the master this fixture
        # stops for the rest of the run, and its destructor at the test process's exit
        # waits ~20 s on it to unmount the lent segment.
        if b._calls.settle(30):
            _close_store(store, b._member, b.sentinel, b.name)


def test_a_detached_pool_is_unregistered_and_a_new_one_at_its_address_registered_afresh(master):
    """A namespace's pool closes (DropNamespace): its memory is unregistered, since
    registered memory stays pinned to its old pages (a new pool at the same address
    would be read through them over RDMA), and pages from it take the copying path."""
    b, pool = reader(master)
    try:
        addr, nbytes = pool.ctypes.data, pool.nbytes
        assert b._attached(pool[0]) and addr in b._member._registered
        b.detach_memory(addr, nbytes)
        assert not b._attached(pool[0]) and addr not in b._member._registered
        b.attach_memory(addr, nbytes)  # a new pool where the old one was
        assert b._attached(pool[0]) and addr in b._member._registered
    finally:
        b.close()


def test_url_options():
    b = open_storage("mooncake://10.0.0.7:50051?segment=1GiB&buffer=32MiB&protocol=rdma&devices=mlx5_0"
                     "&timeout=0.5&prefix=team:&replicas=2&batch=64")
    assert isinstance(b, MooncakeStorage) and b.name == "mooncake://10.0.0.7:50051"
    assert (b.timeout, b.prefix, b.max_batch) == (0.5, "team:", 64)
    assert b._setup_args[2:6] == (1 << 30, 32 << 20, "rdma", "mlx5_0")
    b.close()


@pytest.mark.parametrize("url, message", [
    ("mooncake://host", "HOST:PORT"),
    ("mooncake://host:50051/x", "must be mooncake://HOST:PORT"),
    ("mooncake://host:50051?protocol=udp", "protocol must be tcp or rdma"),
    ("mooncake://host:50051?segment=lots", "bad Mooncake option segment"),
    ("mooncake://host:50051?timeout=0", "timeout must be a positive"),
    ("mooncake://host:50051?timeout=inf", "timeout must be a positive"),  # OverflowError at every call, before
    ("mooncake://host:50051?segment=4MiB", "at least 16MiB"),
    ("mooncake://host:50051?colour=blue", "unknown Mooncake option"),
])
def test_bad_urls(url, message):
    with pytest.raises(ValueError, match=message):
        open_storage(url)


@pytest.mark.parametrize("url, warned", [
    ("mooncake://10.0.0.7:50051", True),  # lends the default segment as 127.0.0.1 to a remote master
    ("mooncake://10.0.0.7:50051?hostname=10.0.0.9", False),
    ("mooncake://10.0.0.7:50051?segment=0", False),  # lends none
    ("mooncake://127.0.0.1:50051", False),  # one machine
])
def test_a_segment_lent_under_a_loopback_hostname_to_a_remote_master_is_warned_about(url, warned, caplog):
    """Other nodes read a lent segment at its `hostname`: as 127.0.0.1 they read their own
    machine, and the failures read as a dead owner (the store operators' review)."""
    with caplog.at_level("WARNING", logger="radixkv.storage"):
        open_storage(url).close()
    assert ("storage.segment_unreachable" in caplog.text) == warned


def test_a_metadata_url_with_credentials_is_never_shown():
    """Mooncake's metadata= may be an etcd or http URL with a user and password: the
    daemon's start log (describe()) and the URL errors showed it whole."""
    from radixkv_server.config import without_passwords

    url = "mooncake://host:50051?metadata=http://ops:hunter2@etcd:2379&segment=lots"
    assert without_passwords(url) == "mooncake://host:50051?metadata=http://ops:<set>@etcd:2379&segment=lots"
    with pytest.raises(ValueError, match="bad Mooncake option segment") as refused:
        open_storage(url)
    assert "hunter2" not in str(refused.value)
