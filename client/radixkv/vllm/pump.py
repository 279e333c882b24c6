"""An asyncio event loop of the connector's own, run in short passes by the threads that
call the connector instead of by a thread of its own.

vLLM's scheduler steps in a loop that holds the GIL. A thread of ours doing work for it
(sending a Match, reading the answer) gets the GIL only at the interpreter's switch
interval or when the scheduler hands it over, and then the scheduler waits for that
thread, gRPC's threads and the daemon, all sharing the cores: measured on 2 cores, a
Match's round trip took 0.6 ms and each handing-over step 100-300 us. Here the scheduler's
own calls run the loop: `tick` polls the loop's I/O once without waiting and runs what is
ready (tens of microseconds), so the Match goes out and its answer is read on the
scheduler's thread, with no thread in between.

A watchdog thread ticks while a task `spawn`ed here is unfinished and nobody ticked for
`idle_s` (an engine that stopped stepping, a forward longer than that): releases go out,
deadlines fire, a lost session's backoff runs.

Thread-safe: `lock` (reentrant) is held by every pass and guards whatever the loop's tasks
share with callers; `spawn` and `tick` may come from any thread, but not from a task (a
pass cannot run inside a pass). A thread that runs an event loop of its own cannot run
this one: there `tick` leaves the passes to the watchdog, and `run` waits for it.
"""

import asyncio
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future

PASS_ITERATIONS = 3  # loop iterations per tick: an answer read, its task resumed, its callbacks run
WATCHDOG_CHECK_S = 1.0  # an idle watchdog looks this often whether the pump closed


class LoopPump:
    """A private event loop, run in passes by `tick` and by the watchdog (see the module)."""

    def __init__(self, idle_s: float = 0.002):
        self.lock = threading.RLock()
        self._idle_s = idle_s
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task] = set()
        self._last = time.monotonic()  # the last pass began
        self._work = threading.Event()  # a spawned task is unfinished
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="radixkv-pump", daemon=True)
        self._watchdog.start()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Schedule `coro` on the loop; it runs in the next passes (no pass runs here)."""
        with self.lock:
            task = self._loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._finished)
            if not self._work.is_set():
                self._work.set()  # wakes the watchdog (tens of microseconds when it sleeps)
        return task

    def tick(self) -> None:
        """One pass: the loop's I/O polled without waiting, what is ready run."""
        if _loop_running_here():
            return  # the watchdog runs the passes
        with self.lock:
            self._pass()

    def run(self, coro: Coroutine, timeout: float | None = None):
        """Run `coro` to its end and return its result (startup, close): blocks the caller.
        Raises what `coro` raises; TimeoutError after `timeout` seconds (`coro` cancelled)."""
        if _loop_running_here():
            done: Future = Future()
            task = self.spawn(asyncio.wait_for(coro, timeout))
            task.add_done_callback(lambda t: done.set_result(t))
            return done.result().result()
        with self.lock:
            self._last = time.monotonic()
            return self._loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        """Stop the watchdog, cancel what is unfinished, close the loop. Idempotent."""
        if self._closed.is_set():
            return
        with self.lock:  # not between a pass's `_finished` seeing it open and clearing `_work`
            self._closed.set()
            self._work.set()
        self._watchdog.join()
        with self.lock:
            for task in list(self._tasks):
                task.cancel()
            if self._tasks and not _loop_running_here():
                self._loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            self._loop.close()

    def _pass(self) -> None:
        """PASS_ITERATIONS iterations of the loop in one `run_forever` (each costs about
        as much to enter as an iteration): a callback that re-queues itself counts them,
        and its last call stops the loop at the end of that iteration. Being queued, it
        keeps every iteration's I/O poll from waiting."""
        self._last = time.monotonic()
        loop = self._loop

        def count(left: int) -> None:
            if left:
                loop.call_soon(count, left - 1)
            else:
                loop.stop()

        loop.call_soon(count, PASS_ITERATIONS - 1)
        loop.run_forever()

    def _finished(self, task: asyncio.Task) -> None:  # in a pass, under the lock
        self._tasks.discard(task)
        if not self._tasks and not self._closed.is_set():  # a closing pump's watchdog must wake
            self._work.clear()

    def _watch(self) -> None:
        while not self._closed.is_set():
            if not self._work.wait(WATCHDOG_CHECK_S):
                continue  # idle: look again whether the pump closed
            if self._closed.wait(self._idle_s):
                return
            with self.lock:
                if self._tasks and time.monotonic() - self._last >= self._idle_s:
                    self._pass()


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


__all__ = ["LoopPump"]
