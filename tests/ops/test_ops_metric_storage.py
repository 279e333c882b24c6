"""The storage tier's own metrics hold the values a known workload makes them hold: calls
per operation (the histogram's counts), pages by operation and result, and stores and
fetches in flight while the store is stuck. Real daemon processes, scraped over HTTP;
expected values worked out by hand in the comments (pages of PAGE_SIZE tokens).

A store is held in flight by stopping a real redis-server (SIGSTOP: the daemon's write
waits on its socket); a fetch by a page file that is a FIFO, whose read blocks until
the test opens the other end (a page on a stuck network filesystem), then ends empty:
a damaged page, counted and removed.
"""

import math
import os
import signal
import time

from prometheus_client.parser import text_string_to_metric_families
from radixkv_server.core.page_keys import namespace_salt
from radixkv_server.core.page_keys import page_keys as storage_page_keys
from radixkv_server.core.page_keys import layout_fingerprint
from radixkv_server.storage import FileStorage
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import wait_for
from tests.support.engine import LAYOUT

from rawengine import PAGE_SIZE, RPC_TIMEOUT_S, RawEngine, fresh_tokens
from scrape import DEADLINE_S, series, value, wait_value

PAGE_BYTES = LAYOUT.page_bytes
PAGE = PAGE_SIZE
P = 4 * PAGE  # every prompt here is 4 pages


def page_path(directory, namespace: str, tokens: list[int], page: int) -> str:
    """Where a file page directory keeps page `page` of `tokens`."""
    salt = namespace_salt(namespace, layout_fingerprint(LAYOUT))
    key = storage_page_keys(salt, pack(tokens), PAGE)[page]
    return FileStorage(str(directory)).path_for(key)


def damage(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4)
        f.write(b"\xde\xad\xbe\xef")


def storage_series(daemon) -> dict:
    """The daemon-wide storage samples: {(name, labels): value}."""
    out = {}
    for family in text_string_to_metric_families(daemon.scrape()):
        for s in family.samples:
            if s.name.startswith("radixkv_storage_") and not s.name.endswith(("_bucket", "_sum")):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def calls(operation: str) -> tuple:
    return ("radixkv_storage_operation_duration_seconds_count", (("operation", operation),))


def pages(operation: str, result: str) -> tuple:
    return ("radixkv_storage_pages_total", (("operation", operation), ("result", result)))


def match_with_storage(e: RawEngine, tokens: list[int]) -> pb.MatchResult:
    return e.stub.Match(pb.MatchRequest(session=e.session, prompts=[pb.Prompt(tokens=pack(tokens))],
                                        include_storage=True), timeout=RPC_TIMEOUT_S).results[0]


def store_to_host_and_storage(e: RawEngine, daemon, namespace: str, tokens: list[int], stored_before: int) -> None:
    """Insert, evict (written back to host), then wait for the write-through store."""
    assert e.insert(tokens) == 0
    e.evict(e.pool.num_pages)
    wait_value(daemon, namespace, "radixkv_stored_tokens_total", stored_before + len(tokens))


def test_storage_calls_and_pages_of_a_known_workload(daemon_factory, tmp_path):
    """One daemon stores a and b; the next, on the same directory, stores a again (its
    pages are there already) and prefetches b, whose page 1 was damaged meanwhile."""
    directory = tmp_path / "pages"
    flags = ("--storage", f"file://{directory}", "--storage-policy", "write_through")
    ns = "ops/storage-calls"
    a, b = fresh_tokens(P), fresh_tokens(P)
    first = daemon_factory(*flags)
    e = RawEngine(first.target, ns, host_pool_pages=16)
    try:
        store_to_host_and_storage(e, first, ns, a, 0)                  # put call 1: 4 stored
        store_to_host_and_storage(e, first, ns, b, P)                  # put call 2: 4 stored
        got = storage_series(first)
        assert (got[calls("put")], got[pages("put", "stored")], got[pages("put", "already_present")]) == (2, 8, 0)
        assert calls("get") not in got and calls("exists") not in got  # nothing read yet
        e.close()
    finally:
        e.release_memory()
    assert first.stop() == 0
    damage(page_path(directory, ns, b, page=1))

    second = daemon_factory(*flags)
    e = RawEngine(second.target, ns, host_pool_pages=16)
    try:
        # a again: a fresh cache writes it through, and finds every page present.
        assert e.insert(a) == 0
        e.evict(e.pool.num_pages)                                      # put call 1: 4 present
        wait_for(lambda: storage_series(second).get(pages("put", "already_present")) == 4, DEADLINE_S,
                 "a's 4 pages found present")
        # b: the probe finds 4 pages (call exists 1); the read (call get 1) takes page 0,
        # finds page 1 damaged (dropped) and ends there: pages 2 and 3 count as misses.
        progress = list(e.stub.Prefetch(pb.PrefetchRequest(session=e.session, tokens=pack(b),
                                                           policy="wait_complete"), timeout=RPC_TIMEOUT_S))
        assert progress[-1].state == pb.PrefetchProgress.DONE and progress[-1].host_tokens_added == PAGE
        assert not os.path.exists(page_path(directory, ns, b, page=1))
        got = storage_series(second)
        want = {
            calls("put"): 1, calls("exists"): 1, calls("get"): 1,
            pages("put", "stored"): 0, pages("put", "already_present"): 4,
            pages("get", "hit"): 1, pages("get", "corrupt"): 1, pages("get", "miss"): 2,
            ("radixkv_storage_bytes_total", (("direction", "read"),)): PAGE_BYTES,
            ("radixkv_storage_bytes_total", (("direction", "write"),)): 0,
            ("radixkv_storage_up", ()): 1,
            ("radixkv_storage_failing", (("direction", "read"),)): 0,
            ("radixkv_storage_failing", (("direction", "write"),)): 0,
        }
        assert {k: got.get(k) for k in want} == want
        errors = {labels: v for (name, labels), v in got.items() if name == "radixkv_storage_errors_total"}
        assert errors == {(("operation", op),): 0 for op in ("exists", "get", "put")}   # exported, none failed
        assert value(second, ns, "radixkv_prefetched_tokens_total") == PAGE
        e.close()
    finally:
        e.release_memory()


def in_flight(daemon, namespace: str, kind: str) -> float:
    return value(daemon, namespace, "radixkv_transfers_in_flight", kind=kind)


def test_a_store_is_in_flight_while_redis_is_stopped(daemon_factory, private_redis):
    url = f"{private_redis.url}?socket_timeout=120"  # the write waits, rather than failing
    d = daemon_factory("--storage", url, "--storage-policy", "write_through")
    ns = "ops/store-flight"
    e = RawEngine(d.target, ns, host_pool_pages=16)
    try:
        store_to_host_and_storage(e, d, ns, fresh_tokens(P), 0)        # redis answers: put call 1
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            assert e.insert(fresh_tokens(P)) == 0
            e.evict(e.pool.num_pages)     # the write-back lands on host; its store then waits
            wait_value(d, ns, "radixkv_transfers_in_flight", 1, kind="store")
            assert in_flight(d, ns, "write_back") == 0 and in_flight(d, ns, "fetch") == 0
            assert value(d, ns, "radixkv_stored_tokens_total") == P
            assert storage_series(d)[calls("put")] == 1                 # the second is not done
            assert value(d, ns, "radixkv_storage_queued_pages") == 4    # its 4 pages wait in the queue
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        wait_value(d, ns, "radixkv_stored_tokens_total", 2 * P)
        got = storage_series(d)
        assert (got[calls("put")], got[pages("put", "stored")]) == (2, 8)
        assert in_flight(d, ns, "store") == 0
        e.close()
    finally:
        e.release_memory()


def open_other_end(path: str) -> None:
    """Open and close the FIFO's write end if a reader waits on it (EOF for that reader)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader right now (ENXIO), or the FIFO is gone
        pass


def test_a_fetch_is_in_flight_while_its_page_read_is_stuck(daemon_factory, tmp_path):
    directory = tmp_path / "pages"
    d = daemon_factory("--storage", f"file://{directory}")
    ns = "ops/fetch-flight"
    tokens = fresh_tokens(P)
    fifo = page_path(directory, ns, tokens, page=0)
    os.makedirs(os.path.dirname(fifo))
    os.mkfifo(fifo)                      # storage "holds" page 0 of tokens; reading it blocks
    e = RawEngine(d.target, ns, host_pool_pages=16)
    try:
        [started] = e.stub.Prefetch(pb.PrefetchRequest(session=e.session, tokens=pack(tokens)),
                                    timeout=RPC_TIMEOUT_S)             # best effort: answers at once
        assert started.state == pb.PrefetchProgress.STARTED and started.storage_tokens == PAGE
        wait_value(d, ns, "radixkv_transfers_in_flight", 1, kind="fetch")
        assert in_flight(d, ns, "store") == 0
        assert storage_series(d).get(calls("get")) is None             # the read has not returned
        # Let the read end: it finds no bytes (a damaged page), drops the page and fetches nothing.
        wait_for(lambda: open_other_end(fifo) or in_flight(d, ns, "fetch") == 0, DEADLINE_S,
                 "the fetch to end once its read does")
        got = storage_series(d)
        assert (got[calls("get")], got[pages("get", "corrupt")], got[pages("get", "hit")]) == (1, 1, 0)
        assert not os.path.exists(fifo)
        assert value(d, ns, "radixkv_prefetched_tokens_total") == 0
        assert e.match(tokens).host_tokens == 0
        e.close()
    finally:
        e.release_memory()


def test_lookups_pause_while_the_store_refuses_connections(daemon_factory, private_redis):
    """A stopped Redis refuses connections: each lookup failed in a fraction of a second,
    and every Match with storage paid it. Now a failed lookup pauses lookups (1 s at
    first), Matches answer without storage meanwhile, and one lookup per pause tries
    again: a burst of Matches reaches the store once, and it is used again once back."""
    d = daemon_factory("--storage", private_redis.url, "--storage-policy", "write_through")
    ns = "ops/lookup-pause"
    e = RawEngine(d.target, ns, host_pool_pages=16)
    try:
        store_to_host_and_storage(e, d, ns, fresh_tokens(P), 0)
        private_redis.stop()

        before, start = storage_series(d).get(calls("exists"), 0), time.monotonic()
        for _ in range(30):
            assert match_with_storage(e, fresh_tokens(P)).storage_tokens == 0
        elapsed = time.monotonic() - start
        got = storage_series(d)
        # The first lookup, then one per pause that ended (1 s, 2 s, 4 s, ...) while the 30 ran.
        assert got[calls("exists")] - before <= 1 + int(math.log2(elapsed + 1))
        assert got[("radixkv_storage_failing", (("direction", "read"),))] == 1
        private_redis.start()

        def used_again():
            match_with_storage(e, fresh_tokens(P))  # past the pause, one lookup goes to the store, and succeeds
            return storage_series(d)[("radixkv_storage_failing", (("direction", "read"),))] == 0
        wait_for(used_again, DEADLINE_S, "lookups to use the store again")
        e.close()
    finally:
        e.release_memory()


def test_a_store_that_succeeds_ends_the_pause_of_lookups(daemon_factory, private_redis):
    """Lookups that keep failing pause for longer each time (1 s, 2 s, 4 s, ...); a store
    that succeeds after failed ones shows the store answers again, so the next lookup
    goes to it at once instead of waiting out the pause (radixkv_storage_up stayed 0
    meanwhile)."""
    d = daemon_factory("--storage", private_redis.url, "--storage-policy", "write_through")
    ns = "ops/lookup-resume"
    e = RawEngine(d.target, ns, host_pool_pages=16)
    try:
        store_to_host_and_storage(e, d, ns, fresh_tokens(P), 0)
        private_redis.stop()

        def third_failure():  # past the 1 s and 2 s pauses: the next one is 4 s long
            match_with_storage(e, fresh_tokens(P))
            return storage_series(d).get(calls("exists"), 0) >= 3 + before
        before = storage_series(d).get(calls("exists"), 0)
        wait_for(third_failure, DEADLINE_S, "three failed lookups", interval=0.1)
        assert e.insert(fresh_tokens(P)) == 0  # the engine goes on: its store fails too
        e.evict(e.pool.num_pages)
        wait_for(lambda: storage_series(d).get(("radixkv_storage_failing", (("direction", "write"),))) == 1,
                 DEADLINE_S, "the store to fail")
        private_redis.start()
        store_to_host_and_storage(e, d, ns, fresh_tokens(P), 4 * PAGE)
        assert match_with_storage(e, fresh_tokens(P)).storage_tokens == 0  # a miss, but asked of the store
        series_now = storage_series(d)
        assert series_now[("radixkv_storage_failing", (("direction", "read"),))] == 0
        assert series_now[("radixkv_storage_up", ())] == 1
        e.close()
    finally:
        e.release_memory()


def test_one_namespace_storing_again_ends_the_outage_another_began(daemon_factory, private_redis):
    """The store is one, whatever namespace's call finds it failing or answering again.
    Kept per namespace, a namespace whose stores failed and that then went quiet held
    radixkv_storage_failing{write} at 1 (and its alert firing) after Redis took writes
    again and another namespace stored through it. A store that refuses writes and
    serves reads (Redis at maxmemory, noeviction) reads radixkv_storage_up 1."""
    d = daemon_factory("--storage", private_redis.url, "--storage-policy", "write_through")
    a = RawEngine(d.target, "ops/outage-a", host_pool_pages=16)
    b = RawEngine(d.target, "ops/outage-b", host_pool_pages=16)
    redis = private_redis.client()
    try:
        redis.config_set("maxmemory", "1mb")  # below what it uses: every write refused
        assert a.insert(fresh_tokens(P)) == 0
        a.evict(a.pool.num_pages)
        wait_value(d, "ops/outage-a", "radixkv_store_failed_tokens_total", P)
        got = storage_series(d)
        assert got[("radixkv_storage_failing", (("direction", "write"),))] == 1
        assert got[("radixkv_storage_up", ())] == 1  # reads still answer
        assert match_with_storage(b, fresh_tokens(P)).storage_tokens == 0

        redis.config_set("maxmemory", "0")
        store_to_host_and_storage(b, d, "ops/outage-b", fresh_tokens(P), 0)  # a is quiet
        got = storage_series(d)
        assert got[("radixkv_storage_failing", (("direction", "write"),))] == 0
        assert got[("radixkv_storage_up", ())] == 1
        log = d.log()
        assert "event=storage.unavailable namespace=ops/outage-a direction=write" in log
        assert "event=storage.recovered namespace=ops/outage-b direction=write" in log
        a.close()
        b.close()
    finally:
        redis.close()
        a.release_memory()
        b.release_memory()


def test_another_namespaces_lookup_ends_the_read_outage_one_began(daemon_factory, private_redis):
    """Reads too: a namespace whose lookup failed while Redis was down, quiet since, held
    radixkv_storage_up at 0 while another namespace's lookups were answered."""
    d = daemon_factory("--storage", private_redis.url, "--storage-policy", "write_through")
    a = RawEngine(d.target, "ops/read-a", host_pool_pages=16)
    b = RawEngine(d.target, "ops/read-b", host_pool_pages=16)
    try:
        private_redis.stop()
        assert match_with_storage(a, fresh_tokens(P)).storage_tokens == 0  # fails: a read outage
        assert storage_series(d)[("radixkv_storage_up", ())] == 0
        private_redis.start()
        assert match_with_storage(b, fresh_tokens(P)).storage_tokens == 0  # a miss, answered
        assert storage_series(d)[("radixkv_storage_up", ())] == 1
        assert "event=storage.recovered namespace=ops/read-b direction=read" in d.log()
        a.close()
        b.close()
    finally:
        a.release_memory()
        b.release_memory()
