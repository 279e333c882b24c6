"""A namespace: one cache core, its host pool, and the attached engine's device buffers.

The event loop owns all of it. Copies run on the copy engine's threads and report back
on the loop (`_on_copy_done`), which is the only place the core hears of them.
"""

import asyncio
import logging
import time

from radixkv.layout import KvLayout

from ..core import CacheConfig, HierarchicalCache
from ..core.pages import count
from ..datapath import CopyEngine, HostPool
from ..datapath.storage_mover import StorageMover
from ..logs import log_event

log = logging.getLogger("radixkv.namespace")


class Namespace:
    def __init__(self, name: str, layout: KvLayout, model: str, config: CacheConfig,
                 host_pool: HostPool, device, backend: str, copy_workers: int, metrics=None,
                 storage_backend=None, storage_workers: int = 2, storage_queue_pages: int = 4096,
                 copy_delay: float = 0.0):
        self.name = name
        self.layout = layout
        self.model = model
        self.config = config
        self.host_pool = host_pool
        self.device = device
        self.backend = backend  # "shm" or "cuda"
        self.copy_workers = copy_workers
        self.copy_delay = copy_delay  # fault injection for tests (DaemonConfig.fault_copy_delay)
        self.session = None  # the attached engine's Session, if any
        self.expirations = {"lease": 0, "load_back": 0}  # released by the daemon's timeouts
        self.cache = HierarchicalCache(config, self, num_device_pages=device.num_pages,
                                       host_pages=host_pool.num_pages)
        self._metrics = metrics
        self._started: dict[int, tuple[str, float]] = {}  # transfer -> (direction, start time)
        self._copied: dict[int, asyncio.Event] = {}
        self._evictions: dict[int, asyncio.Future] = {}
        self._fetches: dict[int, asyncio.Future] = {}
        self._loop = asyncio.get_running_loop()
        self._past_bytes = {"load": 0, "backup": 0}  # of copy engines already retired
        self.engine = self._new_engine()
        self.storage = None
        if storage_backend is not None:
            self.storage = StorageMover(
                self._loop, storage_backend, host_pool, self._on_copy_done, self._on_fetch_done,
                workers=storage_workers, max_pending_pages=storage_queue_pages, namespace=name,
                observe=metrics.observe_storage if metrics is not None else None)

    def _new_engine(self) -> CopyEngine:
        return CopyEngine(self._loop, self.device, self.host_pool, self._on_copy_done,
                          workers=self.copy_workers, delay=self.copy_delay)

    # -- the core's Copier -----------------------------------------------------------

    def load(self, transfer: int, host_pages: bytes, device_pages: bytes) -> None:
        self._started[transfer] = ("load", time.perf_counter())
        self.engine.load(transfer, host_pages, device_pages)  # only sessions load: attached

    def backup(self, transfer: int, device_pages: bytes, host_pages: bytes) -> None:
        kind = self.cache.transfers[transfer].kind.value if transfer in self.cache.transfers else "backup"
        self._started[transfer] = (kind, time.perf_counter())
        self.engine.backup(transfer, device_pages, host_pages)

    def store(self, transfer: int, host_pages: bytes, keys: list[bytes]) -> None:
        self._started[transfer] = ("store", time.perf_counter())
        self.storage.store(transfer, host_pages, keys)

    def fetch(self, transfer: int, keys: list[bytes], host_pages: bytes) -> None:
        self._started[transfer] = ("fetch", time.perf_counter())
        self.storage.fetch(transfer, keys, host_pages)

    def _observe_copy(self, transfer: int, error: str | None) -> None:
        direction, start = self._started.pop(transfer, (None, 0.0))
        if self._metrics is not None and error is None and direction is not None:
            self._metrics.copy_duration.labels(self.name, direction).observe(time.perf_counter() - start)

    def _on_fetch_done(self, transfer: int, pages_read: int, error: str | None) -> None:
        self._observe_copy(transfer, error)
        outcome = self.cache.on_fetch_done(transfer, pages_read, error)
        fut = self._fetches.pop(transfer, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome)
        event = self._copied.pop(transfer, None)
        if event is not None:
            event.set()

    def fetch_done(self, transfer: int) -> asyncio.Future:
        """A future resolving to the fetch's FetchOutcome (None if it is not in flight)."""
        fut = self._fetches.get(transfer)
        if fut is None:
            fut = self._loop.create_future()
            if transfer in self.cache.transfers:
                self._fetches[transfer] = fut
            else:
                fut.set_result(None)
        return fut

    def _on_copy_done(self, transfer: int, error: str | None) -> None:
        self._observe_copy(transfer, error)
        outcome = self.cache.on_copy_done(transfer, error)
        if error is not None:
            log_event(log, "copy.failed", logging.WARNING, namespace=self.name,
                      transfer=transfer, error=error)
        fut = self._evictions.pop(transfer, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome.freed_pages)
        event = self._copied.pop(transfer, None)
        if event is not None:
            event.set()

    # -- waiting -----------------------------------------------------------------------

    def _in_flight(self, transfer: int) -> bool:
        t = self.cache.transfers.get(transfer)
        return t is not None and not t.copied

    async def wait_copied(self, transfers) -> None:
        """Return once every named copy has completed (unknown ids count as done)."""
        for tid in transfers:
            if self._in_flight(tid):
                event = self._copied.setdefault(tid, asyncio.Event())
                await event.wait()

    async def drain(self) -> None:
        """Return once no copy is in flight."""
        while busy := [tid for tid in self.cache.transfers if self._in_flight(tid)]:
            await self.wait_copied(busy)

    # -- operations spanning copies ----------------------------------------------------

    async def evict(self, num_pages: int) -> tuple[bytes, int]:
        """Free up to `num_pages` device pages, waiting for write-backs. Returns the
        freed pages and how many of them were written back to host first."""
        freed: list[bytes] = []
        written_back = 0
        need = num_pages
        while need > 0:
            result = self.cache.evict_device(need)
            freed.append(result.freed_pages)
            progress = count(result.freed_pages)
            if not result.pending:
                break
            futures = []
            for tid in result.pending:
                fut = self._loop.create_future()
                self._evictions[tid] = fut
                futures.append(fut)
            for pages in await asyncio.gather(*futures):
                freed.append(pages)
                written_back += count(pages)
                progress += count(pages)
            if progress == 0:
                break  # write-backs kept their nodes (touched meanwhile)
            need -= progress
        return b"".join(freed), written_back

    async def attach(self, device, backend: str) -> int:
        """Swap in a restarted engine's device buffers: wait for copies, drop the old
        device residency (host copies stay), start a new copy engine. Returns tokens
        dropped from the cache."""
        await self.drain()
        dropped = self.cache.drop_device(device.num_pages)
        self._release_device()
        self.device = device
        self.backend = backend
        self.engine = self._new_engine()
        log_event(log, "namespace.reattached", namespace=self.name, dropped_tokens=dropped)
        return dropped

    async def detach(self) -> int:
        """The engine's session ended: wait for copies, forget its device pages (host and
        storage copies stay) and close its buffers, so a dead engine's memory (a CUDA
        IPC mapping keeps it allocated) is not held until the next registration.
        Returns tokens dropped from the cache. Idempotent."""
        await self.drain()
        if self.device is None:
            return 0
        dropped = self.cache.drop_device(0)
        self._release_device()
        log_event(log, "namespace.detached", namespace=self.name, dropped_tokens=dropped)
        return dropped

    def _release_device(self) -> None:
        if self.engine is not None:
            self._past_bytes["load"] += self.engine.load_bytes
            self._past_bytes["backup"] += self.engine.backup_bytes
            self.engine.close()
            self.engine = None
        if self.device is not None:
            self.device.close()
            self.device = None

    @property
    def loaded_bytes(self) -> int:
        """Bytes copied host->device since the namespace was created."""
        return self._past_bytes["load"] + (self.engine.load_bytes if self.engine else 0)

    @property
    def backed_up_bytes(self) -> int:
        """Bytes copied device->host since the namespace was created."""
        return self._past_bytes["backup"] + (self.engine.backup_bytes if self.engine else 0)

    async def close(self) -> None:
        """Drain copies, stop the copy threads, close the device buffers (IPC handles)
        and the host pool (unpinning it). Idempotent."""
        await self.drain()
        self._release_device()
        if self.storage is not None:
            self.storage.close()
        self.host_pool.close()
