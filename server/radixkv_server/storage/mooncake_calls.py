"""Store calls with a deadline, for MooncakeStorage.

A Mooncake call cannot be cancelled once it runs, and one to a frozen peer blocks for
30-60 s. `Caller.start` runs it on a call thread and returns a `Call`; `Call.result()`
waits at most the timeout and raises StorageTimeout when the call is still running. The
buffers a call was given (header slots from `Slots`, host pages) may be touched until it
returns: a Call gives its header slots back only once its call has returned AND its
owner has read them (`Call.done()`), and StorageTimeout carries the future that
completes when the store lets go.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout, wait

import numpy as np

from .errors import StorageTimeout, StorageUnavailable
from .record import HEADER_BYTES


def address(buffer) -> int:
    """The address of a C-contiguous buffer (read-only ones too); 0 when empty."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data if memoryview(buffer).nbytes else 0


class Slots:
    """A registered arena of record-header slots. Thread-safe."""

    def __init__(self, count: int):
        self.memory = np.zeros(count * HEADER_BYTES, dtype=np.uint8)
        self.base = self.memory.ctypes.data
        self._free = list(range(count))
        self._lock = threading.Lock()  # worker threads take and give slots

    def take(self, n: int) -> list[int] | None:
        """n free slots, or None when fewer are free (calls still out hold them)."""
        with self._lock:
            if len(self._free) < n:
                return None
            taken, self._free = self._free[-n:], self._free[:-n]
            return taken

    def give(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def ptr(self, slot: int) -> int:
        return self.base + slot * HEADER_BYTES

    def view(self, slot: int) -> memoryview:
        return memoryview(self.memory[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES])


class Call:
    """One store call in flight; `slots` are given back once the call has returned and
    `done()` was called (whichever comes last)."""

    def __init__(self, caller: "Caller", operation: str, future: Future, slots: list[int]):
        self._caller, self.operation, self.future, self.slots = caller, operation, future, slots
        self._pending = 2  # the call's return, and done()
        self._lock = threading.Lock()
        future.add_done_callback(lambda _: self._release())

    def result(self):
        """The call's return value, waited for at most the caller's timeout."""
        seconds = self._caller.timeout
        try:
            return self.future.result(seconds)
        except FutureTimeout:
            if self.future.cancel():  # never started: nothing can touch the buffers
                raise StorageUnavailable(self._caller.name, self.operation,
                                         detail=f"no call thread free within {seconds:g}s") from None
            raise StorageTimeout(self._caller.name, self.operation, seconds, self.future) from None

    def done(self) -> None:
        """The owner has read what it needed from the slots. Idempotent per Call."""
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last and self.slots:
            self._caller.slots.give(self.slots)


class Caller:
    """`threads` call threads and a header arena sized for `batch` pages per call."""

    def __init__(self, name: str, timeout: float, threads: int, batch: int):
        self.name, self.timeout = name, timeout
        self.slots = Slots(batch * (threads + 2))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="radixkv-mooncake")
        self._lock = threading.Lock()  # guards _running: submitting threads and finishing calls
        self._running: set[Future] = set()  # store calls submitted and not yet returned

    def start(self, operation: str, fn, *args, slots: list[int] | None = None, **kwargs) -> Call:
        try:
            future = self._submit(fn, *args, **kwargs)
        except RuntimeError as exc:  # shut down
            if slots:
                self.slots.give(slots)
            raise StorageUnavailable(self.name, operation, detail="the backend is closed") from exc
        return Call(self, operation, future, slots or [])

    def run(self, operation: str, fn, *args, **kwargs):
        """fn(*args) with the deadline; for calls that were given no buffers to keep."""
        call = self.start(operation, fn, *args, **kwargs)
        try:
            return call.result()
        finally:
            call.done()

    def take_slots(self, n: int, operation: str) -> list[int]:
        slots = self.slots.take(n)
        if slots is None:
            raise StorageUnavailable(self.name, operation,
                                     detail="too many store calls still unanswered (header slots in use)")
        return slots

    def submit(self, fn, *args) -> Future:
        """fn(*args) on a call thread, no deadline (joining the store)."""
        return self._submit(fn, *args)

    def close(self) -> None:
        """No new calls; queued ones are cancelled, running ones go on (see `settle`)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def settle(self, seconds: float) -> bool:
        """Wait up to `seconds` for every store call submitted so far to return; True
        when none is still running (only then may the store be closed and the buffers
        given to its calls be freed)."""
        with self._lock:
            running = list(self._running)
        return not wait(running, seconds).not_done

    def _submit(self, fn, *args, **kwargs) -> Future:
        future = self._pool.submit(fn, *args, **kwargs)
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._returned)
        return future

    def _returned(self, future: Future) -> None:
        with self._lock:
            self._running.discard(future)


def both(first: Future, second: Future) -> Future:
    """A future that completes when both have (for a StorageTimeout covering two calls)."""
    out: Future = Future()
    left = [2]
    lock = threading.Lock()

    def one(_):
        with lock:
            left[0] -= 1
            finished = left[0] == 0
        if finished:
            out.set_result(None)

    first.add_done_callback(one)
    second.add_done_callback(one)
    return out


class Staging:
    """Up to `count` staging buffers of `nbytes` each, for copying gets; `on_new(buffer)`
    registers a new one with the store. A buffer whose call timed out comes back only
    when the store lets go of it (the caller gives it back then). Thread-safe."""

    def __init__(self, count: int, on_new):
        self._count, self._on_new = count, on_new
        self._free: list[np.ndarray] = []
        self._made = 0
        self._lock = threading.Lock()  # worker threads take and give buffers

    def take(self, nbytes: int) -> np.ndarray | None:
        """A buffer of at least nbytes, or None when all are in use (or a new one cannot
        be registered): the caller then reads in place instead."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
            if self._made >= self._count:
                return None
            self._made += 1
        buf = np.empty(nbytes, dtype=np.uint8)
        if not self._on_new(buf):
            with self._lock:
                self._made -= 1
            return None
        return buf

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
