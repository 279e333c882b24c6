"""Section `storage`: Prefetch (storage -> host) through the daemon, for the file backend
(a temp dir) and Redis (a real `redis-server` on a temp unix socket), against raw reads
of the same stored bytes in the same run: sequential file reads, and pipelined GETs with
redis-py.

A first daemon stores whole 2k-token prompts (write-through to storage); a second daemon
on the same store (a warm restart) prefetches them, one `Prefetch(wait_complete)` per
prompt, cycling through prompts with a host pool of half their size so every prefetch
really reads. The stored bytes are in the OS page cache for both sides.
"""

import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import torch

from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc as pbg
from radixkv_server.core.pages import pack

from .daemon import DaemonProcess, channel, register
from .figures import Figure, Section, Table, fmt
from .timing import median, progress

PAGE = 16
PROMPT_PAGES = 128
LAYOUTS = {"tiny": KvLayout(2, 1, 64, "float16", PAGE),        # 8 KiB pages
           "quick": KvLayout(8, 1, 128, "float16", PAGE),      # 64 KiB pages
           "full": KvLayout(8, 1, 128, "float16", PAGE)}
PROMPTS = {"tiny": 4, "quick": 16, "full": 32}
ROUNDS = {"tiny": 2, "quick": 5, "full": 9}
NAMESPACE, MODEL = "bench-storage", "bench-model"


class RedisServer:
    def __init__(self, directory: str):
        self.sock = os.path.join(directory, "redis.sock")
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700",
                                      "--save", "", "--appendonly", "no", "--dir", directory],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        self.client = redis.Redis(unix_socket_path=self.sock)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _populate(url: str, layout: KvLayout, prompts: list[bytes]) -> None:
    """First daemon: insert every prompt, wait until storage holds all of it."""
    num_pages = len(prompts) * PROMPT_PAGES
    buffers = ShmKvBuffers.create(layout, num_pages)
    try:
        buffers._bytes.copy_(torch.randint(0, 256, (buffers.nbytes,), dtype=torch.uint8))
        with DaemonProcess("--host-pool-size", "4GiB", "--storage", url, "--storage-policy", "write_through",
                           "--storage-queue-pages", str(num_pages * 2)) as d:
            stub = pbg.RadixKVStub(channel(d.unix))
            session = register(stub, NAMESPACE, layout, buffers, num_pages, model=MODEL,
                               host_pool_pages=num_pages).session
            for i, p in enumerate(prompts):
                stub.Insert(pb.InsertRequest(session=session, tokens=p,
                                             device_pages=pack(range(i * PROMPT_PAGES, (i + 1) * PROMPT_PAGES))))
            want = num_pages * PAGE
            deadline = time.monotonic() + 300
            while True:
                c = stub.Stats(pb.StatsRequest(namespace=NAMESPACE)).namespaces[0].counters
                if c["stored_tokens"] >= want:
                    break
                if c["store_failed_tokens"] or time.monotonic() > deadline:
                    raise RuntimeError(f"storing failed: {dict(c)}")
                time.sleep(0.05)
            stub.Close(pb.CloseRequest(session=session))
    finally:
        buffers.close()


def _raw_file(directory: str, groups: int):
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs if f.endswith(".page"))
    chunks = [files[i::groups] for i in range(groups)]

    def read(chunk) -> int:
        n = 0
        for path in chunk:
            with open(path, "rb") as f:
                n += len(f.read())
        return n

    return chunks, read


def _raw_redis(client, groups: int):
    keys = sorted(client.scan_iter(match=b"radixkv:*", count=1000))
    chunks = [keys[i::groups] for i in range(groups)]

    def read(chunk) -> int:
        pipe = client.pipeline(transaction=False)
        for k in chunk:
            pipe.get(k)
        return sum(len(v) for v in pipe.execute())

    return chunks, read


def _measure(url: str, layout: KvLayout, prompts: list[bytes], raw, mode: str, profiler, label: str):
    chunks, read = raw
    if sum(len(c) for c in chunks) != len(prompts) * PROMPT_PAGES:
        raise RuntimeError(f"{label}: storage holds {sum(len(c) for c in chunks)} pages, expected "
                           f"{len(prompts) * PROMPT_PAGES}")
    buffers = ShmKvBuffers.create(layout, PROMPT_PAGES)
    ours, theirs = [], []
    try:
        with DaemonProcess("--host-pool-size", "4GiB", "--storage", url) as d:
            stub = pbg.RadixKVStub(channel(d.unix))
            session = register(stub, NAMESPACE, layout, buffers, PROMPT_PAGES, model=MODEL,
                               host_pool_pages=len(prompts) * PROMPT_PAGES // 2).session

            def prefetch_all() -> int:
                pages = 0
                for p in prompts:
                    for prog in stub.Prefetch(pb.PrefetchRequest(session=session, tokens=p, policy="wait_complete")):
                        pages += prog.fetched_tokens // PAGE
                return pages

            prefetch_all()  # warm-up: connections, first host allocation
            for r in range(ROUNDS[mode]):
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    t = time.perf_counter()
                    if which == 0:
                        pages = prefetch_all()
                        if pages != len(prompts) * PROMPT_PAGES:
                            raise RuntimeError(f"{label}: prefetched {pages} pages, expected "
                                               f"{len(prompts) * PROMPT_PAGES}")
                        ours.append(time.perf_counter() - t)
                    else:
                        for c in chunks:
                            read(c)
                        theirs.append(time.perf_counter() - t)
            if profiler is not None:
                profiler.record(f"storage.{label}.daemon", d.pid, prefetch_all, f"daemon prefetching from {label}")
            stub.Close(pb.CloseRequest(session=session))
    finally:
        buffers.close()
    return median(ours), median(theirs)


def run(mode: str, plot_dir=None, profiler=None) -> Section:
    sec = Section("storage", "Storage (Prefetch through the daemon)", intro=__doc__.split("\n\n", 1)[1].replace("\n", " "))
    layout = LAYOUTS[mode]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 1 << 30, size=PROMPT_PAGES * PAGE, dtype=np.int32).tobytes()
               for _ in range(PROMPTS[mode])]
    total_pages = len(prompts) * PROMPT_PAGES
    nbytes = total_pages * layout.page_bytes
    rows = []
    work = tempfile.mkdtemp(prefix="rkv-bench-st-")
    try:
        for label in ("file", "redis"):
            progress(f"storage: {label}: storing {total_pages} pages of {layout.page_bytes // 1024} KiB")
            if label == "file":
                store = os.path.join(work, "pages")
                url = f"file://{store}"
                _populate(url, layout, prompts)
                raw, base = _raw_file(store, len(prompts)), "raw-read"
                server = None
            else:
                server = RedisServer(work)
                url = server.url
                _populate(url, layout, prompts)
                raw, base = _raw_redis(server.client, len(prompts)), "raw-get"
            try:
                progress(f"storage: {label}: prefetching after a restart")
                ours, theirs = _measure(url, layout, prompts, raw, mode, profiler, label)
            finally:
                if server is not None:
                    server.stop()
            pps, raw_pps = total_pages / ours, total_pages / theirs
            sec.add(Figure(f"storage.{label}.prefetch", nbytes / ours / 1e9, "GB/s", base, nbytes / theirs / 1e9))
            sec.add(Figure(f"storage.{label}.prefetch_pages", pps, "pages/s", base, raw_pps))
            rows.append([label, fmt(pps), fmt(nbytes / ours / 1e9), fmt(raw_pps), fmt(nbytes / theirs / 1e9),
                         f"{fmt(ours / theirs)}x", f"{fmt(ours / len(prompts) * 1e3)} ms"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sec.notes.append(
        "What a prefetched page costs in the daemon beyond the raw read (`datapath/storage_mover.py` "
        "`_fetch`, `storage/record.py` `decode`, `datapath/host_pool.py` `write_page`): the record is read "
        "whole, its CRC-32 checked, the payload copied out (`memoryview(...).tobytes()`), copied again into a "
        "`bytearray` for `torch.frombuffer`, then copied into the host pool: three extra copies of every byte, "
        "one page at a time on one storage worker per prefetch, before the result returns to the event loop. "
        "Prefetch also probes storage first (`exists_prefix`: one stat or EXISTS per page). The daemon "
        "profile below shows where the time goes.")
    sec.tables.append(Table(
        f"{len(prompts)} prompts x {PROMPT_PAGES} pages of {layout.page_bytes // 1024} KiB "
        f"({nbytes / 2**20:.0f} MiB) per round, median of {ROUNDS[mode]} rounds",
        ["backend", "prefetch pages/s", "prefetch GB/s", "raw pages/s", "raw GB/s", "time vs raw",
         "per 2k-token prompt"], rows,
        "raw: the same stored records (header + payload) read back in the bench process, no daemon, no "
        "checksum, no copy into a host pool."))
    return sec
