"""Section `storage`: Store (host -> storage) and Prefetch (storage -> host) through the
daemon, for every backend: a page directory, one redis-server, a Redis Cluster of 1 and 3
masters, a Mooncake Store with 1 and 3 lending nodes (all on localhost). Each is compared
with the same client's raw batched put and get of the same bytes in the same run
(bench/storage_stores.py): file reads and writes, pipelined GET/SET, cluster pipelines,
Mooncake batch_get_into/batch_put_from on a registered buffer.

A first daemon stores whole 2k-token prompts (write-through to storage), timed from the
first Insert until the store holds every page (asked of the store's own client, not of
the daemon): a warm-up set of prompts, then new sets, each followed by the raw client
putting as many records; a second daemon on the same store prefetches them, one
`Prefetch(wait_complete)` per prompt (one prompt at a time, and 4 at once as an engine
prefetching its next batch would), cycling through prompts with a host pool of half
their size so every prefetch really reads.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pbg
from radixkv_server.core.page_keys import namespace_salt, page_keys
from radixkv_server.core.pages import pack
from radixkv_server.core.page_keys import layout_fingerprint
from radixkv_server.storage.record import HEADER_BYTES

from .daemon import DaemonProcess, channel, register
from .figures import Figure, Section, Table, fmt
from .storage_stores import open_stores, remove, workdir
from .timing import median, progress

PAGE = 16
PROMPT_PAGES = 128
LAYOUTS = {"tiny": KvLayout(2, 1, 64, "float16", PAGE),        # 8 KiB pages
           "quick": KvLayout(8, 1, 128, "float16", PAGE),      # 64 KiB pages
           "full": KvLayout(8, 1, 128, "float16", PAGE)}
PROMPTS = {"tiny": 4, "quick": 16, "full": 32}
ROUNDS = {"tiny": 2, "quick": 5, "full": 9}
BATCH_IN_FLIGHT = 4  # prompts prefetched at once, as an engine prefetching its next batch
STORE_ROUNDS = {"tiny": 1, "quick": 3, "full": 5}  # timed store rounds, after one warm-up round
NAMESPACE, MODEL = "bench-storage", "bench-model"


def _in_flight(mode: str) -> int:
    """Prompts prefetched at once: BATCH_IN_FLIGHT where the host pool (half the prompts)
    holds twice that many, else one."""
    return max(1, min(BATCH_IN_FLIGHT, PROMPTS[mode] // 4))


def _populate(store, layout: KvLayout, prompt_sets: list[list[bytes]]) -> tuple[list[float], list[float]]:
    """First daemon: insert each set of prompts in turn and wait until storage holds all
    of it; after each set but the first (the warm-up: connections, joining the store,
    first use of the host pool), the store's own client puts the same number of records
    of the same size under fresh keys. Returns (daemon seconds, raw seconds) per timed set,
    each from the first Insert until the last page is stored."""
    per_set = len(prompt_sets[0]) * PROMPT_PAGES
    num_pages = per_set * len(prompt_sets)
    buffers = ShmKvBuffers.create(layout, num_pages)
    ours, theirs = [], []
    try:
        buffers._bytes.copy_(torch.randint(0, 256, (buffers.nbytes,), dtype=torch.uint8))
        with DaemonProcess("--host-pool-size", "4GiB", "--storage", store.url, "--storage-policy", "write_through",
                           "--storage-queue-pages", str(per_set * 2)) as d:
            stub = pbg.RadixKVStub(channel(d.unix))
            session = register(stub, NAMESPACE, layout, buffers, num_pages, model=MODEL,
                               host_pool_pages=per_set).session
            stub.Stats(pb.StatsRequest(namespace=NAMESPACE))
            for n, prompts in enumerate(prompt_sets):
                key_lists = _keys(layout, prompts)  # what the wait asks the store for, named untimed
                keys = [k for ks in key_lists for k in ks]
                start = time.perf_counter()
                for i, p in enumerate(prompts):
                    first = (n * len(prompts) + i) * PROMPT_PAGES
                    stub.Insert(pb.InsertRequest(session=session, tokens=p,
                                                 device_pages=pack(range(first, first + PROMPT_PAGES))))
                _wait_stored(store, stub, keys)
                if n:
                    ours.append(time.perf_counter() - start)
                _settle(store, stub, keys, (n + 1) * per_set * PAGE)
                if n:
                    theirs.append(_raw_put(store, layout, key_lists))
            stub.Close(pb.CloseRequest(session=session))
            return ours, theirs
    finally:
        buffers.close()


def _wait_stored(store, stub, keys: list[bytes]) -> None:
    """Return once the store holds a record under every one of `keys`, asking the store
    itself every 2 ms: the daemon being timed is not asked (a Stats call cost it ~0.6 ms
    of its loop; docs/performance.md, 2026-12-07). The page queued last is asked for alone
    until it lands (it is among the last stored), then all of them. The daemon is asked
    once a second, so that a failing store ends the run then and not at the deadline; a
    quick-mode set takes less than a second."""
    now = time.monotonic()
    deadline, check = now + 300, now + 1
    for ask in (keys[-1:], keys):
        while not store.holds_all(ask):
            if time.monotonic() > check:
                _counters(stub, deadline, f"{len(ask)} pages not all in the store")
                check = time.monotonic() + 1
            time.sleep(0.002)


def _settle(store, stub, keys: list[bytes], tokens: int) -> None:
    """Untimed, after a set: check key by key that the store holds every page, then wait
    until the daemon counts every token stored, so that its bookkeeping after the last
    write does not overlap the raw put that follows."""
    if missing := store.missing(keys):
        raise RuntimeError(f"{store.label}: {len(missing)} of {len(keys)} pages not in the store after the wait")
    deadline = time.monotonic() + 60
    while _counters(stub, deadline, f"the daemon counts fewer than {tokens} tokens stored")["stored_tokens"] < tokens:
        time.sleep(0.02)


def _counters(stub, deadline: float, waiting: str):
    """The namespace's counters; raises if a store failed or the deadline passed."""
    c = stub.Stats(pb.StatsRequest(namespace=NAMESPACE)).namespaces[0].counters
    if c["store_failed_tokens"] or time.monotonic() > deadline:
        raise RuntimeError(f"storing failed ({waiting}): {dict(c)}")
    return c


def _keys(layout: KvLayout, prompts: list[bytes]) -> list[list[bytes]]:
    """The storage keys of each prompt's pages, as the daemon names them."""
    salt = namespace_salt(MODEL, layout_fingerprint(layout))
    return [page_keys(salt, p, PAGE) for p in prompts]


def _raw_put(store, layout: KvLayout, key_lists: list[list[bytes]]) -> float:
    """The store's own client writing the same number of records of the same size."""
    blob = bytes(HEADER_BYTES + layout.page_bytes)
    start = time.perf_counter()
    for keys in key_lists:
        store.raw_put(keys, blob)
    return time.perf_counter() - start


def _measure(store, layout: KvLayout, prompts: list[bytes], key_lists, mode: str, profiler):
    want = len(prompts) * PROMPT_PAGES * (HEADER_BYTES + layout.page_bytes)
    got = sum(store.raw_get(keys) for keys in key_lists)
    if got != want:
        raise RuntimeError(f"{store.label}: storage holds {got} bytes of the prompts, expected {want}")
    buffers = ShmKvBuffers.create(layout, PROMPT_PAGES)
    ours, theirs, batched = [], [], []
    try:
        with DaemonProcess("--host-pool-size", "4GiB", "--storage", store.url) as d:
            stub = pbg.RadixKVStub(channel(d.unix))
            session = register(stub, NAMESPACE, layout, buffers, PROMPT_PAGES, model=MODEL,
                               host_pool_pages=len(prompts) * PROMPT_PAGES // 2).session

            def prefetch_one(p: bytes) -> int:
                return sum(prog.fetched_tokens // PAGE for prog in
                           stub.Prefetch(pb.PrefetchRequest(session=session, tokens=p, policy="wait_complete")))

            def prefetch_all(in_flight: int = 1) -> int:
                if in_flight == 1:
                    return sum(map(prefetch_one, prompts))
                with ThreadPoolExecutor(in_flight) as callers:
                    return sum(callers.map(prefetch_one, prompts))

            prefetch_all()  # warm-up: connections, joining the store, first host allocation
            for r in range(ROUNDS[mode]):
                for which in ((0, 1, 2) if r % 2 == 0 else (2, 1, 0)):
                    t = time.perf_counter()
                    if which in (0, 2):
                        pages = prefetch_all(_in_flight(mode) if which == 2 else 1)
                        if pages != len(prompts) * PROMPT_PAGES:
                            raise RuntimeError(f"{store.label}: prefetched {pages} pages, expected "
                                               f"{len(prompts) * PROMPT_PAGES}")
                        (ours if which == 0 else batched).append(time.perf_counter() - t)
                    else:
                        for keys in key_lists:
                            store.raw_get(keys)
                        theirs.append(time.perf_counter() - t)
            if profiler is not None:
                profiler.record(f"storage.{store.label}.daemon", d.pid, prefetch_all,
                                f"daemon prefetching from {store.label}")
            stub.Close(pb.CloseRequest(session=session))
    finally:
        buffers.close()
    return median(ours), median(theirs), median(batched)


def run(mode: str, plot_dir=None, profiler=None, only: tuple[str, ...] = ()) -> Section:
    sec = Section("storage", "Storage (Store and Prefetch through the daemon)",
                  intro=__doc__.split("\n\n", 1)[1].replace("\n", " "))
    layout = LAYOUTS[mode]
    rng = np.random.default_rng(5)
    prompt_sets = [[rng.integers(1, 1 << 30, size=PROMPT_PAGES * PAGE, dtype=np.int32).tobytes()
                    for _ in range(PROMPTS[mode])] for _ in range(1 + STORE_ROUNDS[mode])]
    prompts = prompt_sets[0]  # stored first (the warm-up round), then prefetched
    key_lists = _keys(layout, prompts)
    total_pages = len(prompts) * PROMPT_PAGES
    nbytes = total_pages * layout.page_bytes
    rows = []
    for label, factory in open_stores(layout.page_bytes, nbytes * len(prompt_sets)):
        if (only and label not in only) or (mode == "tiny" and label.endswith("@3")):
            continue  # tiny mode (the smoke test) skips the scaling runs
        work = workdir()
        progress(f"storage: {label}: storing {total_pages} pages of {layout.page_bytes // 1024} KiB")
        store = factory(work)
        try:
            stored, raw_put = _populate(store, layout, prompt_sets)
            stored_s, raw_put_s = median(stored), median(raw_put)
            progress(f"storage: {label}: prefetching after a restart")
            ours, theirs, batched = _measure(store, layout, prompts, key_lists, mode, profiler)
        finally:
            store.close()
            remove(work)
        gb = nbytes / 1e9
        sec.add(Figure(f"storage.{label}.prefetch", gb / ours, "GB/s", "raw-get", gb / theirs,
                       target=">= 0.7x", met=theirs / ours >= 0.7))
        sec.add(Figure(f"storage.{label}.prefetch_pages", total_pages / ours, "pages/s", "raw-get",
                       total_pages / theirs))
        sec.add(Figure(f"storage.{label}.prefetch_in_flight", gb / batched, "GB/s", "raw-get",
                       gb / theirs))
        sec.add(Figure(f"storage.{label}.store", gb / stored_s, "GB/s", "raw-put", gb / raw_put_s,
                       target=">= 0.7x", met=raw_put_s / stored_s >= 0.7))
        rows.append([label, fmt(total_pages / ours), f"{fmt(theirs / ours)}x", f"{fmt(theirs / batched)}x",
                     fmt(total_pages / stored_s),
                     f"{fmt(raw_put_s / stored_s)}x", f"{fmt(ours / len(prompts) * 1e3)} ms"])
    sec.notes.append(
        "Prefetch (wait_complete): the file backend probes the run (a stat per page), then reads each record "
        "with one readv (header into a small buffer, payload straight into the host page) and checks it in "
        "place; for Redis and Redis Cluster the GETs that find the run are the fetch (no EXISTS first), each "
        "reply copied once into its page; Mooncake reads whole records in the one batched call that finds the "
        "run, into a registered staging buffer, then checks and copies each into its page (one-part gets are "
        "~35% faster than two-part in-place ones with the 0.3.13 wheel). Every page is checked against its "
        "CRC-32 (zlib-ng, ~40 GB/s). The daemon keeps freed heap for reuse (--malloc-trim-threshold) and so does "
        "this process, where the raw clients run: with glibc's default a Redis client returns the memory of "
        "each batch of replies and faults it in again for the next (docs/performance.md). "
        "Stores hand the backend views of the pool's pages: files are written with one writev of header and "
        "page, Redis SETs send header and page without joining them (Redis Cluster joins them: one copy), "
        "Mooncake copies header and page into a registered staging buffer and stores whole records. Store "
        "time includes the daemon's Insert RPCs and device-to-host copies; Mooncake stores also probe which "
        "pages are present first.")
    sec.tables.append(Table(
        f"{len(prompts)} prompts x {PROMPT_PAGES} pages of {layout.page_bytes // 1024} KiB "
        f"({nbytes / 2**20:.0f} MiB), prefetch: median of {ROUNDS[mode]} rounds, store: median of {STORE_ROUNDS[mode]} "
        "rounds of new prompts after a warm-up round",
        ["backend", "prefetch pages/s", "vs raw get", f"{_in_flight(mode)} in flight vs raw get", "store pages/s",
         "vs raw put", "prefetch per 2k-token prompt"],
        rows,
        "raw: the store's own client, batched, the same records (header + payload), no daemon, no checksum, "
        "no host pool. @N: shards (Redis Cluster masters) or nodes lending memory (Mooncake)."))
    return sec
