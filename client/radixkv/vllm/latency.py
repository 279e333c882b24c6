"""The scheduler's own time inside the connector, per scheduler step, for vLLM's metrics
(`vllm:radixkv_scheduler_step_seconds`, `radixkv.vllm.stats`).

vLLM's scheduler thread runs the connector's scheduler-side calls inline: whatever they
take, every request of the engine waits for. Each call `timed` adds its seconds to the
step's (a perf_counter pair, no lock: the scheduler's thread alone); a step closes with
build_connector_meta, the last call of vLLM's `schedule()`, as bench/vllm.py's
scheduler_blocked counts it (the next step's sum then holds update_connector_output and
request_finished of this one's output).
"""

import functools
from time import perf_counter


class StepClock:
    """Seconds spent in `timed` calls, summed per step (`step_over`), taken by vLLM's
    stats collection (`take`)."""

    def __init__(self):
        self.spent = 0.0  # this step so far
        self._steps: list[float] = []

    def step_over(self) -> None:
        self._steps.append(self.spent)
        self.spent = 0.0

    def take(self) -> list[float]:
        """Every step's seconds since the last call."""
        steps, self._steps = self._steps, []
        return steps


def timed(method):
    """A scheduler-side method of the connector whose time counts toward the step's (its
    object's `clock`, a StepClock)."""
    return _timing(method, ends_step=False)


def ends_step(method):
    """`timed`, and the step is over once it returns (build_connector_meta)."""
    return _timing(method, ends_step=True)


def _timing(method, ends_step: bool):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        start = perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            clock = self.clock
            clock.spent += perf_counter() - start
            if ends_step:
                clock.step_over()

    return run


__all__ = ["StepClock", "ends_step", "timed"]
