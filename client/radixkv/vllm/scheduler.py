"""Lookups that never block vLLM's scheduler, and the scheduler's load and save plans.

vLLM asks `get_num_new_matched_tokens` for each waiting request, possibly several times.
The first ask records the prompt and answers None ("ask again next step"). The next
step's metadata carries the prompt to every worker; each worker's `Lookups` thread sends
its queued prompts in one batched Match on its own daemon session and reports the hit in
a later step's worker metadata; once every tensor-parallel rank has answered, the hit is
the smallest of their answers (a prefix counts only when every rank holds it), and the
next ask gets it. The scheduler itself never calls the daemon.

A worker's hit holds a lease (the daemon keeps the pages) until the load, or until the
scheduler releases it: when vLLM decides not to load it, or the request finishes.
Releases are idempotent and every exit path sends one.
"""

import logging
import threading
from array import array

from .daemon import MISS, DaemonAdapter, Hit
from .metadata import LoadSpec, RadixKVMetadata, RadixKVWorkerMetadata, SaveSpec

log = logging.getLogger("vllm.radixkv")  # vLLM's log handlers show it


class Lookups:
    """A worker's asynchronous, batched Match per request id (one thread)."""

    def __init__(self, adapter: DaemonAdapter):
        self._adapter = adapter
        self._cond = threading.Condition()
        self._queued: dict[str, bytes] = {}
        self._inflight: set[str] = set()  # in the Match being sent now
        self._hits: dict[str, Hit] = {}
        self._dropped: set[str] = set()  # released while its Match was in flight
        self._done: dict[str, int] = {}  # answered since the last `completed()`
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixkv-lookups", daemon=True)
        self._thread.start()

    def poll(self, req_id: str, tokens: bytes) -> Hit | None:
        """The hit for `req_id`, or None while its lookup is queued or in flight (the
        first call queues it)."""
        with self._cond:
            hit = self._hits.get(req_id)
            if hit is None and req_id not in self._queued and req_id not in self._inflight:
                self._queued[req_id] = tokens
                self._cond.notify()
            return hit

    def release(self, req_id: str) -> None:
        """Forget `req_id`'s hit and release its lease (idempotent)."""
        with self._cond:
            hit = self._hits.pop(req_id, None)
            self._queued.pop(req_id, None)
            if req_id in self._inflight:
                self._dropped.add(req_id)  # release its lease when the answer arrives
        if hit is not None and hit.lease:
            self._adapter.release([hit.lease])

    def take(self, req_id: str) -> Hit:
        """Forget `req_id`'s hit without releasing it: the caller now owns its lease."""
        with self._cond:
            return self._hits.pop(req_id, MISS)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)
        with self._cond:
            leases = [h.lease for h in self._hits.values()]
            self._hits.clear()
        self._adapter.release(leases)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch, self._queued = self._queued, {}
                self._inflight = set(batch)
            try:
                hits = self._adapter.lookup(list(batch.values()))
            except Exception:  # never let the thread die: vLLM would wait on None forever
                log.exception("radixkv: lookup failed; %d requests get no hit", len(batch))
                hits = [MISS] * len(batch)
            stale = []
            with self._cond:
                self._inflight = set()
                for req_id, hit in zip(batch, hits):
                    if req_id in self._dropped:
                        self._dropped.discard(req_id)
                        stale.append(hit.lease)
                    else:
                        self._hits[req_id] = hit
                        self._done[req_id] = hit.tokens
            self._adapter.release(stale)

    def completed(self) -> dict[str, int]:
        """Request id -> hit tokens of the lookups answered since the last call."""
        with self._cond:
            done, self._done = self._done, {}
            return done


class SchedulerSide:
    """State of the scheduler-side connector for one engine.

    `saved[req]` counts the tokens of a request radixkv already holds (its hit, then
    every save), so each full block is inserted once, at the end of the step that
    filled it."""

    def __init__(self, block_size: int, tp_size: int, kv_cache_manager_fn):
        self.block_size = block_size
        self.tp_size = tp_size
        self._kv_manager = kv_cache_manager_fn  # () -> vLLM's KVCacheManager (bound late)
        self._requests: dict = {}
        self._computed: dict[str, int] = {}
        self._saved: dict[str, int] = {}
        self._asking: dict[str, bytes] = {}  # lookups for the next step's metadata
        self._waiting: dict[str, dict[int, int]] = {}  # sent: answers per rank so far
        self._hits: dict[str, int] = {}
        self._releases: list[str] = []
        self._loads: list[LoadSpec] = []

    def matched(self, request, num_computed: int) -> tuple[int | None, bool]:
        """get_num_new_matched_tokens: (tokens to load beyond `num_computed`, False), or
        (None, False) while the lookup is on its way. Loads are synchronous: the worker
        finishes them before the forward that reads them."""
        req_id = request.request_id
        self._requests[req_id] = request
        bs = self.block_size
        # vLLM computes at least one token, so only whole blocks before the last token can
        # hit; asking for just those makes the daemon's match end (and split) right there.
        cacheable = (request.num_tokens - 1) // bs * bs
        if cacheable <= num_computed:
            return 0, False
        hit = self._hits.get(req_id)
        if hit is None:
            if req_id not in self._waiting:
                self._asking[req_id] = _packed(request.all_token_ids, cacheable)
            return None, False
        self._computed[req_id] = num_computed
        return max(0, min(hit, cacheable) - num_computed), False

    def allocated(self, request, blocks, num_external: int) -> None:
        """update_state_after_alloc: plan the load into the blocks vLLM allocated."""
        req_id = request.request_id
        if self._hits.pop(req_id, None) is None:
            return
        if num_external <= 0:
            self._saved.setdefault(req_id, 0)
            self._releases.append(req_id)
            return
        bs = self.block_size
        local = self._computed.get(req_id, 0)
        end = local + num_external
        block_ids = tuple(blocks.get_block_ids()[0][:end // bs])
        self._loads.append(LoadSpec(req_id, _packed(request.all_token_ids, end), block_ids, local // bs))
        self._saved[req_id] = end

    def build(self, scheduler_output) -> RadixKVMetadata:
        """build_connector_meta: lookups to start, leases to drop, this step's loads,
        and the full blocks it computes."""
        meta = RadixKVMetadata(lookups=self._asking, releases=self._releases, loads=self._loads)
        for req_id in self._asking:
            self._waiting[req_id] = {}
        self._asking, self._releases, self._loads = {}, [], []
        steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in steps:
            save = self._save_spec(req_id, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
            if save is not None:
                meta.saves.append(save)
        return meta

    def answered(self, meta: RadixKVWorkerMetadata) -> None:
        """update_connector_output: file the workers' answers; a hit is complete once
        every rank answered, and is the least of them."""
        for req_id, ranks in meta.hits.items():
            answers = self._waiting.get(req_id)
            if answers is None:
                continue  # finished meanwhile: its release is already on its way
            answers.update(ranks)
            if len(answers) >= self.tp_size:
                del self._waiting[req_id]
                self._hits[req_id] = min(answers.values())

    def finished(self, request) -> None:
        """request_finished (and aborts): drop every trace, release the workers' leases."""
        req_id = request.request_id
        self._asking.pop(req_id, None)
        if self._waiting.pop(req_id, None) is not None or self._hits.pop(req_id, None) is not None:
            self._releases.append(req_id)
        for table in (self._requests, self._computed, self._saved):
            table.pop(req_id, None)

    def _save_spec(self, req_id: str, end: int) -> SaveSpec | None:
        request = self._requests.get(req_id)
        manager = self._kv_manager()
        if request is None or manager is None:
            return None
        bs = self.block_size
        end = min(end, request.num_tokens) // bs * bs
        if end <= self._saved.get(req_id, 0):
            return None
        block_ids = tuple(manager.get_block_ids(req_id)[0][:end // bs])
        if len(block_ids) * bs < end:
            return None
        self._saved[req_id] = end
        return SaveSpec(req_id, _packed(request.all_token_ids, end), block_ids)


def _packed(tokens, n: int) -> bytes:
    """The first `n` tokens as packed int32 bytes."""
    return array("i", tokens[:n]).tobytes()


__all__ = ["Lookups", "SchedulerSide"]
