"""The scheduler's own daemon session: lookups that never block vLLM's scheduler.

vLLM asks `get_num_new_matched_tokens` for a waiting request, possibly several times.
The first ask queues its prompt here and answers None ("ask again next step"); this
module's one thread sends whatever is queued in one batched Match (with leases, staging
storage hits to host) on the scheduler's session and files the answers, so a later ask
gets the hit. The scheduler thread only takes locks for dictionary updates: every RPC,
releases included, runs on the lookup thread.

A hit holds its lease until the caller takes it over (`take`, for a load whose ranks then
report back) or drops it (`drop`: not loaded, finished, aborted). `drop` is idempotent and
also covers a lookup still queued or in flight (its lease is released when it lands).
"""

import logging
import threading
import time
from collections.abc import Callable

from .daemon import MISS, DaemonAdapter, Hit

log = logging.getLogger("vllm.radixkv")  # vLLM's log handlers show it


class Lookups:
    """Batched, asynchronous Match per request id on the scheduler's session (one thread)."""

    def __init__(self, adapter: DaemonAdapter):
        self._adapter = adapter
        self._cond = threading.Condition()
        self._queued: dict[str, bytes] = {}
        self._inflight: set[str] = set()  # in the Match being sent now
        self._hits: dict[str, Hit] = {}
        self._dropped: set[str] = set()  # dropped while its Match was in flight
        self._releases: list[int] = []  # leases to release on the thread
        self._closed = False
        self.matches = 0  # Match RPCs sent (batches)
        self._thread = threading.Thread(target=self._run, name="radixkv-lookups", daemon=True)
        self._thread.start()

    def poll(self, req_id: str, tokens: Callable[[], bytes], idle: bool = False) -> Hit | None:
        """The hit for `req_id` (the same one on every call until taken or dropped), or
        None while its lookup is queued or in flight (the first call queues `tokens()`,
        the prompt's packed tokens, called only then). `idle`:
        the engine runs nothing else, so handing the GIL to the lookup thread delays no one."""
        with self._cond:
            hit = self._hits.get(req_id)
            if hit is None and req_id not in self._queued and req_id not in self._inflight:
                self._queued[req_id] = tokens()
                self._cond.notify()
        if hit is None and idle:
            # Hand the GIL over: an engine stepping with nothing to run holds it otherwise,
            # and the lookup thread would get it only every switch interval (5 ms), twice
            # per Match (send, answer). A step with a forward releases it in torch anyway.
            time.sleep(0)
        return hit

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
                self._releases.append(hit.lease)
                self._cond.notify()

    def release(self, lease: int) -> None:
        """Release a lease taken over with `take` (on the lookup thread)."""
        if lease:
            with self._cond:
                self._releases.append(lease)
                self._cond.notify()

    def close(self) -> None:
        """Stop the thread, release every lease still held, end the session. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)
        with self._cond:
            leases = [h.lease for h in self._hits.values()] + self._releases
            self._hits.clear()
            self._releases = []
        self._adapter.release(leases)
        self._adapter.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._releases and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch, self._queued = self._queued, {}
                releases, self._releases = self._releases, []
                self._inflight = set(batch)
            if releases:
                self._adapter.release(releases)
            if not batch:
                continue
            self.matches += 1
            try:
                hits = self._adapter.lookup(list(batch.values()))
            except Exception:  # never let the thread die: vLLM would wait on None forever
                log.exception("radixkv: lookup failed; %d requests get no hit", len(batch))
                hits = [MISS] * len(batch)
            with self._cond:
                self._inflight = set()
                for req_id, hit in zip(batch, hits):
                    if req_id in self._dropped:
                        self._dropped.discard(req_id)
                        if hit.lease:
                            self._releases.append(hit.lease)
                    else:
                        self._hits[req_id] = hit


__all__ = ["Lookups"]
