"""CopyEngine: the core's Copier, running page copies on worker threads.

The event loop owns the cache; `load` and `backup` are called on it by the core, hand
the copy to a thread and return at once. Each copy is submitted to the device backend
by a submit thread, waited for by a wait thread, then reported with
`on_done(transfer, error_or_None)` on a later turn of the loop
(`call_soon_threadsafe`), never from inside `load`/`backup`.

Threads per direction (loads, backups): `workers` submit threads and one wait thread.
Loads never queue behind backups, and on CUDA a submit thread only enqueues, so many
copies are in flight on the streams while the wait thread reports them in stream
order. On shared memory the submit thread does the copy and there is nothing to wait.

State: `_flights` and the counters belong to the loop and are touched only there;
threads read their own flight's immutable fields and hand results back through the
loop. No lock is needed.
"""

import asyncio
import logging
import random
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor

from ..core.pages import count
from .device import CopyError, DeviceBuffers

log = logging.getLogger("radixkv.datapath")


class _Flight:
    """One copy in flight. `submitted` resolves to (events, error) once enqueued,
    `done` to the error string (or None) once finished; neither ever holds an exception."""

    __slots__ = ("transfer", "to_host", "host_pages", "device_pages", "after", "submitted", "done", "future")

    def __init__(self, loop, transfer: int, to_host: bool, host_pages: bytes, device_pages: bytes, after: bytes):
        self.transfer = transfer
        self.to_host = to_host
        self.host_pages = host_pages
        self.device_pages = device_pages
        self.after = after  # the engine's event the copy waits for (b"": none)
        self.submitted = loop.create_future()
        self.done = loop.create_future()
        self.future = None  # the thread pool's future


class CopyEngine:
    """Copier for one (device buffers, host pool) pair. `on_done(transfer, error)` is
    called on `loop` once per copy started; an exception it raises is logged, never
    propagated. Call every method on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, device_buffers: DeviceBuffers, host_pool, on_done,
                 workers: int = 2, delay: float = 0.0, fail_loads: float = 0.0):
        if workers < 1:
            raise ValueError(f"copy engine needs >= 1 worker, got {workers}")
        self._loop = loop
        self._device = device_buffers
        self._host = host_pool
        self._on_done = on_done
        self._delay = delay  # fault injection (tests): each copy waits this long first
        self._fail_loads = fail_loads  # fault injection (tests): this fraction of loads fail
        self._submitters = {d: ThreadPoolExecutor(workers, thread_name_prefix=f"radixkv-{d}") for d in _DIRS}
        self._waiters = {d: ThreadPoolExecutor(1, thread_name_prefix=f"radixkv-{d}-wait") for d in _DIRS}
        self._flights: dict[int, _Flight] = {}
        self._closed = False
        self.engine_event = b""  # the latest engine event (order_after); every copy waits for it
        # Counters (read by metrics), for finished copies only. Seconds run from submit to
        # completion per copy and are summed, so copies that overlap both count.
        self.num_loads = self.num_backups = self.num_failed = 0
        self.load_bytes = self.backup_bytes = 0
        self.load_seconds = self.backup_seconds = 0.0

    # -- Copier ------------------------------------------------------------------------

    def order_after(self, event: bytes) -> None:
        """Every copy started from now on runs after the engine's interprocess event
        `event` (IPC handle bytes; see `device` ENGINE EVENTS), until a newer one comes.
        Copies the core starts later (a write-through backup on a match) wait for the
        latest event too: recorded later on the engine's stream, it covers earlier work."""
        if event:
            self.engine_event = bytes(event)

    def load(self, transfer: int, host_pages: bytes, device_pages: bytes) -> None:
        """Start copying host pages to device pages (page i to page i). Returns at once."""
        self._start(transfer, False, host_pages, device_pages, self.engine_event)

    def backup(self, transfer: int, device_pages: bytes, host_pages: bytes) -> None:
        """Start copying device pages to host pages (page i to page i). Returns at once."""
        self._start(transfer, True, host_pages, device_pages, self.engine_event)

    def _start(self, transfer: int, to_host: bool, host_pages: bytes, device_pages: bytes, after: bytes) -> None:
        if transfer in self._flights:
            # Two copies under one id would report twice; the core never does this.
            raise ValueError(f"transfer {transfer} already has a copy in flight")
        flight = _Flight(self._loop, transfer, to_host, bytes(host_pages), bytes(device_pages), bytes(after))
        self._flights[transfer] = flight
        if self._closed:
            self._loop.call_soon(self._finish, flight, "copy engine is closed", 0.0)
            return
        flight.future = self._submitters[_DIRS[to_host]].submit(self._submit, flight)

    # -- worker thread -----------------------------------------------------------------

    def _submit(self, flight: _Flight) -> None:
        start = time.perf_counter()
        if self._delay:
            time.sleep(self._delay)
        try:
            if not flight.to_host and self._fail_loads and random.random() < self._fail_loads:
                raise CopyError("injected fault (--fault-fail-loads): this load copy failed")
            after = {"after": flight.after} if flight.after else {}  # backends from before engine events work on
            if flight.to_host:
                job = self._device.submit_store(flight.device_pages, self._host, flight.host_pages, **after)
            else:
                job = self._device.submit_load(self._host, flight.host_pages, flight.device_pages, **after)
        except Exception as e:  # any failure becomes the transfer's error, never the loop's
            self._to_loop(self._finish, flight, _describe(e), time.perf_counter() - start)
            return
        self._to_loop(self._set_submitted, flight, list(job.events))
        if job.pending:
            self._waiters[_DIRS[flight.to_host]].submit(self._wait_job, flight, job, start)
        else:
            self._to_loop(self._finish, flight, None, time.perf_counter() - start)

    def _wait_job(self, flight: _Flight, job, start: float) -> None:
        error = None
        try:
            job.wait()
        except Exception as e:
            error = _describe(e)
        self._to_loop(self._finish, flight, error, time.perf_counter() - start)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: nobody is left to tell
            log.warning("copy of transfer %d finished after its event loop closed", args[0].transfer)

    # -- on the loop ---------------------------------------------------------------------

    @staticmethod
    def _set_submitted(flight: _Flight, events: list[bytes]) -> None:
        if not flight.submitted.done():
            flight.submitted.set_result((events, None))

    def _finish(self, flight: _Flight, error: str | None, seconds: float) -> None:
        if self._flights.get(flight.transfer) is flight:
            del self._flights[flight.transfer]
        nbytes = count(flight.host_pages) * self._host.layout.page_bytes
        if error is not None:
            self.num_failed += 1
        elif flight.to_host:
            self.num_backups += 1
            self.backup_bytes += nbytes
            self.backup_seconds += seconds
        else:
            self.num_loads += 1
            self.load_bytes += nbytes
            self.load_seconds += seconds
        if not flight.submitted.done():
            flight.submitted.set_result(([], error))
        try:
            self._on_done(flight.transfer, error)
        except Exception:
            log.exception("on_done(%d, %r) raised", flight.transfer, error)
        finally:
            flight.done.set_result(error)

    # -- awaiting ------------------------------------------------------------------------

    def submitted(self, transfer: int) -> Awaitable[list[bytes]]:
        """Awaitable: once the copy is enqueued, its CUDA IPC event handles (one per
        layer for a load on CUDA, else empty); raises CopyError if the copy could not
        be started. The transfer is looked up when `submitted` is called: one not in
        flight then (finished, or never started here) gives [] (its bytes are in place,
        or its failure went to on_done)."""
        return self._submitted(transfer, self._flights.get(transfer))

    async def layer_events(self, transfer: int) -> tuple[bytes, ...]:
        """A load's per-layer events for the engine to wait on, once it is enqueued: none,
        without waiting, where the buffers have none (shared memory). Raises CopyError as
        `submitted` does."""
        if not self._device.layer_events:
            return ()
        return tuple(await self.submitted(transfer))

    @staticmethod
    async def _submitted(transfer: int, flight: _Flight | None) -> list[bytes]:
        if flight is None:
            return []
        events, error = await asyncio.shield(flight.submitted)
        if error is not None:
            raise CopyError(f"copy of transfer {transfer} failed: {error}")
        return events

    def wait(self, transfer: int) -> Awaitable[str | None]:
        """Awaitable: once the copy has finished and on_done has run, its error or None.
        Looked up when called: a transfer not in flight then gives None at once."""
        return self._wait(self._flights.get(transfer))

    @staticmethod
    async def _wait(flight: _Flight | None) -> str | None:
        if flight is None:
            return None
        return await asyncio.shield(flight.done)

    async def drain(self) -> None:
        """Wait until no copy is in flight, including copies started meanwhile."""
        while self._flights:
            await asyncio.gather(*(asyncio.shield(f.done) for f in list(self._flights.values())))

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    def close(self) -> None:
        """Stop taking copies and shut the threads down; blocks until copies already
        submitted have finished (so the backends can be closed after). Copies queued but not
        started are reported failed through on_done. Idempotent. Drain first to let
        every copy finish."""
        if self._closed:
            return
        self._closed = True
        for pool in self._submitters.values():  # first: they hand jobs to the waiters
            pool.shutdown(wait=True, cancel_futures=True)
        for pool in self._waiters.values():
            pool.shutdown(wait=True)
        for flight in list(self._flights.values()):
            if flight.future is not None and flight.future.cancelled():
                try:
                    self._loop.call_soon(self._finish, flight, "copy engine closed before the copy started", 0.0)
                except RuntimeError:  # loop closed
                    pass


_DIRS = ("load", "backup")  # indexed by to_host


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


__all__ = ["CopyEngine"]
