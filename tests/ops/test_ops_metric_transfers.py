"""Copies in flight and failed loads, as /metrics shows them, held still by the daemon's
fault flags so each value is read while it lasts (real daemon processes, real scrapes).

- `--fault-copy-delay 600`: every device copy waits ten minutes before it starts, far
  past any wait here, so a write-through backup and an eviction's write-back stay in
  flight for as long as the test looks; the daemon is then killed (a clean stop would
  wait for them).
- `--fault-fail-loads 1`: every load copy fails; its device pages leave the tree at
  once and are held (`failed_load`) until the engine's ACK hands them back. A load-back
  counts in flight until that ACK, whether its copy failed or not.
- A lease and a load-back an engine holds on to: the ages the stuck-engine alerts read.
"""

import time

import grpc
from radixkv.types import pack, unpack
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.engine import LAYOUT

from rawengine import PAGE_SIZE, RPC_TIMEOUT_S, RawEngine, fresh_tokens
from scrape import DEADLINE_S, counter, series, value, wait_value
from tests.support.daemon import wait_for

PAGE_BYTES = LAYOUT.page_bytes
P = 4 * PAGE_SIZE  # every prompt here is 4 pages
KINDS = ("load", "backup", "write_back", "store", "fetch")


def in_flight(got: dict) -> dict:
    """radixkv_transfers_in_flight by kind, from one namespace's series."""
    return {k: got.get(("radixkv_transfers_in_flight", (("kind", k),))) for k in KINDS}


def held(got: dict, state: str) -> float | None:
    return got.get(("radixkv_device_pages_held", (("state", state),)))


def test_a_backup_and_a_write_back_in_flight_are_counted_while_they_last(daemon_factory):
    d = daemon_factory("--fault-copy-delay", "600")
    wt = RawEngine(d.target, "ops/flight-wt", write_policy="write_through")
    wb = RawEngine(d.target, "ops/flight-wb", write_policy="write_back")
    try:
        assert wt.insert(fresh_tokens(P)) == 0       # its backup starts and waits: 1 backup
        assert wb.insert(fresh_tokens(P)) == 0       # device only, nothing copying yet
        got = series(d.scrape(), "ops/flight-wb")
        assert in_flight(got) == dict.fromkeys(KINDS, 0)
        # Evict answers once its write-backs are done: ask without waiting for it.
        evicting = wb.stub.Evict.future(pb.EvictRequest(session=wb.session, num_pages=4), timeout=600)
        wait_value(d, "ops/flight-wb", "radixkv_transfers_in_flight", 1, kind="write_back")
        wt_got, wb_got = series(d.scrape(), "ops/flight-wt"), series(d.scrape(), "ops/flight-wb")
        assert in_flight(wt_got) == {**dict.fromkeys(KINDS, 0), "backup": 1}
        assert in_flight(wb_got) == {**dict.fromkeys(KINDS, 0), "write_back": 1}
        # Neither copy has finished: nothing counted as copied, and no copy timed.
        for got in (wt_got, wb_got):
            assert got[counter("radixkv_backup_tokens_total")] == 0
            assert not any(name == "radixkv_copy_duration_seconds_count" for name, _ in got)
        assert held(wt_got, "evictable") + held(wt_got, "protected") == 4
        assert not evicting.done()
        d.kill()  # a clean stop would wait out the ten-minute copies
        assert evicting.exception(timeout=RPC_TIMEOUT_S).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        d.kill()  # also when an assertion failed: a clean stop would wait ten minutes
        for e in (wt, wb):
            e.channel.close()
            e.release_memory()


def test_a_failed_load_is_in_flight_and_its_pages_held_until_the_ack(daemon_factory):
    d = daemon_factory("--fault-fail-loads", "1")
    ns = "ops/failed-load"
    e = RawEngine(d.target, ns, write_policy="write_through")
    try:
        tokens = fresh_tokens(P)
        assert e.insert(tokens) == 0                 # backed up to host: one backup copy
        wait_value(d, ns, "radixkv_backup_tokens_total", P)
        assert e.evict(e.pool.num_pages) == 4        # a host copy exists: freed at once
        m = e.match(tokens)
        assert m.host_tokens == P
        pages = e.pool.allocate(4)
        lb = e.stub.LoadBack(pb.LoadBackRequest(session=e.session, node=m.host_node, device_pages=pack(pages)),
                             timeout=RPC_TIMEOUT_S)
        assert lb.transfer and lb.loaded_tokens == P
        # The copy fails at once; the 4 pages wait for the ACK, off the tree.
        wait_value(d, ns, "radixkv_device_pages_held", 4, state="failed_load")
        got = series(d.scrape(), ns)
        assert in_flight(got) == {**dict.fromkeys(KINDS, 0), "load": 1}
        assert (held(got, "evictable"), held(got, "protected")) == (0, 0)
        assert got[counter("radixkv_load_backs_unacked")] == 1
        assert got[counter("radixkv_load_back_failed_tokens_total")] == P
        answer = e.acks.ack(lb.transfer)
        assert answer.load_failed and sorted(unpack(answer.failed_pages)) == sorted(pages)
        e.pool.free(pages, "failed load")
        got = series(d.scrape(), ns)
        want = {
            counter("radixkv_load_back_tokens_total"): P,          # started
            counter("radixkv_load_back_failed_tokens_total"): P,   # and failed
            counter("radixkv_load_back_bytes_total"): 0,           # nothing arrived
            counter("radixkv_backup_tokens_total"): P,
            counter("radixkv_backup_bytes_total"): 4 * PAGE_BYTES,
            ("radixkv_device_pages_held", (("state", "failed_load"),)): 0,   # handed back
            ("radixkv_device_pages_held", (("state", "evictable"),)): 0,
            ("radixkv_device_pages_held", (("state", "protected"),)): 0,
            counter("radixkv_load_backs_unacked"): 0,
            counter("radixkv_load_back_pins"): 0,
            # One backup copy timed; a failed copy is not timed.
            ("radixkv_copy_duration_seconds_count", (("direction", "backup"),)): 1,
            ("radixkv_copy_duration_seconds_count", (("direction", "load"),)): None,
        }
        assert {k: got.get(k) for k in want} == want
        assert in_flight(got) == dict.fromkeys(KINDS, 0)
        e.close()
    finally:
        e.release_memory()


AGES = ("radixkv_oldest_lease_seconds", "radixkv_oldest_unacked_load_back_seconds")


def test_a_held_lease_and_an_unacknowledged_load_back_report_their_real_age(daemon):
    """The gauges the alerts RadixKVLeaseHeldTooLong and RadixKVLoadBacksUnacknowledged
    read: 0 while nothing is held; while an engine holds a lease and a load-back it does
    not acknowledge, each grows with real time (never past the time since it was
    taken); 0 again once released and acknowledged."""
    ns = "ops/ages"
    e = RawEngine(daemon.target, ns, write_policy="write_through")
    try:
        loaded, leased = fresh_tokens(P), fresh_tokens(P)
        assert e.insert(loaded) == 0
        wait_value(daemon, ns, "radixkv_backup_tokens_total", P)
        assert e.evict(e.pool.num_pages) == 4                  # host copy only now
        assert e.insert(leased) == 0
        assert [value(daemon, ns, name) for name in AGES] == [0, 0]
        taken = time.monotonic()
        lease = e.stub.Match(pb.MatchRequest(session=e.session, prompts=[pb.Prompt(tokens=pack(leased))],
                                             lease=True), timeout=RPC_TIMEOUT_S).results[0].lease
        m = e.match(loaded)
        pages = e.pool.allocate(4)
        lb = e.stub.LoadBack(pb.LoadBackRequest(session=e.session, node=m.host_node, device_pages=pack(pages)),
                             timeout=RPC_TIMEOUT_S)
        assert lease and lb.transfer                           # held, not acknowledged
        wait_for(lambda: min(value(daemon, ns, name) for name in AGES) >= 1.0, DEADLINE_S,
                 "both ages past 1 s", interval=0.2)
        got = series(daemon.scrape(), ns)
        elapsed = time.monotonic() - taken
        for name in AGES:
            assert 1.0 <= got[counter(name)] <= elapsed, (name, got[counter(name)], elapsed)
        assert (got[counter("radixkv_leases")], got[counter("radixkv_load_backs_unacked")]) == (1, 1)
        e.stub.Release(pb.ReleaseRequest(session=e.session, leases=[lease]), timeout=RPC_TIMEOUT_S)
        assert e.acks.ack(lb.transfer).code == 0
        e.pool.to_cache(pages, "LoadBack")
        assert [value(daemon, ns, name) for name in AGES] == [0, 0]
        e.close()
    finally:
        e.release_memory()
