"""Every documented cache counter holds the value a known workload makes it hold.

A real daemon process, scraped over HTTP, its /metrics text parsed with prometheus-client's
parser. Each workload is small and its expected values are worked out by hand in the
comments (pages of PAGE_SIZE tokens, PAGE_BYTES bytes each), never read back from the
daemon: zeroing or mis-wiring any counter in the daemon fails one of these tests.
"""

import os
import shutil

from radixkv_server.core.page_keys import namespace_salt
from radixkv_server.core.page_keys import page_keys as storage_page_keys
from radixkv_server.core.page_keys import layout_fingerprint
from radixkv_server.storage import FileStorage
from radixkv.types import pack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.engine import LAYOUT

from rawengine import PAGE_SIZE, RPC_TIMEOUT_S, RawEngine, fresh_tokens
from scrape import counter, series, value, wait_value

PAGE_BYTES = LAYOUT.page_bytes
PAGE = PAGE_SIZE  # tokens per page
P = 4 * PAGE  # every prompt here is 4 pages


def evicted(reason: str) -> tuple:
    tier = "host" if reason in ("duplicate", "capacity") else "device"
    return ("radixkv_evicted_tokens_total", (("reason", reason), ("tier", tier)))


def evict_all(engine: RawEngine, daemon, namespace: str, written_back_before: int, write_backs: int) -> None:
    """Evict everything the cache holds on device, then wait until `write_backs` more
    tokens were written back (the copies finish after Evict answers)."""
    engine.evict(engine.pool.num_pages)
    wait_value(daemon, namespace, "radixkv_evicted_tokens_total", written_back_before + write_backs,
               tier="device", reason="write_back")


def damage(directory, namespace: str, tokens: list[int], page: int) -> None:
    """Flip the last bytes of page `page` of `tokens` in a file page directory."""
    salt = namespace_salt(namespace, layout_fingerprint(LAYOUT))
    key = storage_page_keys(salt, pack(tokens), PAGE)[page]
    path = FileStorage(str(directory)).path_for(key)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4)
        f.write(b"\xde\xad\xbe\xef")


def test_device_and_host_counters_of_a_known_workload(daemon):
    """A host pool of 4 pages, write-back, prompts of 4 pages: every eviction reason,
    load-backs, duplicates, inserts and matches, each with a value worked out by hand."""
    ns = "ops/values"
    e = RawEngine(daemon.target, ns, host_pool_pages=4, write_policy="write_back")
    try:
        a, b, c, d = (fresh_tokens(P) for _ in range(4))
        assert e.insert(a) == 0 and e.insert(b) == 0                    # inserted 2P
        # Evict both (8 pages) at once: the first claims the whole host pool (its write-back
        # in flight locks it), so the second has no host room and nothing there to evict.
        evict_all(e, daemon, ns, 0, P)                                  # write_back P, dropped P
        assert e.insert(c) == 0                                         # inserted 3P
        # c needs the host's 4 pages: the written-back prompt (host only) is evicted.
        evict_all(e, daemon, ns, P, P)                                  # capacity P, write_back 2P
        assert e.load_back(c) == P                                      # matched 1 (host hit P), loaded P
        # c is now on device and host (a duplicate). Lease it so eviction passes it by:
        # d's write-back then needs host room, which only c's duplicate copy can give.
        lease = e.stub.Match(pb.MatchRequest(session=e.session, prompts=[pb.Prompt(tokens=pack(c))],
                                             lease=True), timeout=RPC_TIMEOUT_S).results[0].lease
        assert lease                                                    # matched 2 (device hit P)
        assert value(daemon, ns, "radixkv_leases") == 1
        assert e.insert(d) == 0                                         # inserted 4P
        e.evict(4)
        wait_value(daemon, ns, "radixkv_evicted_tokens_total", 3 * P, tier="device", reason="write_back")
        e.stub.Release(pb.ReleaseRequest(session=e.session, leases=[lease]), timeout=RPC_TIMEOUT_S)
        # duplicate P, write_back 3P. Now c is on device only, d on host only: evicting c
        # evicts d from the host for room.
        evict_all(e, daemon, ns, 3 * P, P)                              # capacity 2P, write_back 4P
        assert e.load_back(c) == P                                      # matched 3 (host P), loaded 2P
        e.evict(e.pool.num_pages)                                       # c has a host copy: host_copy P
        assert e.match(a).device_tokens == 0                            # matched 4 (miss P)
        got = series(daemon.scrape(), ns)
        want = {
            counter("radixkv_inserted_tokens_total"): 4 * P,
            counter("radixkv_matched_prompts_total"): 4,
            ("radixkv_hit_tokens_total", (("tier", "device"),)): P,
            ("radixkv_hit_tokens_total", (("tier", "host"),)): 2 * P,
            counter("radixkv_miss_tokens_total"): P,
            counter("radixkv_load_back_tokens_total"): 2 * P,
            counter("radixkv_load_back_bytes_total"): 2 * 4 * PAGE_BYTES,
            counter("radixkv_load_back_failed_tokens_total"): 0,
            counter("radixkv_backup_tokens_total"): 4 * P,
            counter("radixkv_backup_bytes_total"): 4 * 4 * PAGE_BYTES,
            evicted("write_back"): 4 * P,
            evicted("dropped"): P,
            evicted("host_copy"): P,
            evicted("duplicate"): P,
            evicted("capacity"): 2 * P,
            counter("radixkv_dropped_write_back_tokens_total"): P,
            counter("radixkv_duplicate_reclaimed_tokens_total"): P,
            # State after the workload: c on host only (4 pages), nothing on device.
            counter("radixkv_host_pool_used_bytes"): 4 * PAGE_BYTES,
            counter("radixkv_host_pool_capacity_bytes"): 4 * PAGE_BYTES,
            counter("radixkv_host_pool_pinned"): 0,  # no CUDA here: pinning is for CUDA copies
            counter("radixkv_device_pages"): 64,
            ("radixkv_device_pages_held", (("state", "evictable"),)): 0,
            ("radixkv_device_pages_held", (("state", "protected"),)): 0,
            counter("radixkv_tree_nodes"): 1,
            counter("radixkv_tracked_duplicates"): 0,
            counter("radixkv_load_back_pins"): 0,
            counter("radixkv_sessions"): 1,
            counter("radixkv_namespaces"): 1,
            ("radixkv_rpc_requests_total", (("code", "OK"), ("method", "LoadBack"))): 2,
            ("radixkv_rpc_requests_total", (("code", "OK"), ("method", "Insert"))): 4,
            ("radixkv_rpc_duration_seconds_count", (("method", "Insert"),)): 4,
            # One copy per load-back (2) and per Evict that wrote something back (4).
            ("radixkv_copy_duration_seconds_count", (("direction", "load"),)): 2,
            ("radixkv_copy_duration_seconds_count", (("direction", "write_back"),)): 4,
            ("radixkv_copy_duration_seconds_count", (("direction", "backup"),)): None,
            counter("radixkv_leases"): 0,
            counter("radixkv_load_backs_unacked"): 0,
            counter("radixkv_invariant_violations_total"): 0,  # exported from 0 with the namespace
        }
        assert {k: got.get(k) for k in want} == want
        e.close()
    finally:
        e.release_memory()


def test_storage_counters_of_a_known_workload(daemon_factory, tmp_path):
    """Stored by one daemon, prefetched by the next on the same page directory (its last
    page damaged on disk: read as corrupt, the prefetch stops before it); a write that
    fails once the directory is gone is counted as failed."""
    pages = tmp_path / "pages"
    flags = ("--storage", f"file://{pages}", "--storage-policy", "write_through")
    ns = "ops/storage-values"
    a, b = fresh_tokens(P), fresh_tokens(2 * P)
    first = daemon_factory(*flags)
    e = RawEngine(first.target, ns, host_pool_pages=16)
    try:
        e.insert(a)
        evict_all(e, first, ns, 0, P)                                   # written back, then stored: P
        wait_value(first, ns, "radixkv_stored_tokens_total", P)
        e.close()
    finally:
        e.release_memory()
    assert first.stop() == 0
    damage(pages, ns, a, page=3)

    second = daemon_factory(*flags)
    e = RawEngine(second.target, ns, host_pool_pages=16)
    try:
        m = e.stub.Match(pb.MatchRequest(session=e.session, prompts=[pb.Prompt(tokens=pack(a))],
                                         include_storage=True), timeout=RPC_TIMEOUT_S).results[0]
        assert m.storage_tokens == P                                    # storage hit P
        progress = list(e.stub.Prefetch(pb.PrefetchRequest(session=e.session, tokens=pack(a),
                                                           policy="wait_complete"), timeout=RPC_TIMEOUT_S))
        assert progress[-1].state == pb.PrefetchProgress.DONE
        assert progress[-1].host_tokens_added == 3 * PAGE                # pages 0-2; page 3 is damaged
        assert e.load_back(a) == 3 * PAGE
        assert value(second, ns, "radixkv_storage_up") == 1
        # The page directory goes away (a regular file in its place): the next store fails.
        shutil.rmtree(pages)
        pages.write_text("not a directory")
        e.insert(b)
        evict_all(e, second, ns, 0, 2 * P)                              # store of 2P fails
        wait_value(second, ns, "radixkv_store_failed_tokens_total", 2 * P)
        got = series(second.scrape(), ns)
        want = {
            counter("radixkv_prefetched_tokens_total"): 3 * PAGE,
            ("radixkv_hit_tokens_total", (("tier", "storage"),)): P,
            counter("radixkv_stored_tokens_total"): 0,
            counter("radixkv_store_failed_tokens_total"): 2 * P,
            counter("radixkv_load_back_tokens_total"): 3 * PAGE,
            ("radixkv_storage_pages_total", (("operation", "get"), ("result", "hit"))): 3,
            ("radixkv_storage_pages_total", (("operation", "get"), ("result", "corrupt"))): 1,
            ("radixkv_storage_bytes_total", (("direction", "read"),)): 3 * PAGE_BYTES,
            ("radixkv_storage_bytes_total", (("direction", "write"),)): 0,
            counter("radixkv_storage_up"): 1,                           # reads answer; its last write failed:
            ("radixkv_storage_failing", (("direction", "write"),)): 1,  # writes fail,
            ("radixkv_storage_failing", (("direction", "read"),)): 0,   # reads worked
            # Calls: Match's probe and Prefetch's (exists 2), the read (get 1), the write
            # that failed (put 1, timed like any other, and counted as an error).
            ("radixkv_storage_operation_duration_seconds_count", (("operation", "exists"),)): 2,
            ("radixkv_storage_operation_duration_seconds_count", (("operation", "get"),)): 1,
            ("radixkv_storage_operation_duration_seconds_count", (("operation", "put"),)): 1,
            ("radixkv_storage_errors_total", (("operation", "put"),)): 1,
            ("radixkv_storage_errors_total", (("operation", "get"),)): 0,  # exported from 0
            # Host: a's 3 loaded pages and b's 8 written-back ones (their store failed), of 16.
            counter("radixkv_host_pool_used_bytes"): 11 * PAGE_BYTES,
            counter("radixkv_host_pool_capacity_bytes"): 16 * PAGE_BYTES,
        }
        assert {k: got.get(k) for k in want} == want
        e.close()
    finally:
        e.release_memory()
    os.remove(pages)
