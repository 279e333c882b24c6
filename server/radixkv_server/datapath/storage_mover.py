"""StorageMover: the core's store and fetch copies, between the host pool and an L3
backend, on worker threads of their own (slow storage never delays device copies).

Pages move without staging copies: a store hands the backend views of the host pool's
pages, a fetch has the backend read (and checksum) payloads straight into the reserved
host pages (`StorageBackend.get_into`). A prefetch first asks which run of pages storage
holds (`find_run`, before any host page is reserved); where the backend answers by
reading the run (Redis, Mooncake), the fetch then only places those records. The pool's
memory is attached to the backend once, so a store that moves bytes itself (Mooncake)
can register it.

Writes are asynchronous and bounded: past `max_pending_pages` pages queued, a new store
fails at once ("queue full") instead of growing memory; the core then treats the node
as not stored. Errors become strings reported on the loop, to the store's health, which
every namespace's mover shares (`storage/health.py`: the first error of an outage and
the recovery after it, `storage.unavailable` and `storage.recovered`, whichever
namespace's calls saw them; a full store's refusals counted, no outage). The first store
refused for a full queue and the first accepted after it are said too
(`storage.queue_full`, `storage.queue_drained`). Reads and writes are told apart
(`direction`): a store that serves reads but refuses writes (a full disk, Redis at
`maxmemory` with `noeviction`) is one failing direction, not an outage and a recovery
with every read and write.

Lookups (`find_run`, `probe`) answer engine calls, so they are waited for at most
`lookup_timeout` seconds, whatever the backend's own timeouts add up to (a frozen Redis
Cluster costs a call one socket timeout per shard and more per topology refresh). Past
it the lookup answers "nothing stored", and so does every lookup after it, without
asking storage, until the late one ends: engines never queue behind a store that does
not answer, and a hung store holds one lookup, not one per engine call. A lookup whose
caller gave up first (its deadline) counts as late the same way. A lookup that fails
(a store that refuses connections fails each call in a fraction of a second, which every
engine call paid) pauses lookups: for `READ_BACKOFF_S[0]` seconds, doubling with each
failure up to `READ_BACKOFF_S[1]`, lookups answer "nothing stored" at once, and one
lookup per pause tries storage again (a store that succeeds after failed ones ends the
pause: the next lookup tries at once); the first that succeeds ends the outage. Lookups
and fetches run on threads apart from the stores', so writes a store is slow to take (a
fork, a failover) never hold up reads.
"""

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from ..core.pages import count, unpack
from ..logs import log_event
from ..storage import ReadAhead, StorageBackend, StorageFull, StorageTimeout, StorageUnavailable

log = logging.getLogger("radixkv.storage")

READ_BACKOFF_S = (1.0, 30.0)  # lookups' first and longest pause after failed ones


def _close_read(done) -> None:
    """Close a read ahead nobody waits for any more (its caller was cancelled)."""
    if not done.cancelled() and done.exception() is None:
        done.result().close()


class StorageMover:
    def __init__(self, loop: asyncio.AbstractEventLoop, backend: StorageBackend, host_pool,
                 on_stored, on_fetched, *, workers: int = 2, max_pending_pages: int = 4096,
                 lookup_timeout: float = 0.0, namespace: str = "", observe=None, on_fetch_gave_up=None,
                 on_lost=None):
        self._loop = loop
        self._backend = backend
        self._host = host_pool
        self._on_stored = on_stored      # (transfer, error | None), on the loop
        self._on_fetched = on_fetched    # (transfer, pages_read, error | None), on the loop
        # Stores queue on threads of their own: lookups and fetches, which engines wait
        # for, never wait behind writes a slow store is taking its time over.
        self._writes = ThreadPoolExecutor(workers, thread_name_prefix="radixkv-storage-write")
        self._reads = ThreadPoolExecutor(workers, thread_name_prefix="radixkv-storage-read")
        self._max_pending = max_pending_pages
        self._lookup_timeout = lookup_timeout  # 0: lookups are waited for as long as they take
        self.late_lookups = 0  # lookups past lookup_timeout still running: storage is skipped meanwhile
        self._observe = observe          # (operation, seconds, ok) from worker threads
        self._on_fetch_gave_up = on_fetch_gave_up  # (transfer), on the loop: past the store's timeout
        # (), on the loop: the store may have lost pages (told by the backend, any thread)
        self._stop_hearing_lost = backend.on_lost(lambda: self._to_loop(on_lost)) if on_lost else None
        self.namespace = namespace
        self.pending_pages = 0
        self.health = backend.health  # the store's, shared by every namespace's mover
        self.refused_stores = 0  # since the queue last filled up (0: it is not full)
        self._fetch_timeout_said = False  # since reads last succeeded
        self._read_backoff = 0.0  # seconds lookups pause after the next failure (0: no outage)
        self._reads_paused_until = 0.0  # loop time
        self._closed = False
        self._pages = None  # numpy view of the pool, [num_pages, page_bytes], made lazily
        self._attach()

    def _pool_memory(self) -> tuple[int, int] | None:
        """(address, bytes) of the host pool's memory; None for a pool with none."""
        tensor = getattr(self._host, "tensor", None)
        if tensor is None or tensor.numel() == 0:
            return None
        return tensor.data_ptr(), tensor.numel()

    def _attach(self) -> None:
        if (memory := self._pool_memory()) is not None:
            try:
                self._backend.attach_memory(*memory)
            except StorageUnavailable as e:  # moving bytes still works, through copies
                log_event(log, "storage.attach_failed", logging.WARNING, store=self._backend.name, error=e,
                          note="pages move through copies")

    def _detach(self) -> None:
        """The pool is about to be freed: the backend forgets it (`_attach`'s undo)."""
        if (memory := self._pool_memory()) is not None:
            try:
                self._backend.detach_memory(*memory)
            except Exception as e:  # best effort: the pool goes either way
                log_event(log, "storage.detach_failed", logging.WARNING, store=self._backend.name, error=e)

    def _page_views(self, host_pages: bytes) -> list[memoryview]:
        """Writable views of these host pages: what the backend reads into or writes from."""
        pages = self._pages
        if pages is None:
            if self._closed:  # a store or fetch still queued at close: the pool is gone
                raise StorageUnavailable(self._backend.name, "reading or writing host pages", detail="closed")
            pages = self._pages = self._host.tensor.numpy()
        return [memoryview(pages[p]) for p in unpack(host_pages)]

    # -- the core's Copier half ---------------------------------------------------------

    def store(self, transfer: int, host_pages: bytes, keys: list[bytes]) -> None:
        n = count(host_pages)
        if self._closed or self.pending_pages + n > self._max_pending:
            reason = "storage is closed" if self._closed else (
                f"storage write queue full ({self.pending_pages} pages pending)")
            if not self._closed:
                self._refused(n)
            self._loop.call_soon(self._stored, transfer, 0, reason)  # nothing was queued
            return
        if self.refused_stores:
            log_event(log, "storage.queue_drained", namespace=self.namespace, refused_stores=self.refused_stores,
                      pending_pages=self.pending_pages)
            self.refused_stores = 0
        self.pending_pages += n
        self._writes.submit(self._store, transfer, bytes(host_pages), list(keys))

    def _refused(self, pages: int) -> None:
        if not self.refused_stores:
            log_event(log, "storage.queue_full", logging.WARNING, namespace=self.namespace,
                      pending_pages=self.pending_pages, refused_pages=pages, max_pending_pages=self._max_pending,
                      note="stores are refused (their pages stay on host only) until the queue drains")
        self.refused_stores += 1

    def fetch(self, transfer: int, keys: list[bytes], host_pages: bytes, ahead: ReadAhead | None = None) -> None:
        """Read `keys` into `host_pages`; from `ahead` (a `find_run` answer) where it
        holds exactly the run of these keys, else from the store."""
        keys = list(keys)
        if ahead is not None and (self._closed or ahead.records is None or ahead.keys[:len(keys)] != keys):
            ahead.close()  # nothing read, or not these keys (the cache moved on): read afresh
            ahead = None
        if self._closed:
            self._loop.call_soon(self._fetched, transfer, 0, "storage is closed")
            return
        self._reads.submit(self._fetch, transfer, ahead or ReadAhead(keys), bytes(host_pages))

    async def find_run(self, keys: list[bytes], read: bool) -> ReadAhead:
        """The run of `keys` storage holds; none while it is down. With `read`, read along
        where the backend can (StorageBackend.read_ahead): then the caller hands it to
        `fetch` or closes it (if the caller is cancelled meanwhile, it is closed when the
        read completes). Without, only a probe (exists_prefix)."""
        if not keys or self._closed or self.late_lookups or self._reads_paused():
            return ReadAhead([])
        if read:
            job = self._reads.submit(self._timed, "exists", self._backend.read_ahead, keys,
                                    self._host.layout.page_bytes)
        else:
            job = self._reads.submit(lambda: ReadAhead(keys[:self._probe([keys])[0]]))
        try:
            answer = await self._answer(job, _close_read)
        except StorageUnavailable as e:
            self._lookup_failed(str(e))
            return ReadAhead([])
        except asyncio.CancelledError:
            job.add_done_callback(_close_read)
            raise
        self._lookup_answered()
        return answer

    async def probe(self, key_lists: list[list[bytes]]) -> list[int]:
        """How many leading keys of each list storage holds; zeros while it is down."""
        if not any(key_lists) or self.late_lookups or self._reads_paused():
            return [0] * len(key_lists)
        try:
            answer = await self._answer(self._reads.submit(self._probe, key_lists))
        except StorageUnavailable as e:
            self._lookup_failed(str(e))
            return [0] * len(key_lists)
        self._lookup_answered()
        return answer

    def _reads_paused(self) -> bool:
        """Whether lookups skip storage now (a pause after failed ones). The first lookup
        past a pause goes to storage and starts the next pause at once, so the others
        skip while it tries."""
        now = self._loop.time()
        if now < self._reads_paused_until:
            return True
        if self._read_backoff:
            self._reads_paused_until = now + self._read_backoff
        return False

    def _lookup_failed(self, error: str) -> None:
        self._read_backoff = min(max(2 * self._read_backoff, READ_BACKOFF_S[0]), READ_BACKOFF_S[1])
        self._reads_paused_until = self._loop.time() + self._read_backoff
        self._health(error, "read", by="lookup")

    def _lookup_answered(self) -> None:
        """A lookup got its answer: this namespace's pause of lookups ends, and a read
        outage a failed lookup began, whichever namespace's (one a fetch began ends with
        a fetch: where lookups and reads of pages disagree, a dead Mooncake segment
        owner, the log would flap)."""
        if self._read_backoff:
            self._read_backoff = self._reads_paused_until = 0.0
        if "read" in self.health.failing:
            self._health(None, "read", by="lookup")

    async def _answer(self, job, discard=None):
        """The lookup `job`'s answer, waited for at most lookup_timeout. Past it, raises
        StorageUnavailable; lookups then skip storage until the job ends, which says
        whether storage recovered (its answer, nobody's now, goes to `discard`)."""
        answer = asyncio.wrap_future(job)
        if not self._lookup_timeout:
            return await answer
        due = self._loop.time() + self._lookup_timeout
        try:
            done, _ = await asyncio.wait([answer], timeout=self._lookup_timeout)
        except asyncio.CancelledError:
            if not job.done() and not job.cancel():  # started (not run if not): holds a thread till it ends
                self._loop.call_at(due, self._outlived, answer)
            raise
        if done:
            return answer.result()
        self._late(answer, discard)
        raise StorageUnavailable(self._backend.name, "lookup", detail=(
            f"no answer within {self._lookup_timeout:g}s (--storage-lookup-timeout); lookups skip storage "
            "until it answers"))

    def _late(self, answer: asyncio.Future, discard) -> None:
        """A lookup past lookup_timeout still runs: lookups skip storage until it ends."""
        self.late_lookups += 1
        answer.add_done_callback(lambda late: self._late_answer(late, discard))

    def _outlived(self, answer: asyncio.Future) -> None:
        """A lookup whose caller gave up (its deadline, a disconnect) before lookup_timeout:
        still running at that timeout, it counts as late as if its caller had waited."""
        if not answer.done():
            self._late(answer, None)
            self._health(f"{self._backend.name}: no answer within {self._lookup_timeout:g}s "
                         "(--storage-lookup-timeout; its caller gave up before); lookups skip storage "
                         "until it answers", "read", by="lookup")

    def _late_answer(self, late: asyncio.Future, discard) -> None:
        self.late_lookups -= 1
        if late.cancelled():
            return
        error = late.exception()
        self._health(None if error is None else str(error), "read", by="lookup")
        if discard is not None:
            discard(late)

    # -- worker threads ----------------------------------------------------------------

    def _timed(self, operation: str, fn, *args):
        start = time.perf_counter()
        ok = False
        try:
            result = fn(*args)
            ok = True
            return result
        finally:
            if self._observe is not None:
                self._observe(operation, time.perf_counter() - start, ok)

    def _probe(self, key_lists):
        return [self._timed("exists", self._backend.exists_prefix, keys) if keys else 0 for keys in key_lists]

    def _store(self, transfer: int, host_pages: bytes, keys: list[bytes]) -> None:
        error, full = None, False
        try:
            self._timed("put", self._backend.put, list(zip(keys, self._page_views(host_pages))))
        except Exception as e:  # StorageUnavailable, or a bug: reported, never raised here
            # A store past its timeout (StorageTimeout) is reported now, though the store may
            # still read its pages: a page reused meanwhile lands under the old record's
            # checksum, so a reader finds it damaged (a miss), never wrong bytes; holding
            # the pages instead held Evicts and shutdown as long as a frozen node did.
            error = str(e) if isinstance(e, StorageUnavailable) else f"{type(e).__name__}: {e}"
            full = isinstance(e, StorageFull)
        self._to_loop(self._stored, transfer, count(host_pages), error, full)

    def _fetch(self, transfer: int, ahead: ReadAhead, host_pages: bytes) -> None:
        read, error = 0, None
        try:
            # Missing, damaged, or of another layout: the run of pages ends there.
            read = self._timed("get", self._backend.place, ahead, self._page_views(host_pages))
        except StorageTimeout as e:
            # The store may still write these pages: they stay reserved until it returns.
            message = str(e)  # `e` is unbound once this block ends
            self._to_loop(self._fetch_timed_out, transfer, message)
            e.settled.add_done_callback(lambda _: self._to_loop(self._fetched, transfer, 0, message))
            return
        except Exception as e:
            error = str(e) if isinstance(e, StorageUnavailable) else f"{type(e).__name__}: {e}"
        self._to_loop(self._fetched, transfer, read, error)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    # -- on the loop -------------------------------------------------------------------

    def _stored(self, transfer: int, queued_pages: int, error: str | None, full: bool = False) -> None:
        self.pending_pages -= queued_pages
        if full:  # the store answered, without room: no outage (it ends one)
            self.health.full(error, self.namespace)
            self._health(None, "write")
        elif queued_pages:  # a store refused before it was queued says nothing of the store
            self._health(error, "write")
            if error is None:  # the store answers: the next lookup tries it, past any pause
                self._reads_paused_until = 0.0
        self._on_stored(transfer, error)

    def _fetched(self, transfer: int, read: int, error: str | None) -> None:
        if error != "storage is closed":
            self._health(error, "read")
        self._on_fetched(transfer, read, error)

    def _fetch_timed_out(self, transfer: int, error: str) -> None:
        """Say the first fetch that timed out while reads work, at WARNING; the next ones,
        until a read succeeds again, at DEBUG (a frozen node times out every fetch)."""
        level = logging.DEBUG if self._fetch_timeout_said else logging.WARNING
        self._fetch_timeout_said = True
        if self._on_fetch_gave_up is not None:
            self._on_fetch_gave_up(transfer)
        log_event(log, "storage.fetch_timeout", level, namespace=self.namespace, transfer=transfer, error=error,
                  note="pages stay reserved until the store answers")

    def _health(self, error: str | None, direction: str, by: str = "") -> None:
        """Tell the store's health (shared by every namespace) how a call of `direction`
        ("read" or "write") went; `by` "lookup" for lookups (see `StorageHealth`)."""
        if error:
            self.health.failed(direction, error, self.namespace, by)
            return
        if direction == "read":
            self._fetch_timeout_said = False
        self.health.answered(direction, self.namespace, by)

    def close(self) -> None:
        """Stop the threads; call once stores and fetches are drained. Idempotent, and
        never blocks on a lookup still running past its timeout (a frozen store): it
        ends on its thread, its answer unread (joining it froze the caller's loop)."""
        if not self._closed:
            self._closed = True
            self._reads.shutdown(wait=False, cancel_futures=True)
            self._writes.shutdown(wait=True)
            if self._stop_hearing_lost is not None:
                self._stop_hearing_lost()
            self._detach()
            self._pages = None  # the view held the whole pool: freed with the pool, not at a later GC
