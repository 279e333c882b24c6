"""A worker's loads of radixkv hits into vLLM's blocks, step by step (`WorkerLoads`).

The scheduler plans each load (`LoadSpec`: the request's blocks, the daemon's node, the
lease of its Match); this worker copies it through its daemon session and tells vLLM
what came of it. Per step, in vLLM's order:

- `begin_early(specs)` (handle_preemptions): the loads go out as the step begins, so the
  daemon copies while vLLM prepares the forward;
- `load(specs)` (start_load_kv): each load is waited for (answered; begun now if it was not
  early). On shared memory the answer comes once copied. On CUDA (`queued`) it comes once
  the copy is enqueued, with one event per layer that vLLM's stream waits on (layer by
  layer through `LayerWaits`), so the forward starts while the copy runs;
- `forward_queued(specs)` (after the forward, first of wait_for_save and
  get_block_ids_with_load_errors): loads whose events some layer never waited for, and
  queued loads whose copy turned out to have failed (`DaemonAdapter.settle_loads`), count
  as failed: their blocks are load errors (vLLM recomputes them) and their requests save
  nothing more (`short`: under vLLM's asynchronous scheduling the next step, planned
  before vLLM learns of the failure, computed on from those blocks too) until they finish
  (`forget`);
- `take_errors`, `take_loaded` (the worker's report to the scheduler: its leases go);
- `take_waits` (vLLM's metrics): per load, the seconds `load` waited for its answer (from
  its start when not begun early), the time the forward was held back for it.

With `async_loads` the loads are vLLM's asynchronous receives instead: begun in
`load`, reported over by `received` (get_finished) and failed by `take_failed_receiving`;
their wait is from the start to the `received` that finds the answer.

A load answered too late (timeout_s) fills no block and keeps the request's blocks held
(`Saves.hold`) until the daemon answers; so does a queued load whose acknowledgement does
not come in time (`Saves.hold_transfer`). Tests drive it with a real daemon and no vLLM engine.
"""

import logging
import time

from .daemon import DaemonAdapter, PendingLoad
from .layer_waits import LayerWaits
from .metadata import LoadSpec
from .saves import Saves

log = logging.getLogger("vllm.radixkv")


class WorkerLoads:
    """One worker's loads. `queued`: answered once enqueued and settled after the forward
    (CUDA); else answered once copied. Used from vLLM's worker thread only."""

    def __init__(self, adapter: DaemonAdapter, saves: Saves, layers: LayerWaits | None, *,
                 queued: bool = False, async_loads: bool = False):
        self._adapter = adapter
        self._saves = saves
        self._layers = layers
        self.queued = queued
        self.async_loads = async_loads
        self._early: dict[str, PendingLoad] = {}  # begun in begin_early, by request
        self._unsettled: dict[str, int] = {}  # queued loads of this step: transfer
        self._errors: set[int] = set()  # blocks that failed to load, for vLLM
        self._short: set[str] = set()  # requests a load of theirs left blocks unfilled, until they finish
        self._loaded: dict[str, int] = {}  # loads over since the last report: pages
        self._receiving: dict[str, tuple[LoadSpec, PendingLoad]] = {}  # async loads in flight
        self._recv_done: set[str] = set()  # async loads over, for get_finished
        self._recv_failed: set[str] = set()
        self._started: dict[str, float] = {}  # async loads in flight: when begun
        self._waits: list[float] = []  # per load over: seconds waited for its answer, since take_waits

    # -- a step ---------------------------------------------------------------------------

    def begin_early(self, specs: list[LoadSpec]) -> None:
        """Send this step's loads now (not with `async_loads`: those start in `load`)."""
        if self.async_loads:
            return
        for spec in specs:
            self._early[spec.req_id] = self._begin(spec)

    def load(self, specs: list[LoadSpec]) -> None:
        """Before the forward: wait for each load's answer (begin it first unless early).
        Loads begun early for a step that never came here are waited for too, so that none
        is left writing blocks unobserved."""
        for spec in specs:
            if self.async_loads:  # answered in `received`, once the daemon copied
                # Not held like a save: vLLM keeps the blocks of a request aborted while it
                # waits for its receive until `received` lists it, and frees them then.
                self._started[spec.req_id] = time.perf_counter()
                pending = self._adapter.begin_load(spec.node, spec.block_ids, spec.local_blocks, spec.lease)
                self._receiving[spec.req_id] = (spec, pending)
                continue
            start = time.perf_counter()
            pending = self._early.pop(spec.req_id, None) or self._begin(spec)
            got = self._finish(spec.req_id, pending, self._layers)
            self._waits.append(time.perf_counter() - start)
            self._over(spec, got)
        for req_id, pending in self._early.items():
            self._finish(req_id, pending)
        self._early.clear()

    def layer_begins(self, name: str) -> None:
        """vLLM's attention layer `name` is about to read its KV (CUDA: wait for its events)."""
        if self._layers is not None:
            self._layers.layer_begins(name)

    def forward_queued(self, specs: list[LoadSpec]) -> None:
        """After the forward: fail the loads some layer did not wait for and the queued
        loads whose copy failed (settled now, while the GPU runs the forward). Idempotent
        until the next step."""
        early = self._layers.step_over() if self._layers is not None else set()
        if early:
            log.warning("radixkv: vLLM's forward did not wait for every layer of %d load(s): they count as failed "
                        "(recomputed) and loads wait for all layers before the forward from now on", len(early))
        bad = early | self._settle()
        for spec in specs:
            if spec.req_id in bad:
                self._over(spec, 0)

    # -- what vLLM is told ------------------------------------------------------------------

    @property
    def short(self) -> set[str]:
        """Requests a load of theirs left blocks unfilled: their forward read those blocks,
        and so may the step after it (planned before vLLM learned of the failure), so
        they save nothing more (vLLM recomputes them)."""
        return self._short

    def forget(self, finished_req_ids) -> None:
        """vLLM finished these requests (get_finished)."""
        if self._short:
            self._short.difference_update(finished_req_ids)

    def take_errors(self) -> set[int]:
        """Blocks that failed to load since the last call (get_block_ids_with_load_errors)."""
        errors, self._errors = self._errors, set()
        return errors

    def take_loaded(self) -> dict[str, int]:
        """Loads over since the last call: request -> blocks filled (the worker's report)."""
        loaded, self._loaded = self._loaded, {}
        return loaded

    def take_waits(self) -> list[float]:
        """Per load over since the last call: the seconds waited for its answer."""
        waits, self._waits = self._waits, []
        return waits

    def received(self) -> set[str]:
        """Asynchronous loads over since the last call, failed or not (never waits)."""
        answered = self._answered()
        if self._receiving and not answered:
            # Hand the GIL over: vLLM's loop, stepping while these requests wait, holds it,
            # and the stream's reader thread that carries the answers would get it only
            # every switch interval (5 ms).
            time.sleep(0)
            answered = self._answered()
        for req_id in answered:
            spec, pending = self._receiving.pop(req_id)
            self._over(spec, self._adapter.finish_load(pending))  # does not wait: answered
            self._waits.append(time.perf_counter() - self._started.pop(req_id))
        done, self._recv_done = self._recv_done, set()
        return done

    def take_failed_receiving(self, finished: set[str]) -> set[str]:
        """Of `finished` receives, those whose load failed (each once)."""
        failed, self._recv_failed = self._recv_failed & finished, set()
        return failed

    # -- internals --------------------------------------------------------------------------

    def _begin(self, spec: LoadSpec) -> PendingLoad:
        return self._adapter.begin_load(spec.node, spec.block_ids, spec.local_blocks, spec.lease,
                                        queued=self.queued)

    def _finish(self, req_id: str, pending: PendingLoad, layers: LayerWaits | None = None) -> int:
        """Wait for a begun load's answer: the blocks it filled. One answered too late fills
        none and holds the request's blocks until the daemon answers. With `layers`, its
        CUDA events are waited layer by layer in the forward. A queued one is settled after
        the forward."""
        on_events = None if layers is None else (lambda events: layers.loaded(req_id, events))
        got = self._adapter.finish_load(pending, on_events)
        if pending.late:
            self._saves.hold(req_id, pending.answer)
        if pending.transfer:
            self._unsettled[req_id] = pending.transfer
        return got

    def _settle(self) -> set[str]:
        """The step's queued loads, acknowledged and waited for: the requests whose load
        failed. One unanswered keeps its blocks held until the daemon answers."""
        if not self._unsettled:
            return set()
        unsettled, self._unsettled = self._unsettled, {}
        failed, unanswered = self._adapter.settle_loads(unsettled.values())
        for req_id, transfer in unsettled.items():
            if transfer in unanswered:
                self._saves.hold_transfer(req_id, transfer)
        return {req_id for req_id, transfer in unsettled.items() if transfer in failed}

    def _over(self, spec: LoadSpec, got: int) -> None:
        """A load filled the first `got` of its blocks: report it, fail the rest."""
        self._loaded[spec.req_id] = got
        failed = spec.load_blocks[got:]
        if failed:
            self._errors.update(failed)
            self._short.add(spec.req_id)
        if self.async_loads:
            self._recv_done.add(spec.req_id)
            if failed:
                self._recv_failed.add(spec.req_id)

    def _answered(self) -> list[str]:
        """Requests whose asynchronous load `finish_load` would not wait for (answered, or never sent)."""
        return [r for r, (_, pending) in self._receiving.items() if not pending.late]


__all__ = ["WorkerLoads"]
