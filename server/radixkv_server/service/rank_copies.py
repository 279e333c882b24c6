"""RankCopies: the copies of an engine-managed namespace, one copy engine per rank session.

The core's `EngineTier` calls `save` / `load_into` naming the session (owner) whose
engine pages are copied; each ENGINE session attached its own device buffers, copied
through its rank's `HostShard` of the namespace's host pool (the whole pool when the
namespace is not sharded). Completions come back on the event loop to `on_done`
(the tier's `copied`), then wake whoever waits for that transfer.

The event loop owns all of it; copy threads only call back onto the loop.
"""

import asyncio
import time
from collections.abc import Callable, Iterable

from ..datapath import CopyEngine, CopyError, DeviceBuffers, HostPool, HostShard
from .namespace_config import NamespaceConfig


class RankCopies:
    """`on_done(transfer, error)` is called on the loop once per copy started. With
    `metrics`, each good copy's time is observed as a managed namespace's are (a save as
    direction `backup`, a load as `load`)."""

    def __init__(self, config: NamespaceConfig, host_pool: HostPool, tp_size: int,
                 on_done: Callable[[int, str | None], None], metrics=None):
        self._config = config
        self._metrics = metrics
        self._started: dict[int, tuple[str, float]] = {}  # transfer copying -> (direction, start)
        self._pool = host_pool
        self._tp_size = tp_size
        self._on_done = on_done
        self._loop = asyncio.get_running_loop()
        self._engines: dict[str, tuple[CopyEngine, DeviceBuffers]] = {}
        self._owner: dict[int, str] = {}  # transfer copying -> session id
        self._waiters: dict[int, asyncio.Event] = {}
        self._past = {"load": 0, "save": 0}  # bytes of copy engines already detached

    def attach(self, owner: str, device: DeviceBuffers, rank: int) -> None:
        """Copy `owner`'s pages with these buffers, into rank `rank`'s slice of each host page."""
        host = self._pool if self._tp_size == 1 else HostShard(self._pool, self._config.layout, rank, self._tp_size)
        engine = CopyEngine(self._loop, device, host, self._copied, workers=self._config.copy_workers,
                            delay=self._config.copy_delay, fail_loads=self._config.fail_loads)
        self._engines[owner] = (engine, device)

    @property
    def loaded_bytes(self) -> int:
        """Bytes copied host -> engine pages, by every rank session so far."""
        return self._past["load"] + sum(e.load_bytes for e, _ in self._engines.values())

    @property
    def saved_bytes(self) -> int:
        """Bytes copied engine pages -> host, by every rank session so far."""
        return self._past["save"] + sum(e.backup_bytes for e, _ in self._engines.values())

    def order_after(self, owner: str, engine_event: bytes) -> None:
        """Copies of `owner`'s pages started from now on wait for its engine's
        interprocess event (CUDA; ignored by shared memory). Nothing for a session
        without buffers (a SCHEDULER) or without an event."""
        pair = self._engines.get(owner)
        if pair is not None and engine_event:
            pair[0].order_after(engine_event)

    # -- the EngineTier's EngineCopier ------------------------------------------------------

    def save(self, transfer: int, owner: object, device_pages: bytes, host_pages: bytes) -> None:
        self._owner[transfer] = owner
        self._started[transfer] = ("backup", time.perf_counter())
        self._engines[owner][0].backup(transfer, device_pages, host_pages)

    def load_into(self, transfer: int, owner: object, host_pages: bytes, device_pages: bytes) -> None:
        self._owner[transfer] = owner
        self._started[transfer] = ("load", time.perf_counter())
        self._engines[owner][0].load(transfer, host_pages, device_pages)

    def _copied(self, transfer: int, error: str | None) -> None:
        self._owner.pop(transfer, None)
        direction, start = self._started.pop(transfer, (None, 0.0))
        if self._metrics is not None and error is None and direction is not None:
            self._metrics.copy_duration.labels(self._config.name, direction).observe(time.perf_counter() - start)
        try:
            self._on_done(transfer, error)
        finally:
            event = self._waiters.pop(transfer, None)
            if event is not None:
                event.set()

    async def layer_events(self, transfer: int, owner: str) -> tuple[bytes, ...]:
        """The IPC events of a load into `owner`'s pages (one per layer) once it is
        enqueued, for the engine to wait on; none where its buffers have none (shared
        memory) or the copy could not start (its failure comes with the acknowledgement)."""
        pair = self._engines.get(owner)
        if pair is None:
            return ()
        try:
            return await pair[0].layer_events(transfer)
        except CopyError:
            return ()

    # -- waiting ------------------------------------------------------------------------------

    async def wait(self, transfers: Iterable[int]) -> None:
        """Return once every named copy has completed (ids not copying count as done)."""
        for tid in transfers:
            if tid in self._owner:
                await self._waiters.setdefault(tid, asyncio.Event()).wait()

    async def drain(self, owner: str | None = None) -> None:
        """Return once no copy (of `owner`, or of anyone) is in flight."""
        while busy := [t for t, o in self._owner.items() if owner is None or o == owner]:
            await self.wait(busy)

    async def detach(self, owner: str) -> None:
        """Wait for `owner`'s copies, then stop its copy threads and close its buffers."""
        await self.drain(owner)
        pair = self._engines.pop(owner, None)
        if pair is not None:
            engine, device = pair
            self._past["load"] += engine.load_bytes
            self._past["save"] += engine.backup_bytes
            engine.close()
            device.close()

    async def close(self) -> None:
        """Detach every rank session. Idempotent."""
        for owner in list(self._engines):
            await self.detach(owner)


__all__ = ["RankCopies"]
