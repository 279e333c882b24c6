"""MooncakeStorage: pages in a Mooncake Store, the DRAM pool many nodes lend to.

Each daemon joins the store as a client of one `mooncake_master`: it lends
`segment_bytes` of its own memory to the pool (0: it only borrows) and keeps a
`buffer_bytes` local buffer for copying calls. A batch of pages moves in one store call
per `max_batch` pages. Puts, and fetches with `fetch="staged"` (the default), move whole
records (20-byte header + payload, one part per object) through a registered staging
buffer with one copy of each page (mooncake_staged.py): measured here, Mooncake 0.3.13
moves one-part objects faster than two-part ones (~35% for gets, a few % for puts),
more than the copy costs. When no staging buffer is free, and for `fetch="direct"`,
pages move in place: the host pool is registered with the store (`attach_memory`) and
each object goes in two parts, the header (from a small registered arena) and the host
page itself (no copy).

What the store does, and what this backend makes of it (measured with the PyPI wheel
`mooncake-transfer-engine-non-cuda` 0.3.13, TCP, metadata `P2PHANDSHAKE`):
- `put` of a present key keeps the old value: put() probes first and counts those as
  skipped, so pages are never rewritten.
- a full store answers -200 (NO_AVAILABLE_HANDLE) and evicts in the background: the put
  raises StorageUnavailable ("store full"), the pages stay on host, a later put retries.
- a key whose segment owner died answers -800 (TRANSFER_FAIL) until the master drops
  the owner (`client_ttl`, 10 s by default): a miss, logged once per outage; when it is
  the first page asked for, StorageUnavailable (the mover's health sees it).
- a batch answer that does not hold one result per key raises StorageUnavailable; it is
  never matched to the keys by position.
- a master that restarted has lost every key: misses; this client re-mounts by itself,
  and says nothing of it. The backend notices by a sentinel key of its own that vanished
  (mooncake_sentinel.py) and reports the loss (`lost_contents`), so pages the daemon
  counted as stored are stored again.
- calls to a master or a segment owner that hangs block for 30-60 s inside the store:
  each call here waits at most `timeout` seconds and then raises StorageTimeout. The
  store's call may still finish later; the buffers it was given are not reused before
  it does (header slots are held, and the mover keeps fetched pages reserved).
- `setup()` and `close()` hold the GIL while they wait for the master: ~90 s against one
  that is not up, ~60 s against one that accepts connections but does not answer
  (stopped, hung), the whole daemon frozen meanwhile. So joining happens lazily on a
  call thread, only once the master answers an RPC asked from Python with a deadline
  (mooncake_probe.py), with `MC_STORE_CLIENT_SETUP_RETRIES` defaulting to 2; until it
  succeeds every call raises StorageUnavailable and a later call (at most one a second)
  tries again. `close()` is skipped (the store kept) when the master does not answer.
- every payload is checked against its header (length and CRC-32): a page is either
  whole and right, or a miss.
"""

import ctypes
import logging
import threading

from ..logs import log_event
from .base import Read, StorageBackend
from .errors import StorageFull, StorageTimeout, StorageUnavailable
from . import mooncake_staged as staged
from .mooncake_calls import Call, Caller, Staging, address, both
from .mooncake_codes import MIN_SEGMENT, NO_SPACE, DeadOwners, answered
from .mooncake_join import Membership
from .mooncake_probe import probe_master
from .mooncake_sentinel import Sentinel
from .record import HEADER_BYTES, header, record_name

log = logging.getLogger("radixkv.storage")
MAX_TIMEOUT_S = 3600.0  # a store call's timeout past this is a mistake (and inf overflows the C client's clock)
CLOSE_GRACE_S = 2.0  # the least close() waits for store calls still running, and for leaving


class MooncakeStorage(StorageBackend):
    """Pages in the Mooncake Store whose master listens at `master` ("host:port").

    Construction checks arguments only (ValueError); the store is joined lazily by the
    first call. Thread-safe. `timeout` bounds every store call (seconds); a batch moves
    in store calls of `max_batch` pages, the next one in flight while the pages of the
    last are checksummed; `replicas` is how many copies of a page the store keeps.
    """

    faults = (OSError, RuntimeError)
    kind = "mooncake"

    def __init__(self, master: str, *, segment_bytes: int = 512 << 20, buffer_bytes: int = 64 << 20,
                 protocol: str = "tcp", metadata: str = "P2PHANDSHAKE", hostname: str = "127.0.0.1",
                 rdma_devices: str = "", timeout: float = 2.0, prefix: str = "radixkv:", replicas: int = 1,
                 max_batch: int = 128, call_threads: int = 4, fetch: str = "staged"):
        _check(master, segment_bytes, buffer_bytes, protocol, timeout, replicas, max_batch, call_threads)
        if fetch not in ("staged", "direct"):
            raise ValueError(f"Mooncake fetch must be staged or direct, got {fetch!r}")
        self.fetch = fetch
        super().__init__(f"mooncake://{master}")
        self.master = master
        self.prefix = prefix
        self.timeout = timeout
        self.max_batch = max_batch
        self._setup_args = (hostname, metadata, segment_bytes, buffer_bytes, protocol, rdma_devices, master)
        self._replicas = replicas
        self._calls = Caller(self.name, timeout, call_threads, max_batch)
        self._headers = self._calls.slots
        self._member = Membership(self.name, master, timeout, self._setup_args, self._calls.submit,
                                  [(self._headers.base, self._headers.memory.nbytes)])
        self._staging = Staging(call_threads, self._member.register_new)
        self.owners = DeadOwners(self.name)
        self.sentinel = Sentinel(prefix, self._calls.run, self._config, self.lost_contents)

    def store_key(self, key: bytes) -> str:
        """The Mooncake key that holds (or would hold) the page stored under `key`."""
        return self.prefix + record_name(key)

    def attach_memory(self, address: int, nbytes: int) -> None:
        self._member.attach(address, nbytes)

    def detach_memory(self, address: int, nbytes: int) -> None:
        self._member.detach(address, nbytes)

    def _client(self):
        """The joined store; StorageUnavailable while joining is in progress or failed."""
        return self._member.client()

    # -- primitives -------------------------------------------------------------------

    def _exists_prefix(self, keys: list[bytes]) -> int:
        store = self._client()
        found = self._watched(self._exists_in, store, keys)
        self.sentinel.check(store)
        return found

    def _watched(self, call, *args):
        """call(*args); a failure makes the sentinel look again after the next success."""
        try:
            return call(*args)
        except StorageUnavailable:
            self.sentinel.failed()
            raise

    def _exists_in(self, store, keys: list[bytes]) -> int:
        found = 0
        for i in range(0, len(keys), 4 * self.max_batch):
            chunk = [self.store_key(k) for k in keys[i:i + 4 * self.max_batch]]
            codes = self.answered("exists_prefix", self._calls.run("exists_prefix", store.batch_is_exist, chunk),
                                  len(chunk))
            if found == 0 and codes and all(c < 0 for c in codes):
                raise StorageUnavailable(self.name, "exists_prefix", detail="the master did not answer")
            for code in codes:
                if code != 1:
                    return found
                found += 1
        return found

    def _read_ahead(self, keys: list[bytes], page_bytes: int):
        # One batched get into a staging buffer finds the run and brings it along.
        return staged.read_ahead(self, self._client(), keys, page_bytes) if self.fetch == "staged" else None

    def _get_into(self, keys: list[bytes], pages: list) -> list[Read]:
        store = self._client()
        if self.fetch == "staged":
            reads = staged.get(self, store, keys, pages)
            if reads is not None:
                return reads
        if not all(self._attached(p) for p in pages):
            return super()._get_into(keys, pages)  # copying path
        spans = [(i, min(i + self.max_batch, len(keys))) for i in range(0, len(keys), self.max_batch)]
        reads: list[Read] = []
        call = self._start_get(store, keys, pages, *spans[0])
        for n, span in enumerate(spans):
            try:
                following = self._start_get(store, keys, pages, *spans[n + 1]) if n + 1 < len(spans) else None
            except BaseException as exc:
                self._settle(call, exc)
                raise
            try:
                got = self._finish_get(call, keys, pages, *span)
            except BaseException as exc:
                self._settle(following, exc)
                raise
            reads += got
            if following is not None and any(r is not Read.HIT for r in got):
                self._finish_get(following, keys, pages, *spans[n + 1])  # it writes pages: wait for it
                break
            call = following
        return reads + [Read.MISS] * (len(keys) - len(reads))

    def _start_get(self, store, keys, pages, lo: int, hi: int) -> Call:
        slots = self._calls.take_slots(hi - lo, "get")
        ptrs = [[self._headers.ptr(s), address(p)] for s, p in zip(slots, pages[lo:hi])]
        sizes = [[HEADER_BYTES, memoryview(p).nbytes] for p in pages[lo:hi]]
        names = [self.store_key(k) for k in keys[lo:hi]]
        return self._calls.start("get", store.batch_get_into_multi_buffers, names, ptrs, sizes, slots=slots)

    def _finish_get(self, call: Call, keys, pages, lo: int, hi: int) -> list[Read]:
        """Wait for a get and check each page in place against the header it brought."""
        try:
            codes = self.answered("get", call.result(), hi - lo)
            whole = [code == HEADER_BYTES + memoryview(page).nbytes for code, page in zip(codes, pages[lo:hi])]
            self.owners.read(codes, sum(whole), head=lo == 0)
            # absent, of another size, or its owner is gone: a miss
            return [self._verified(key, self._headers.view(slot), page) if ok else Read.MISS
                    for key, slot, page, ok in zip(keys[lo:hi], call.slots, pages[lo:hi], whole)]
        finally:
            call.done()

    def _settle(self, call: Call | None, exc: BaseException) -> None:
        """After `exc` ended a batch, wait for its other call in flight too; when that one
        is stuck as well, `exc` (a StorageTimeout) covers both."""
        if call is None:
            return
        try:
            call.result()
        except StorageTimeout as late:
            if isinstance(exc, StorageTimeout):
                exc.settled = both(exc.settled, late.settled)
            else:
                raise late from exc
        except StorageUnavailable:
            pass
        finally:
            call.done()

    def _get_blobs(self, keys: list[bytes]) -> list[bytes | None]:
        """Copying reads (pages outside attached memory): whole records through the
        store's local buffer. One larger than that buffer reads as empty: a miss."""
        blobs = self.answered("get", self._calls.run("get", self._client().get_batch,
                                                     [self.store_key(k) for k in keys]), len(keys))
        return [blob if blob else None for blob in blobs]

    def _put_pages(self, items: list[tuple[bytes, bytes]]) -> list[bool]:
        store = self._client()
        stored = self._watched(self._put_in, store, items)
        self.sentinel.check(store)
        return stored

    def _put_in(self, store, items: list[tuple[bytes, bytes]]) -> list[bool]:
        names = [self.store_key(k) for k, _ in items]
        present = self.answered("put", self._calls.run("put", store.batch_is_exist, names), len(names))
        todo = [i for i, code in enumerate(present) if code != 1]
        codes = self.answered("put", self._put_runs(store, [items[j] for j in todo]), len(todo))
        stored = [False] * len(items)
        for j, code in zip(todo, codes):
            stored[j] = code == 0
        failed = [c for c in codes if c != 0]
        if failed:
            full = all(c == NO_SPACE for c in failed)
            raise (StorageFull if full else StorageUnavailable)(self.name, "put", detail=(
                f"store full: {len(failed)} of {len(items)} pages not stored (code {NO_SPACE}); "
                "the store evicts in the background" if full else
                f"{len(failed)} of {len(items)} pages not stored (codes {sorted(set(failed))})"))
        return stored

    def _put_runs(self, store, items: list[tuple[bytes, bytes]]) -> list[int]:
        """Whole records through a staging buffer when one is free (`staged.put`), else
        store calls of max_batch pages sending header and page as two parts, the next
        batch's headers (checksums) made while the previous call runs."""
        if not items:
            return []
        codes = staged.put(self, store, items)
        if codes is not None:
            return codes
        if not all(self._attached(p) for _, p in items):  # copying path
            return [self._calls.run("put", store.put_parts, self.store_key(k), header(k, p), p, config=self._config())
                    for k, p in items]
        codes: list[int] = []
        call = None
        for lo in range(0, len(items), self.max_batch):
            try:
                following = self._start_put(store, items[lo:lo + self.max_batch])
            except BaseException as exc:
                self._settle(call, exc)
                raise
            if call is not None:
                codes += self._finish_put(call, following)
            call = following
        if call is not None:
            codes += self._finish_put(call, None)
        return codes

    def _start_put(self, store, items: list[tuple[bytes, bytes]]) -> Call:
        slots = self._calls.take_slots(len(items), "put")
        for slot, (key, payload) in zip(slots, items):
            self._headers.view(slot)[:] = header(key, payload)
        ptrs = [[self._headers.ptr(s), address(p)] for s, (_, p) in zip(slots, items)]
        sizes = [[HEADER_BYTES, memoryview(p).nbytes] for _, p in items]
        names = [self.store_key(k) for k, _ in items]
        return self._calls.start("put", store.batch_put_from_multi_buffers, names, ptrs, sizes, self._config(),
                                 slots=slots)

    def _finish_put(self, call: Call, following: Call | None) -> list[int]:
        try:
            return call.result()
        except BaseException as exc:
            self._settle(following, exc)
            raise
        finally:
            call.done()

    def _put_blobs(self, records):  # put() goes through _put_pages, never here
        raise NotImplementedError("MooncakeStorage stores pages through _put_pages")

    def _discard(self, keys: list[bytes]) -> None:
        # force: a damaged page is dropped even while a reader's lease holds it
        self._calls.run("discard", self._client().batch_remove, [self.store_key(k) for k in keys], True)

    def _check(self) -> None:
        code = self._calls.run("check", self._client().health_check)
        if code != 0:
            raise StorageUnavailable(self.name, "check", detail=f"health_check answered {code}")

    def _close(self) -> None:
        """Leave the store without freeing memory it may still use. Store calls still
        running (a frozen peer) are waited for, bounded; then, if the master answers (the
        store's close() holds the GIL while it waits for it), the registered buffers are
        unregistered and the store closed, on a thread, bounded too (unmounting a segment
        waits out readers' leases, 10 s). Whatever is still running after that keeps the
        store and this backend's buffers for the rest of the process (logged): freeing
        them under a running call is how a process crashes."""
        self._calls.close()
        grace = max(CLOSE_GRACE_S, self.timeout)
        settled = self._calls.settle(grace)
        store = self._member.leave()
        if not settled:
            log_event(log, "storage.close_busy", logging.WARNING, store=self.name, waited_s=grace,
                      note="store calls still running: the store stays open and its buffers are kept until the "
                      "process exits")
            _keep_forever(store, self._calls, self._staging)
            return
        if store is None:
            return
        silent = probe_master(self.master, self.timeout)
        if silent is not None:  # close() would hold the GIL until the master answers
            log_event(log, "storage.leave_skipped", logging.WARNING, store=self.name, error=silent,
                      note="its buffers are kept until the process exits (the master drops this client after "
                      "client_ttl)")
            _keep_forever(store, self._calls, self._staging)
            return
        closing = threading.Thread(target=_close_store, args=(store, self._member, self.sentinel, self.name),
                                   daemon=True, name="radixkv-mooncake-close")
        closing.start()
        closing.join(grace)
        if closing.is_alive():
            log_event(log, "storage.leave_slow", logging.WARNING, store=self.name, waited_s=grace,
                      note="leaving the store is still in progress: its buffers are kept until the process "
                      "exits (the master drops this client after client_ttl)")
            _keep_forever(store, self._calls, self._staging)

    # -- helpers ----------------------------------------------------------------------

    def _attached(self, buffer) -> bool:
        return self._member.attached(address(buffer), memoryview(buffer).nbytes)

    def _config(self):
        from mooncake.store import ReplicateConfig
        config = ReplicateConfig()
        config.replica_num = self._replicas
        return config

    def answered(self, operation: str, codes, keys: int) -> list:
        """A batch call's answer, one result per key (mooncake_codes.answered)."""
        return answered(self.name, operation, codes, keys)


def _close_store(store, member: Membership, sentinel: Sentinel, name: str) -> None:
    try:
        sentinel.remove(store)
        member.unregister_all(store)
        store.close()
    except Exception as exc:  # closing is best effort
        log_event(log, "storage.close_failed", logging.WARNING, store=name, error=exc)


def _keep_forever(*objects) -> None:
    """Leak one reference to each object, so neither garbage collection nor interpreter
    shutdown frees it (a store call or close still running may use its memory)."""
    for obj in objects:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _check(master, segment_bytes, buffer_bytes, protocol, timeout, replicas, max_batch, call_threads) -> None:
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"Mooncake master must be HOST:PORT, got {master!r}")
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"Mooncake protocol must be tcp or rdma, got {protocol!r}")
    if segment_bytes != 0 and not (isinstance(segment_bytes, int) and segment_bytes >= MIN_SEGMENT):
        raise ValueError(f"Mooncake segment must be 0 (lend none) or at least 16MiB, got {segment_bytes!r}")
    for name, value, low in (("buffer", buffer_bytes, MIN_SEGMENT),
                             ("replicas", replicas, 1), ("max_batch", max_batch, 1),
                             ("call_threads", call_threads, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"Mooncake {name} must be an int >= {low}, got {value!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < MAX_TIMEOUT_S:
        raise ValueError(f"Mooncake timeout must be a positive number of seconds below {MAX_TIMEOUT_S:g}, "
                         f"got {timeout!r}")

