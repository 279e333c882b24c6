"""The scheduler side of the connector: answers vLLM without waiting on the daemon, and
plans every step's loads and saves.

Lookups run on the scheduler's own daemon session (`radixkv.vllm.lookups`): the first ask
for a request answers None, the step's asks go out in one Match at its end (`build`) and
the next asks get the hit once that Match landed. A hit
holds a lease on the scheduler's session; a load hands it to the workers with the node
to load from, and the lease is released once every tensor-parallel rank reported that
load (worker metadata), or at once when vLLM decides not to load, or when the request
finishes or is aborted before loading. Releases are idempotent.

Saves are asynchronous: a worker starts an Insert after the step that filled the blocks
and vLLM must not reuse those blocks until the daemon's copy is done. Workers report the
saves that are over; a request with a save not over on every rank answers
`request_finished` with True and is named in the next step's `delayed` (its blocks are
freed when every worker lists it in `get_finished`), and a request preempted with saves
in flight is named in the next step's `flush`, which the workers wait for before the
forward. A load a worker stopped waiting for counts as one more save on that rank
(`Saves.hold`): the daemon may write its blocks until it answers.

A cache reset (`reset`, vLLM's `reset_prefix_cache(reset_connector=True)`, which RL
frameworks call after updating the weights) starts a new epoch: every key from then on
carries a fresh random epoch, so nothing saved before is matched again by this engine,
and requests known before the reset neither look up nor save again (their KV may be the
old weights'). Other engines keep sharing what they saved.

For vLLM's metrics (`radixkv.vllm.stats`) this side counts loads, blocks loaded and
recomputed, and blocks handed over to save (`take_counts`, with the lookups' counts),
and tells which tier a load's tokens came from (`hit_sources`).
"""

import os
from collections import Counter

from radixkv.types import Prompt, pack

from .lookups import Lookups
from .metadata import LoadSpec, RadixKVMetadata, RadixKVWorkerMetadata, SaveSpec
from .request_keys import cacheable, prompt_key
from .stats import CacheHitSource, hit_source


class SchedulerSide:
    """State of the scheduler-side connector for one engine.

    `saved[req]` counts the tokens of a request radixkv already holds (its hit, then
    every save), so each full block is inserted once, at the end of the step that
    filled it. `lookups` is None without a daemon session or loads (every lookup a
    miss); `saves` False saves nothing (vLLM's kv_role "kv_consumer"). A request that
    skips reading prefix caches (`skip_reading_prefix_cache`) is not looked up."""

    def __init__(self, block_size: int, tp_size: int, lookups: Lookups | None, kv_cache_manager_fn,
                 async_loads: bool = False, saves: bool = True):
        self.block_size = block_size
        self.async_loads = async_loads
        self.saves = saves
        self.tp_size = tp_size
        self.lookups = lookups
        self._kv_manager = kv_cache_manager_fn  # () -> vLLM's KVCacheManager (bound late)
        self._requests: dict = {}
        # request -> its prompt's key (lookup and saves share it), with the prompt length and
        # number of multimodal inputs it was made for (`_key`)
        self._prompts: dict[str, tuple[tuple[int, int], Prompt]] = {}
        self._computed: dict[str, int] = {}
        self._saved: dict[str, int] = {}
        self._issued: dict[str, int] = {}  # request -> saves planned
        self._over: dict[str, dict[int, int]] = {}  # request -> rank -> saves over
        self._held: dict[str, dict[int, int]] = {}  # request -> rank -> loads held (counted as saves)
        self._delayed: list[str] = []  # finished with saves in flight, for the next step
        self._freeing: set[str] = set()  # finished with blocks kept until every worker reports their saves
        self._last_saves: list[SaveSpec] = []  # finished requests' last blocks, for the next step
        self._loads: list[LoadSpec] = []
        # Loads not reported by every rank yet: lease, ranks reported, pages, the blocks it fills.
        self._loading: dict[str, tuple[int, dict[int, int], int, tuple[int, ...]]] = {}
        self._held_last: dict[str, tuple[SaveSpec, int]] = {}  # finished: last save, tokens saved before
        self._short: set[str] = set()  # a load of theirs came back short: no more hits for them
        self._stale: set[str] = set()  # known before the last reset: no more lookups or saves
        self._epoch = b""  # the cache epoch (`reset`): part of every key
        self._sources: dict[str, tuple[int, int]] = {}  # request -> (host, storage) tokens of its load
        self._counts: Counter = Counter()

    def matched(self, request, num_computed: int) -> tuple[int | None, bool]:
        """get_num_new_matched_tokens: (tokens to load beyond `num_computed`, async), or
        (None, False) while the lookup is on its way. Synchronous loads finish before the
        forward that reads them; with `async_loads` vLLM parks the request until every
        worker reported the load in `get_finished`."""
        req_id = request.request_id
        self._requests[req_id] = request
        bs = self.block_size
        # vLLM computes at least one token, so only whole blocks before the last token can
        # hit; asking for just those makes the daemon's match end (and split) right there.
        whole = (request.num_tokens - 1) // bs * bs
        if (whole <= num_computed or self.lookups is None or req_id in self._short or req_id in self._stale
                or not cacheable(request) or getattr(request, "skip_reading_prefix_cache", False)):
            return 0, False
        hit = self.lookups.poll(req_id, lambda: self._key(request, whole))
        if hit is None:
            return None, False
        self._computed[req_id] = num_computed
        n = max(0, min(hit.tokens, whole) // bs * bs - num_computed)
        return n, self.async_loads and n > 0

    def allocated(self, request, blocks, num_external: int) -> None:
        """update_state_after_alloc: plan the load into the blocks vLLM allocated, or
        release the lookup's lease when vLLM loads nothing."""
        req_id = request.request_id
        if self.lookups is None:
            return
        hit = self.lookups.take(req_id)
        if num_external <= 0 or not hit.lease:
            self.lookups.release(hit.lease)
            self._saved.setdefault(req_id, 0)
            return
        bs = self.block_size
        local = self._computed.get(req_id, 0)
        end = local + num_external
        stored = max(0, end - max(local, hit.tokens - hit.stored))
        self._sources[req_id] = (num_external - stored, stored)
        block_ids = tuple(blocks.get_block_ids()[0][:end // bs])
        self._loads.append(LoadSpec(req_id, block_ids, local // bs, hit.node, hit.lease))
        self._loading[req_id] = (hit.lease, {}, len(block_ids) - local // bs, block_ids[local // bs:])
        self._saved[req_id] = end

    def build(self, scheduler_output) -> RadixKVMetadata:
        """build_connector_meta: saves to finish before the forward (preempted requests),
        this step's loads, and the full blocks it computes."""
        if self.lookups is not None:
            self.lookups.send()  # this step's asks, in one Match
        flush = [r for r in (scheduler_output.preempted_req_ids or ()) if self._saving(r)]
        # vLLM zeroes new blocks (and copies blocks) early in the worker's step: a load
        # started before that could be overwritten, so such a step loads later.
        early = not (scheduler_output.new_block_ids_to_zero or scheduler_output.kv_cache_block_copies)
        meta = RadixKVMetadata(flush=flush, delayed=self._delayed, loads=self._loads, early_loads=early,
                               saves=self._last_saves)
        self._loads, self._delayed, self._last_saves = [], [], []
        steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens))
        pending = self._unreported_blocks()
        for req_id, computed in steps:
            if not (pending and self._holds_any(req_id, pending)):  # else planned once reported
                self._plan_save(req_id, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0), meta.saves)
        return meta

    def _unreported_blocks(self) -> set[int]:
        """The blocks of synchronous loads not every rank reported yet. A step's forward
        computes over them, and so does another request holding them as its prefix hit
        (vLLM caches a loading request's blocks at once). With tensor parallelism a rank
        whose load failed spoils the KV every rank computes over it (the layers mix the
        ranks' heads), and a rank learns only of its own loads: so what was computed over
        these blocks is saved only once every rank reported them loaded."""
        if self.async_loads or not self._loading:
            return set()
        return set().union(*(blocks for *_, blocks in self._loading.values()))

    def _holds_any(self, req_id: str, blocks: set[int]) -> bool:
        manager = self._kv_manager()
        return manager is not None and not blocks.isdisjoint(manager.get_block_ids(req_id)[0])

    def answered(self, meta: RadixKVWorkerMetadata) -> None:
        """update_connector_output: count the saves (and held loads) begun and over; a
        load's lease is released once every rank reported it."""
        for req_id, ranks in meta.held.items():
            if req_id in self._requests:
                _add(self._held.setdefault(req_id, {}), ranks)
        for req_id, ranks in meta.saved.items():
            if req_id in self._issued or req_id in self._held:
                _add(self._over.setdefault(req_id, {}), ranks)
        for req_id, ranks in meta.loaded.items():
            entry = self._loading.get(req_id)
            if entry is None:
                continue
            entry[1].update(ranks)
            if len(entry[1]) >= self.tp_size:
                del self._loading[req_id]
                self.lookups.release(entry[0])
                loaded = min(min(entry[1].values()), entry[2])
                self._counts.update(loads=1, loaded_blocks=loaded, failed_blocks=entry[2] - loaded)
                if loaded < entry[2]:
                    if req_id in self._requests:
                        self._short.add(req_id)  # vLLM recomputes (an async one asks again)
                    self._spoiled(set(entry[3][loaded:]))
        if self._held_last:
            self._release_held()

    def _spoiled(self, blocks: set[int]) -> None:
        """A load left `blocks` unfilled on some rank: every request holding one computed
        over them (on every rank), so it saves nothing more (vLLM recomputes it)."""
        for req_id in self._requests:
            if self._holds_any(req_id, blocks):
                self._short.add(req_id)
        for req_id, (spec, _) in list(self._held_last.items()):
            if not blocks.isdisjoint(spec.block_ids):
                del self._held_last[req_id]
                self._delayed.append(req_id)

    def _release_held(self) -> None:
        """Finished requests' last saves whose blocks every rank reported loaded: out with
        the next step, the request named delayed in it."""
        pending = self._unreported_blocks()
        for req_id, (spec, before) in list(self._held_last.items()):
            if pending.isdisjoint(spec.block_ids):
                del self._held_last[req_id]
                self._last_saves.append(spec)
                self._count_save(spec, before)
                self._delayed.append(req_id)

    def finished(self, request) -> bool:
        """request_finished (and aborts): the full blocks vLLM computed that no step saved
        yet are saved in the next step (`_last_save`); then drop every trace and the
        lookup's lease. True when a save of the request is planned or in flight: its
        blocks stay until every worker lists it in `get_finished`."""
        req_id = request.request_id
        if self.lookups is not None:
            self.lookups.drop(req_id)
        held = False
        if self.async_loads and req_id in self._loading:
            # Waiting for its asynchronous load: vLLM itself keeps the blocks until the
            # workers report the receive over, and the saves from before a preemption were
            # flushed before the load began; delaying as well would free them twice.
            in_flight = False
        else:
            held = self._last_save(request)
            in_flight = held or self._saving(req_id)
        for table in (self._requests, self._prompts, self._computed, self._saved, self._issued, self._over,
                      self._held, self._sources):
            table.pop(req_id, None)
        self._short.discard(req_id)
        self._stale.discard(req_id)
        if in_flight and not held:
            self._delayed.append(req_id)
        if in_flight:
            self._freeing.add(req_id)
        return in_flight

    @property
    def frees_pending(self) -> bool:
        """Whether blocks of finished requests are still kept for their saves (`finished`)."""
        return bool(self._freeing)

    def sent(self, req_ids) -> None:
        """vLLM freed these requests' blocks: every worker reported their saves over."""
        self._freeing.difference_update(req_ids)

    def _last_save(self, request) -> bool:
        """A request's steps save the blocks they fill whose tokens the scheduler knows when
        it plans them. Under vLLM's asynchronous scheduling a step is planned before the
        previous step's sampled token arrives, so the block the request's last forward
        completed is known full only now: it goes out with the next step's saves (which
        the workers start after that step's forward, so after every forward of the
        request) and the request is named delayed in the same step. A save over blocks
        of loads not every rank reported yet is held until they did (`_release_held`):
        True then (the request is named delayed with it)."""
        req_id = request.request_id
        if req_id in self._short:  # a load came back short: what it then computed is not saved
            return False
        before = self._saved.get(req_id, 0)
        spec = self._save_spec(req_id, request.num_computed_tokens)
        if spec is None:
            return False
        if not self._unreported_blocks().isdisjoint(spec.block_ids):
            self._held_last[req_id] = (spec, before)
            return True
        self._planned(req_id, spec, before, self._last_saves)
        return False

    def _plan_save(self, req_id: str, end: int, saves: list[SaveSpec]) -> None:
        """Append to `saves` the save of `req_id`'s blocks up to token `end` that radixkv
        does not hold yet (if any), counted as planned."""
        before = self._saved.get(req_id, 0)
        save = self._save_spec(req_id, end)
        if save is not None:
            self._planned(req_id, save, before, saves)

    def _planned(self, req_id: str, save: SaveSpec, before: int, saves: list[SaveSpec]) -> None:
        """`save` goes out with `saves`: counted as issued for the request, and its blocks
        past the `before` tokens radixkv held as handed over to save."""
        saves.append(save)
        self._count_save(save, before)
        self._issued[req_id] = self._issued.get(req_id, 0) + 1

    def _count_save(self, save: SaveSpec, before: int) -> None:
        self._counts["save_blocks"] += len(save.block_ids) - before // self.block_size

    def _saving(self, req_id: str) -> bool:
        """Whether a save (or held load) of `req_id` is not over on some rank, or a load of
        it is not reported by every rank yet: vLLM frees a request that finishes in a step
        before it hands this side that step's worker reports, so a load held in that step
        (or one the request was aborted during) is not known here yet. Not an asynchronous
        load: vLLM itself keeps the blocks of a request aborted while it waits for one until
        the workers report the receive over, and frees them then; naming the request in
        `get_finished`'s sending as well would free it twice (vLLM's scheduler asserts)."""
        if req_id in self._loading and not self.async_loads:
            return True
        issued = self._issued.get(req_id, 0)
        held = self._held.get(req_id, {})
        over = self._over.get(req_id, {})
        return any(over.get(rank, 0) < issued + held.get(rank, 0) for rank in range(self.tp_size))

    def reset(self) -> None:
        """reset_cache: a new epoch (see the module's docstring); lookups in flight and
        hits not yet loaded are dropped (their leases released)."""
        self._epoch = os.urandom(16)
        self._prompts.clear()
        self._stale.update(self._requests)
        if self.lookups is not None:
            self.lookups.drop_all()

    def hit_sources(self, req_id: str, num_external: int) -> dict:
        """vLLM's tier -> tokens of the load `allocated` planned for `req_id` (of
        `num_external` tokens: all host when none was planned): on host already, or
        fetched from the daemon's storage tier (`stats.hit_source`)."""
        host, stored = self._sources.pop(req_id, (num_external, 0))
        storage = hit_source(self.lookups.storage if self.lookups is not None else "")
        return {tier: n for tier, n in ((CacheHitSource.HOST, host), (storage, stored)) if n}

    def take_counts(self) -> dict[str, int]:
        """This side's counts and the lookups' since the last call (those above 0), then zero."""
        counts, self._counts = self._counts, Counter()
        if self.lookups is not None:
            counts.update(self.lookups.take_counts())
        return dict(+counts)

    def close(self) -> None:
        if self.lookups is not None:
            for lease, *_ in self._loading.values():
                self.lookups.release(lease)
            self._loading.clear()
            self.lookups.close()

    def _save_spec(self, req_id: str, end: int) -> SaveSpec | None:
        request = self._requests.get(req_id)
        manager = self._kv_manager()
        if (request is None or manager is None or not self.saves or req_id in self._stale or req_id in self._short
                or not cacheable(request)):
            return None
        bs = self.block_size
        end = min(end, request.num_tokens) // bs * bs
        if end <= self._saved.get(req_id, 0):
            return None
        block_ids = tuple(manager.get_block_ids(req_id)[0][:end // bs])
        if len(block_ids) * bs < end:
            return None
        self._saved[req_id] = end
        key = self._key(request, end)
        return SaveSpec(req_id, key.tokens, block_ids, key.extra_key)

    def _key(self, request, n: int) -> Prompt:
        """The radixkv prompt of the request's first `n` tokens: packed int32 bytes (its
        multimodal inputs applied) and its extra key (`request_keys`). The prompt's key is
        made once per prompt (packing 2k tokens takes about 15 us on the scheduler's thread):
        its lookup and every save within it slice the same bytes; tokens past it are packed
        when a save needs them. A streaming-input session (vLLM's resumable request) grows
        its prompt and multimodal inputs with each chunk: the key is made again then, so a
        later chunk's inputs key its blocks too."""
        shape = (request.num_prompt_tokens, len(getattr(request, "mm_features", None) or ()))
        made, key = self._prompts.get(request.request_id, (None, None))
        if made != shape:
            key = prompt_key(_packed(request.all_token_ids, 0, request.num_prompt_tokens), request, self._epoch)
            self._prompts[request.request_id] = (shape, key)
        have = len(key.tokens) // _INT32
        if n <= have:
            return Prompt(key.tokens[:n * _INT32], key.extra_key)
        return Prompt(key.tokens + _packed(request.all_token_ids, have, n), key.extra_key)


_INT32 = 4


def _add(counts: dict[int, int], ranks: dict[int, int]) -> None:
    for rank, n in ranks.items():
        counts[rank] = counts.get(rank, 0) + n


def _packed(tokens, start: int, end: int) -> bytes:
    """Tokens [start, end) as packed little-endian int32 bytes."""
    return pack(tokens[start:end])


__all__ = ["SchedulerSide"]

