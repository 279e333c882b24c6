"""The scheduler's own daemon session: lookups that never block vLLM's scheduler.

vLLM asks `get_num_new_matched_tokens` for a waiting request, possibly several times.
The first ask queues its prompt here and answers None ("ask again next step"). At the
end of the scheduler step (`send`, from build_connector_meta) whatever was asked goes
out in one batched Match with leases on the session stream, sent from the scheduler's
thread without waiting for the answer; the stream's reader thread files the answers, so
a later ask gets the hit. That path takes no other thread: under vLLM's busy scheduler
loop, which holds the GIL, every thread hop costs a GIL handover.

This module's thread does what may block: releases, prompts whose Match says storage
holds more (Prefetch, waiting for it, and Match again: `DaemonAdapter.stage`, that first
Match's lease kept meanwhile), and batches that could not go on the stream (the stream's
lock busy, the session lost: the blocking Match recovers it) or whose Match failed there.

A hit holds its lease until the caller takes it over (`take`, for a load whose ranks then
report back) or drops it (`drop`: not loaded, finished, aborted). `drop` is idempotent and
also covers a lookup still queued or in flight (its lease is released when it lands). A
Match on the stream unanswered after the session's timeout gives misses; its late answer's
leases are released.
"""

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from radixkv.errors import RadixKVError

from .daemon import MISS, DaemonAdapter, Hit, hit_of

log = logging.getLogger("vllm.radixkv")  # vLLM's log handlers show it


class _Sent:
    """A batch on the stream: request id -> packed prompt, and when it went out."""

    def __init__(self, batch: dict[str, bytes]):
        self.batch = batch
        self.at = time.monotonic()


class Lookups:
    """Batched, asynchronous Match per request id on the scheduler's session."""

    def __init__(self, adapter: DaemonAdapter):
        self._adapter = adapter
        self._timeout = adapter.config.timeout_s  # a Match on the stream unanswered this long: misses
        self._cond = threading.Condition()
        self._queued: dict[str, bytes] = {}  # asked this step, not sent yet
        self._sent: list[_Sent] = []  # on the stream, unanswered
        self._blocking: dict[str, bytes] = {}  # for the thread's blocking lookup
        self._staging: dict[str, tuple] = {}  # for the thread to stage: (prompt, its MatchResult)
        self._inflight: set[str] = set()  # in a Match now (either way)
        self._hits: dict[str, Hit] = {}
        self._dropped: set[str] = set()  # dropped while its Match was in flight
        self._releases: list[int] = []  # leases to release on the thread
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixkv-lookups", daemon=True)
        self._thread.start()

    def poll(self, req_id: str, tokens: Callable[[], bytes], idle: bool = False) -> Hit | None:
        """The hit for `req_id` (the same one on every call until taken or dropped), or
        None while its lookup is queued or in flight (the first call queues `tokens()`,
        the prompt's packed tokens, called only then; `send` sends it). `idle`: the
        engine runs nothing else, so handing the GIL over delays no one."""
        with self._cond:
            self._expire()
            hit = self._hits.get(req_id)
            in_flight = req_id in self._inflight
            if hit is None and not in_flight and req_id not in self._queued:
                self._queued[req_id] = tokens()
        if hit is None and idle and in_flight:
            # Hand the GIL over: an engine stepping with nothing to run holds it otherwise,
            # and the threads that carry the Match would get it only every switch interval
            # (5 ms). A step with a forward releases it in torch anyway. Not while the
            # lookup is only queued: its Match goes out at the end of this step, and the
            # GIL would go to other work (the last request's releases) for nothing.
            time.sleep(0)
            with self._cond:  # the answer often lands just then, on the stream's reader thread
                hit = self._hits.get(req_id)
        return hit

    def send(self) -> None:
        """End of a scheduler step: what was asked goes out in one Match on the stream
        (never waits), or to the thread when the stream cannot take it now."""
        with self._cond:
            if not self._queued:
                return
            batch, self._queued = self._queued, {}
            self._inflight.update(batch)
        future = self._adapter.start_lookup(list(batch.values()))
        with self._cond:
            if future is None:
                self._to_thread(batch)
                return
            sent = _Sent(batch)
            self._sent.append(sent)
        future.add_done_callback(lambda f: self._landed(sent, f))

    def take(self, req_id: str) -> Hit:
        """Forget `req_id`'s hit without releasing it: the caller now owns its lease
        (`release` it later). MISS when there is none."""
        with self._cond:
            return self._hits.pop(req_id, MISS)

    def drop(self, req_id: str) -> None:
        """Forget `req_id` and release its lease, now or when its Match lands (idempotent)."""
        with self._cond:
            hit = self._hits.pop(req_id, None)
            self._queued.pop(req_id, None)
            if req_id in self._inflight:
                self._dropped.add(req_id)
            if hit is not None and hit.lease:
                self._release(hit.lease)

    def release(self, lease: int) -> None:
        """Release a lease taken over with `take` (on the thread)."""
        if lease:
            with self._cond:
                self._release(lease)

    def close(self) -> None:
        """Stop the thread, release every lease still held, end the session (the daemon
        releases the leases of answers still on their way with it). Idempotent."""
        with self._cond:
            self._closed = True
            self._sent.clear()
            self._cond.notify()
        self._thread.join(timeout=5)
        with self._cond:
            leases = [h.lease for h in self._hits.values()] + self._releases
            leases += [result.lease for _, result in self._staging.values()]
            self._hits.clear()
            self._staging.clear()
            self._releases = []
        self._adapter.release(leases)
        self._adapter.close()

    # -- under the condition -----------------------------------------------------------

    def _landed(self, sent: _Sent, future: Future) -> None:
        """A Match on the stream answered (on the stream's reader thread)."""
        results = future.result()
        with self._cond:
            abandoned = sent not in self._sent
            if not abandoned:
                self._sent.remove(sent)
            if isinstance(results, RadixKVError):
                if not abandoned:
                    log.warning("radixkv: lookup on the session stream failed (%s); trying again", results)
                    self._to_thread(sent.batch)
                return
            for (req_id, tokens), result in zip(sent.batch.items(), results):
                if abandoned:
                    self._release(result.lease)
                elif result.storage_tokens:  # staged to host on the thread, matched again there
                    self._staging[req_id] = (tokens, result)
                    self._cond.notify()
                else:
                    self._file(req_id, hit_of(result))

    def _expire(self) -> None:
        """Matches on the stream unanswered for longer than the timeout give misses."""
        now = time.monotonic()
        for sent in [s for s in self._sent if now - s.at > self._timeout]:
            self._sent.remove(sent)
            log.warning("radixkv: lookup of %d prompts unanswered after %gs, treated as misses",
                        len(sent.batch), self._timeout)
            for req_id in sent.batch:
                self._file(req_id, MISS)

    def _file(self, req_id: str, hit: Hit) -> None:
        self._inflight.discard(req_id)
        if req_id in self._dropped:
            self._dropped.discard(req_id)
            self._release(hit.lease)
        else:
            self._hits[req_id] = hit

    def _to_thread(self, batch: dict[str, bytes]) -> None:
        self._blocking.update(batch)
        self._cond.notify()

    def _release(self, lease: int) -> None:
        if lease:
            self._releases.append(lease)
            self._cond.notify()

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._blocking or self._staging or self._releases or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
                batch, self._blocking = self._blocking, {}
                staging, self._staging = self._staging, {}
                releases, self._releases = self._releases, []
            if releases:
                self._adapter.release(releases)
            if staging:
                prompts = [p for p, _ in staging.values()]
                found = [result for _, result in staging.values()]
                self._run_lookup(list(staging), lambda: self._adapter.stage(prompts, found),
                                 [result.lease for result in found])
            if batch:
                self._run_lookup(list(batch), lambda: self._adapter.lookup(list(batch.values())))

    def _run_lookup(self, req_ids: list[str], lookup: Callable[[], list[Hit]], held: list[int] = ()) -> None:
        """File the hits `lookup()` gives `req_ids`; misses if it raises (`held`: the
        leases it would have released, released then)."""
        try:
            hits = lookup()
        except Exception:  # never let the thread die: vLLM would wait on None forever
            log.exception("radixkv: lookup failed; %d requests get no hit", len(req_ids))
            self._adapter.release(list(held))
            hits = [MISS] * len(req_ids)
        with self._cond:
            for req_id, hit in zip(req_ids, hits):
                self._file(req_id, hit)


__all__ = ["Lookups"]
