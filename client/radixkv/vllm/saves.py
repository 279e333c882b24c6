"""A worker's asynchronous saves, and when vLLM may free a finished request's blocks.

`start` only queues a save: this module's one thread sends the Inserts, in order, so
vLLM's step does not wait for the daemon's answer (about one RPC per step that filled a
block, on the path to the request's first token). The thread sends them once the next
step begins (`step_began`) or DEFER_S after they were queued, whichever is first: the
step that queued them is about to sample and hand its tokens over, and an Insert built
and sent meanwhile competes with it for the GIL and the cores (0.3 ms of a 2k-token
hit's time to first token here). The daemon then copies vLLM's blocks
in its copy threads; vLLM must not reuse those blocks until it acknowledged the copy. A
save is in flight from `start` until its ack (or until its Insert copied nothing).

The worker reports, per request, how many of its planned saves are over (`report`, in
the worker metadata); the scheduler answers `request_finished` with True while a save of
the request is not over on every rank, and names such requests in the next step's
metadata (`delayed`). This worker then lists a delayed request in `finished` (vLLM's
`get_finished` finished_sending) once none of its saves is in flight. `flush` waits for
the saves of preempted requests, whose blocks vLLM frees at once: for as long as the
daemon takes (it may still read those blocks), saying so in a warning every timeout_s.

A load the worker stopped waiting for (no answer within timeout_s: vLLM recomputes its
blocks) is held the same way (`hold`): the daemon may still write those blocks until it
answers, so they count as in flight on this rank until then. So is a save whose Insert
got no answer in time: the daemon may still take it and read the blocks, so it stays in
flight until the answer comes and, if the answer names a copy, until that is acknowledged. The worker reports such
loads (`report`, held) and the scheduler counts them with the request's saves.
"""

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import NamedTuple

from radixkv.types import InsertResult

from .daemon import DaemonAdapter
from .metadata import SaveSpec

log = logging.getLogger("vllm.radixkv")

FINISHED_KEPT = 1 << 16  # finished ids remembered (vLLM names a request's delay and finish in one step)
CLOSE_TIMEOUT_S = 30.0  # how long `close` lets queued Inserts go out
LATE_FLUSH_TIMEOUT_S = 60.0  # how long `flush` waits for a held load's answer
DEFER_S = 0.002  # the longest a queued save waits for the next step to begin


class Late(NamedTuple):
    """A held load's or late save's answer still to come, for `req_id`'s blocks."""

    req_id: str
    answer: Future
    save: bool  # a save (waited for without limit), else a held load


class Saves:
    """Saves in flight per request. Methods are called from vLLM's worker thread; the
    sender thread shares the state under one condition."""

    def __init__(self, adapter: DaemonAdapter):
        self._adapter = adapter
        self._cond = threading.Condition()
        self._tickets = itertools.count(1)
        self._queue: deque[tuple[int, SaveSpec, object]] = deque()  # not sent yet
        self._pending: dict[str, set[int]] = {}  # request -> its saves in flight (tickets)
        self._unsent: set[int] = set()  # tickets queued or being sent
        self._transfers: dict[int, tuple[int, str]] = {}  # transfer in flight -> (ticket, request)
        self._over: dict[str, int] = {}  # request -> saves over since the last report
        self._finished: dict[str, None] = {}  # vLLM reported them finished (the latest ones)
        self._delayed: set[str] = set()  # blocks kept until we list them; vLLM has not said finished yet
        self._waiting: set[str] = set()  # delayed and finished: listed once no save of theirs is in flight
        self._late: dict[int, Late] = {}  # held load's or late save's ticket -> its answer to come
        self._held: dict[str, int] = {}  # request -> loads held since the last report
        self._closed = False
        self._step_began = False  # a step began since the queue was last emptied: send now
        self.defer_s = DEFER_S  # (tests and the bench change it)
        self._thread = threading.Thread(target=self._send, name="radixkv-saves", daemon=True)
        self._thread.start()

    def start(self, spec: SaveSpec) -> None:
        """Queue the Insert of `spec`'s blocks (in flight from now on). The CUDA event that
        orders the daemon's copy after the forward is recorded here, on vLLM's stream."""
        event = self._adapter.step_event()
        with self._cond:
            ticket = self._new_ticket(spec.req_id)
            self._unsent.add(ticket)
            self._queue.append((ticket, spec, event))
            self._cond.notify_all()

    def step_began(self) -> None:
        """vLLM began a step: what is queued goes out now."""
        if self._queue:  # the common case, every step: no lock taken
            with self._cond:
                self._send_queued()

    def _send_queued(self) -> None:
        """What is queued goes out without waiting for a step (under the condition). Set
        only while something is queued: the sender clears it once the queue is empty."""
        if self._queue:
            self._step_began = True
            self._cond.notify_all()

    def hold(self, req_id: str, answer: Future) -> None:
        """A load into `req_id`'s blocks whose `answer` is still to come: in flight (its
        blocks kept, a flush waits for it) until the answer completes, however it does."""
        with self._cond:
            self._late[self._new_ticket(req_id, held=True)] = Late(req_id, answer, save=False)

    def hold_transfer(self, req_id: str, transfer: int) -> None:
        """A load into `req_id`'s blocks whose acknowledgement did not come in time
        (`DaemonAdapter.settle_loads`): in flight, like a save, until the daemon
        acknowledges `transfer` (`poll`, `flush`)."""
        with self._cond:
            self._transfers[transfer] = (self._new_ticket(req_id, held=True), req_id)

    def skip(self, req_id: str) -> None:
        """A save planned for `req_id` and not started: over."""
        with self._cond:
            self._count_over(req_id)

    def flush(self, req_ids) -> None:
        """Wait until no save of `req_ids` is in flight (their blocks are about to be reused)."""
        with self._cond:
            tickets = set().union(*(self._pending.get(r, ()) for r in req_ids))
            self._send_queued()  # vLLM waits for these: no waiting for a step
            self._cond.wait_for(lambda: not (tickets & self._unsent))
            late = [entry for t, entry in self._late.items() if t in tickets]
        if late:
            self._wait_late_saves([entry.answer for entry in late if entry.save])
            loads = [entry.answer for entry in late if not entry.save]
            if loads and wait_futures(loads, LATE_FLUSH_TIMEOUT_S).not_done:
                log.error("radixkv: %d loads into blocks vLLM reuses now are still unanswered after %gs",
                          len(loads), LATE_FLUSH_TIMEOUT_S)
            self._settle_late()
        with self._cond:  # a late save's answer may have named a copy just now
            ids = [t for t, (ticket, _) in self._transfers.items() if ticket in tickets]
        if ids:
            self._landed(self._acknowledged(ids))

    def _wait_late_saves(self, answers: list[Future]) -> None:
        """Wait for the daemon's answers to saves it left unanswered, without giving up
        (the daemon may still take them and read the blocks vLLM reuses next, which
        would store other bytes under the prompt), with a warning each timeout_s."""
        timeout, waited = self._adapter.config.timeout_s, 0.0
        while answers and (answers := list(wait_futures(answers, timeout).not_done)):
            waited += timeout
            log.warning("radixkv: vLLM waits to reuse the blocks of preempted requests: %d of their saves "
                        "are unanswered after %gs (the daemon may still read them)", len(answers), waited)

    def _acknowledged(self, ids: list[int]) -> set[int]:
        """Wait until the daemon acknowledged every save of `ids` (their blocks are reused
        next, and the daemon may still read them: no giving up), with a warning each
        timeout_s it has not. An error that ends the wait early ends this one too."""
        timeout = self._adapter.config.timeout_s
        done: set[int] = set()
        waited = 0.0
        while True:
            began = time.monotonic()
            done |= self._adapter.done([t for t in ids if t not in done], timeout=timeout)
            if len(done) >= len(ids) or time.monotonic() - began < timeout:
                return done
            waited += timeout
            log.warning("radixkv: vLLM waits to reuse the blocks of preempted requests: %d of their saves "
                        "are unacknowledged after %gs (the daemon may still read them)", len(ids) - len(done), waited)

    def finished(self, finished_req_ids, delayed, unstarted=()) -> set[str]:
        """The `delayed` requests (now or before) that vLLM reported finished (now or
        before) with no save in flight, nor one of `unstarted` (saves of this step not
        started yet): vLLM frees their blocks. Each is returned once. A request both
        delayed and finished waits here however many others finish meanwhile."""
        self._finished.update(dict.fromkeys(finished_req_ids))
        self._delayed.update(delayed)
        both = [r for r in self._delayed if r in self._finished]
        for r in both:
            del self._finished[r]
        self._delayed.difference_update(both)
        self._waiting.update(both)
        while len(self._finished) > FINISHED_KEPT:  # finished and never delayed: most requests
            del self._finished[next(iter(self._finished))]
        self.poll()
        with self._cond:
            ready = {r for r in self._waiting if not self._pending.get(r) and r not in unstarted}
        self._waiting -= ready
        return ready

    def poll(self) -> None:
        """Take the acks and held loads' answers that arrived (never blocks)."""
        with self._cond:
            ids = list(self._transfers)
        if ids:
            self._landed(self._adapter.done(ids))
        self._settle_late()

    def report(self) -> tuple[dict[str, int], dict[str, int]]:
        """(request -> saves and held loads over, request -> loads held), since the last report."""
        with self._cond:
            over, self._over = self._over, {}
            held, self._held = self._held, {}
        return over, held

    def close(self) -> None:
        """Send what is queued (for up to CLOSE_TIMEOUT_S), then stop the thread. Idempotent."""
        with self._cond:
            self._send_queued()
            self._cond.wait_for(lambda: not self._unsent, timeout=CLOSE_TIMEOUT_S)
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=CLOSE_TIMEOUT_S)

    def _send(self) -> None:
        """The sender thread: one Insert at a time, in the order they were started."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                self._cond.wait_for(lambda: self._step_began or self._closed, timeout=self.defer_s)
                ticket, spec, event = self._queue.popleft()
                if not self._queue:
                    self._step_began = False
            late = None
            try:
                transfer = self._adapter.save(spec.tokens, spec.block_ids, event, spec.extra_key)
                if isinstance(transfer, Future):  # no answer in time: held until it comes
                    late, transfer = transfer, 0
                # Its ack goes out now (the daemon answers it once copied): the transfer
                # ends in the daemon even when vLLM stops stepping before the next poll.
                done = self._adapter.done([transfer]) if transfer else set()
            except Exception:  # never let the thread die: the blocks would be kept forever
                log.exception("radixkv: save of %d blocks failed", len(spec.block_ids))
                transfer, done = 0, set()
            with self._cond:
                self._unsent.discard(ticket)
                if late is not None:
                    self._late[ticket] = Late(spec.req_id, late, save=True)
                elif transfer and transfer not in done:
                    self._transfers[transfer] = (ticket, spec.req_id)
                else:
                    self._ticket_over(ticket, spec.req_id)
                self._cond.notify_all()

    def _settle_late(self) -> None:
        """Held loads whose answer came are over. On CUDA an answer can precede the copy
        (its layer events mark the end): vLLM's stream then waits for those first. A late
        save's answer that names a copy is in flight until that is acknowledged."""
        if not self._late:  # the common case, every step: no lock taken
            return
        with self._cond:
            tickets = [t for t, entry in self._late.items() if entry.answer.done()]
            answered = [(t, *self._late.pop(t)[:2]) for t in tickets]
        for ticket, req_id, answer in answered:
            result = answer.result()
            if isinstance(result, InsertResult) and result.transfer:
                done = self._adapter.done([result.transfer])  # its ack goes out now
                if result.transfer not in done:
                    with self._cond:
                        self._transfers[result.transfer] = (ticket, req_id)
                    continue
            self._adapter.wait_loaded(getattr(result, "layer_events", ()))
            with self._cond:
                self._ticket_over(ticket, req_id)

    def _landed(self, done: set[int]) -> None:
        with self._cond:
            for t in done:
                entry = self._transfers.pop(t, None)
                if entry is not None:
                    self._ticket_over(*entry)

    def _new_ticket(self, req_id: str, held: bool = False) -> int:
        """A save (or, `held`, a load held like one) of `req_id` in flight from now on
        (under the condition)."""
        ticket = next(self._tickets)
        self._pending.setdefault(req_id, set()).add(ticket)
        if held:
            self._held[req_id] = self._held.get(req_id, 0) + 1
        return ticket

    def _ticket_over(self, ticket: int, req_id: str) -> None:
        pending = self._pending.get(req_id)
        if pending is not None:
            pending.discard(ticket)
            if not pending:
                del self._pending[req_id]
        self._count_over(req_id)

    def _count_over(self, req_id: str) -> None:
        self._over[req_id] = self._over.get(req_id, 0) + 1


__all__ = ["Saves"]
