"""The connector's own event loop (`radixkv.vllm.pump`): tasks run in the passes the
scheduler's calls make, the watchdog runs them when nobody calls, and a thread that runs
an event loop of its own can still use it."""

import asyncio

from radixkv.vllm.pump import PASS_ITERATIONS, LoopPump
from tests.support.daemon import wait_for


async def answer(value):
    await asyncio.sleep(0)
    return value


def test_a_spawned_task_runs_in_the_callers_pass_not_before():
    pump = LoopPump(idle_s=3600)  # the watchdog stays out of it
    try:
        task = pump.spawn(answer(7))
        assert not task.done()
        pump.tick()
        assert task.result() == 7
    finally:
        pump.close()


async def steps(n: int) -> int:
    """A task that needs `n` loop iterations to finish."""
    for _ in range(n - 1):
        await asyncio.sleep(0)
    return n


def test_a_pass_runs_its_iterations_and_no_more():
    """A pass is PASS_ITERATIONS iterations (an answer read, its task resumed, its
    callbacks run): a task needing that many finishes in one tick, one needing one more
    waits for the next tick."""
    pump = LoopPump(idle_s=3600)
    try:
        enough, more = pump.spawn(steps(PASS_ITERATIONS)), pump.spawn(steps(PASS_ITERATIONS + 1))
        pump.tick()
        assert enough.result() == PASS_ITERATIONS and not more.done()
        pump.tick()
        assert more.result() == PASS_ITERATIONS + 1
    finally:
        pump.close()


def test_the_watchdog_runs_what_nobody_ticks():
    """An engine that stopped stepping: its releases and deadlines still run."""
    pump = LoopPump(idle_s=0.005)
    try:
        task = pump.spawn(asyncio.sleep(0.05, result="slept"))
        assert wait_for(task.done, 10, "the watchdog finishing the task")
        assert task.result() == "slept"
    finally:
        pump.close()


def test_run_returns_the_result_and_raises_the_error():
    pump = LoopPump()
    try:
        assert pump.run(answer("ok")) == "ok"

        async def refuse():
            raise ValueError("refused")

        try:
            pump.run(refuse())
            raise AssertionError("run swallowed the error")
        except ValueError as e:
            assert str(e) == "refused"
    finally:
        pump.close()


def test_a_thread_running_its_own_loop_is_served_by_the_watchdog():
    pump = LoopPump(idle_s=0.005)

    async def caller():
        task = pump.spawn(answer(3))
        pump.tick()  # cannot run a loop inside this one: leaves it to the watchdog
        return pump.run(answer(5)), wait_for(task.done, 10, "the watchdog finishing the task") and task.result()

    try:
        assert asyncio.run(caller()) == (5, 3)
    finally:
        pump.close()


def test_close_cancels_what_is_unfinished():
    pump = LoopPump(idle_s=3600)
    task = pump.spawn(asyncio.sleep(3600))
    pump.tick()
    pump.close()
    assert task.cancelled()



def test_close_while_the_watchdog_ends_the_last_task_returns():
    """close() began while the watchdog ran the pass that finished the last task: that
    pass cleared the watchdog's wake-up after close set it, and close waited forever for
    the watchdog (a CI run hung in SchedulerSide.close)."""
    import threading

    pump = LoopPump(idle_s=0.001)
    inside, release = threading.Event(), threading.Event()

    async def held():
        inside.set()
        release.wait(10)  # holds the watchdog's pass until close has begun

    pump.spawn(held())
    assert inside.wait(10), "the watchdog never ran the task"
    closer = threading.Thread(target=pump.close, daemon=True)
    closer.start()
    wait_for(lambda: _waiting_in_close(closer), 10, "close() waiting for the watchdog's pass")
    release.set()
    closer.join(10)
    assert not closer.is_alive(), "close() never returned"


def _waiting_in_close(thread) -> bool:
    """`thread` is inside LoopPump.close and blocked there: on the pump's lock (the `with`
    line is its innermost frame) or further in, joining the watchdog."""
    import inspect
    import sys

    frame = sys._current_frames().get(thread.ident)
    innermost = frame
    while frame is not None and frame.f_code is not LoopPump.close.__code__:
        frame = frame.f_back
    if frame is None:
        return False
    if innermost is not frame:  # in a call close made: joining the watchdog?
        return innermost.f_code.co_name in ("join", "_wait_for_tstate_lock")
    lines, first = inspect.getsourcelines(LoopPump.close)
    return "with self.lock" in lines[frame.f_lineno - first]
