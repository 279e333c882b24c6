"""Plans: how a client operation is written once for both shells.

An operation of `radixkv.session.Session` is a generator (a `Plan`) that yields the I/O it
needs, `Rpc` (a call to make) or `Sleep`, and gets each step's answer sent back in (or the
failed call's `RadixKVError` thrown in). `PlanRun` steps through one plan for a shell:
the blocking `Client` performs each step on its thread, `AsyncClient` awaits it.
"""

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import RadixKVError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Rpc:
    """A call for the shell to make: `method` of the RadixKV stub (of the health stub
    when `health`) with `request` and a deadline of `timeout` seconds. Its answer is the
    response message; for a server-streaming call (`stream`), the list of messages. With
    `on_stream`, the shell sends it as a message on the session stream instead."""

    method: str
    request: Any
    timeout: float | None
    health: bool = False
    stream: bool = False
    wait_for_ready: bool | None = None
    on_stream: bool = False  # send it on the session stream (`Session.calls()`), not as a unary call


@dataclass(frozen=True, slots=True)
class Sleep:
    """A pause of `seconds` for the shell to take (answer: None)."""

    seconds: float


Step = Rpc | Sleep
Plan = Generator[Step, Any, T]


class PlanRun:
    """Steps through one plan for a shell: `next()` gives the step to perform (None once
    the plan returned, its value in `result`); the shell then calls `answer` with what
    the step gave, or `fail` with the error it raised. Errors the plan raises propagate
    out of `next()`."""

    def __init__(self, plan: Plan):
        self._plan = plan
        self._answer: Any = None
        self._error: RadixKVError | None = None
        self.result: Any = None

    def next(self) -> Step | None:
        answer, error = self._answer, self._error
        self._answer = self._error = None
        try:
            return self._plan.throw(error) if error is not None else self._plan.send(answer)
        except StopIteration as done:
            self.result = done.value
            return None

    def close(self) -> None:
        """End the plan (its cleanup runs now, not when it is collected): call once the
        shell stops stepping it, however it stops."""
        self._plan.close()

    def answer(self, value: Any) -> None:
        self._answer = value

    def fail(self, error: RadixKVError) -> None:
        self._error = error


__all__ = ["Plan", "PlanRun", "Rpc", "Sleep", "Step"]
