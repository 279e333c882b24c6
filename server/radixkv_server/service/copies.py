"""Copies: a namespace's page copies in flight, started for the core and waited for.

It is the core's `Copier`: device<->host copies go to the `CopyEngine` of the attached
engine's buffers, storage stores and fetches to the `StorageMover`. Both report on the
event loop (`_copied`, `_fetched`), the only place the core hears of a completed copy;
coroutines wait for copies here (`wait`, `written_back`, `fetched`, `drain`). In an
engine-managed namespace there are no attached buffers: the rank sessions' copies
(`RankCopies`, given as `ranks`) are waited for and counted here too.

The event loop owns all of it; the copy threads only ever call back onto the loop.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from ..core import HierarchicalCache
from ..core.results import FetchOutcome
from ..datapath import CopyEngine, CopyError, DeviceBuffers, HostPool
from ..datapath.storage_mover import StorageMover
from ..logs import log_event
from .namespace_config import NamespaceConfig
from .rank_copies import RankCopies

log = logging.getLogger("radixkv.namespace")


class Copies:
    """Construct, then `bind` the core (they refer to each other), then `attach` buffers."""

    def __init__(self, config: NamespaceConfig, host_pool: HostPool, metrics=None, storage_backend=None,
                 ranks: RankCopies | None = None):
        self._config = config
        self._host_pool = host_pool
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._cache: HierarchicalCache | None = None
        self._started: dict[int, tuple[str, float]] = {}  # transfer -> (direction, start time)
        self._waiters: dict[int, asyncio.Event] = {}  # transfer -> set once copied
        self._write_backs: dict[int, asyncio.Future] = {}
        self._fetches: dict[int, asyncio.Future] = {}
        self._past_bytes = {"load": 0, "backup": 0}  # of copy engines already retired
        self.device: DeviceBuffers | None = None
        self.engine: CopyEngine | None = None
        self._ranks = ranks  # engine-managed: the rank sessions' copies
        self.storage: StorageMover | None = None
        if storage_backend is not None:
            self.storage = StorageMover(
                self._loop, storage_backend, host_pool, self._stored, self._fetched,
                workers=config.storage_workers, max_pending_pages=config.storage_queue_pages,
                lookup_timeout=config.storage_lookup_timeout,
                namespace=config.name, observe=metrics.observe_storage if metrics is not None else None,
                on_fetch_gave_up=self._fetch_gave_up, on_lost=self._storage_lost)

    def bind(self, cache: HierarchicalCache) -> None:
        """The core that completions are reported to. Once, before any copy starts."""
        self._cache = cache

    # -- the engine's buffers -------------------------------------------------------------

    def attach(self, device: DeviceBuffers) -> None:
        """Copy to and from these buffers from now on. No copy may be in flight."""
        self.release_device()
        self.device = device
        self.engine = CopyEngine(self._loop, device, self._host_pool, self._copied,
                                 workers=self._config.copy_workers, delay=self._config.copy_delay,
                                 fail_loads=self._config.fail_loads)

    def release_device(self) -> None:
        """Stop the copy threads and close the buffers (a CUDA IPC mapping keeps the
        engine's memory allocated). Idempotent; no copy may be in flight."""
        if self.engine is not None:
            self._past_bytes["load"] += self.engine.load_bytes
            self._past_bytes["backup"] += self.engine.backup_bytes
            self.engine.close()
            self.engine = None
        if self.device is not None:
            self.device.close()
            self.device = None

    def order_after(self, engine_event: bytes) -> None:
        """Copies to and from the attached buffers started from now on wait for the
        engine's interprocess event (CUDA; ignored by shared memory). See
        `CopyEngine.order_after`."""
        if self.engine is not None and engine_event:
            self.engine.order_after(engine_event)

    @property
    def device_uuid(self) -> str:
        """The GPU the attached buffers were opened on ("" without CUDA buffers)."""
        return getattr(self.device, "device_uuid", "")

    @property
    def loaded_bytes(self) -> int:
        """Bytes copied host->device since the namespace was created (rank copies too)."""
        ranks = self._ranks.loaded_bytes if self._ranks is not None else 0
        return self._past_bytes["load"] + (self.engine.load_bytes if self.engine else 0) + ranks

    @property
    def backed_up_bytes(self) -> int:
        """Bytes copied device->host since the namespace was created (rank copies too)."""
        ranks = self._ranks.saved_bytes if self._ranks is not None else 0
        return self._past_bytes["backup"] + (self.engine.backup_bytes if self.engine else 0) + ranks

    # -- the core's Copier: start a copy, timed for the metrics ----------------------------

    def load(self, transfer: int, host_pages: bytes, device_pages: bytes) -> None:
        self._started[transfer] = ("load", time.perf_counter())
        self.engine.load(transfer, host_pages, device_pages)  # only sessions load: attached

    def backup(self, transfer: int, device_pages: bytes, host_pages: bytes) -> None:
        t = self._cache.transfers.get(transfer)
        self._started[transfer] = (t.kind.value if t is not None else "backup", time.perf_counter())
        self.engine.backup(transfer, device_pages, host_pages)

    def store(self, transfer: int, host_pages: bytes, keys: list[bytes]) -> None:
        self._started[transfer] = ("store", time.perf_counter())
        self.storage.store(transfer, host_pages, keys)

    def fetch(self, transfer: int, keys: list[bytes], host_pages: bytes, ahead=None) -> None:
        self._started[transfer] = ("fetch", time.perf_counter())
        self.storage.fetch(transfer, keys, host_pages, ahead)

    async def find_run(self, keys: list[bytes], read: bool):
        """The run of `keys` storage holds (a ReadAhead); with `read`, read already where
        that is as cheap as probing (StorageMover.find_run)."""
        return await self.storage.find_run(keys, read)

    async def probe(self, key_lists: list[list[bytes]]) -> list[int]:
        """How many leading keys of each list storage holds (zeros while it is down)."""
        return await self.storage.probe(key_lists)

    # -- completions, on the loop ---------------------------------------------------------

    def _copied(self, transfer: int, error: str | None) -> None:
        """A device<->host copy ended (a failure is logged as a warning)."""
        self._settle(transfer, error, logging.WARNING)

    def _stored(self, transfer: int, error: str | None) -> None:
        """A store ended. A failure is the storage tier's condition, which the StorageMover
        logs once per outage (or full queue): here only at debug, or a line per store
        would flood the log."""
        self._settle(transfer, error, logging.DEBUG)

    def _settle(self, transfer: int, error: str | None, failure_level: int) -> None:
        direction = self._observe(transfer, error)
        outcome = self._cache.on_copy_done(transfer, error)
        if error is not None:
            log_event(log, "copy.failed", failure_level, namespace=self._config.name, transfer=transfer,
                      direction=direction, error=error)
        _resolve(self._write_backs.pop(transfer, None), outcome.freed_pages)
        self._wake(transfer)

    def _fetched(self, transfer: int, pages_read: int, error: str | None) -> None:
        self._observe(transfer, error)
        outcome = self._cache.on_fetch_done(transfer, pages_read, error)
        _resolve(self._fetches.pop(transfer, None), outcome)
        self._wake(transfer)

    def _storage_lost(self) -> None:
        """The store may have lost pages it acknowledged: the cache records none as stored."""
        forgotten = self._cache.storage_lost()
        log_event(log, "storage.forgotten", namespace=self._config.name, nodes=forgotten,
                  note="their pages are stored again before they leave the host")

    def _fetch_gave_up(self, transfer: int) -> None:
        """A fetch ran past the store's own timeout: it will read nothing, so whoever
        waits for it (a wait_complete Prefetch) is answered now, 0 pages; the transfer,
        and its reserved host pages, end when the store lets go (`_fetched`)."""
        fut = self._fetches.get(transfer)
        if fut is None:
            fut = self._fetches[transfer] = self._loop.create_future()
        _resolve(fut, FetchOutcome(0, 0))

    def _observe(self, transfer: int, error: str | None) -> str | None:
        """Time a finished copy (a good one) for the metrics; returns its direction."""
        direction, start = self._started.pop(transfer, (None, 0.0))
        if self._metrics is not None and error is None and direction is not None:
            self._metrics.copy_duration.labels(self._config.name, direction).observe(time.perf_counter() - start)
        return direction

    def _wake(self, transfer: int) -> None:
        event = self._waiters.pop(transfer, None)
        if event is not None:
            event.set()

    # -- waiting --------------------------------------------------------------------------

    def in_flight(self, transfer: int) -> bool:
        t = self._cache.transfers.get(transfer)
        return t is not None and not t.copied

    async def wait(self, transfers: Iterable[int]) -> None:
        """Return once every named copy has completed (unknown ids count as done),
        rank sessions' copies included."""
        transfers = list(transfers)
        if self._ranks is not None:
            await self._ranks.wait(transfers)
        for tid in transfers:
            if self.in_flight(tid):
                await self._waiters.setdefault(tid, asyncio.Event()).wait()

    async def drain(self, which: Callable[[], Iterable[int]] | None = None) -> None:
        """Return once no copy is in flight (rank sessions' copies included); with
        `which`, once none of those it names (asked again after each wait) is."""
        while busy := [tid for tid in (which() if which else self._cache.transfers) if self.in_flight(tid)]:
            await self.wait(busy)

    def written_back(self, transfer: int) -> asyncio.Future:
        """A future resolving to the device pages a write-back eviction freed. Ask before
        yielding to the loop after the eviction started it."""
        fut = self._loop.create_future()
        self._write_backs[transfer] = fut
        return fut

    def fetched(self, transfer: int) -> asyncio.Future:
        """A future resolving to the fetch's FetchOutcome (None if it is not in flight)."""
        fut = self._fetches.get(transfer)
        if fut is None:
            fut = self._loop.create_future()
            if transfer in self._cache.transfers:
                self._fetches[transfer] = fut
            else:
                fut.set_result(None)
        return fut

    async def layer_events(self, transfer: int) -> tuple[bytes, ...]:
        """The CUDA IPC events of a load-back (one per layer) once it is enqueued; none
        on shared memory, which has nothing to wait for (`CopyEngine.layer_events`), or
        when the copy could not start: its failure comes with the acknowledgement, as
        in `RankCopies.layer_events` (raised, it answered INTERNAL with no transfer
        to acknowledge, and the load's pages stayed held)."""
        try:
            return await self.engine.layer_events(transfer)
        except CopyError:
            return ()

    def close(self) -> None:
        """Release the buffers and stop storage I/O. Idempotent; drain first."""
        self.release_device()
        if self.storage is not None:
            self.storage.close()


def _resolve(fut: asyncio.Future | None, value) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)
