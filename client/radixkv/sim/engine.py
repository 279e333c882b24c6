"""Engine: a simulated inference engine driving the daemon like SGLang's scheduler.

Each step takes a batch of arrived requests and:
  1. Match all prompts in one call, with a lease per prompt;
  2. for host hits, allocate device pages (evicting from the daemon when short) and
     LoadBack; unused pages come back to the free list;
  3. wait for its transfers and every `depends_on`, taking back pages of failed loads;
  4. per request: verify every byte of the device prefix, "prefill" the rest (allocate,
     write pattern KV), Insert the whole pages (freeing redundant ones, releasing the
     lease) and free the partial tail page. A request that cannot get its pages
     releases its lease and waits for the next step.
A failed load is recomputed, never read. Defects are counted in the `Report`, never
asserted.

On CUDA buffers the engine does its KV work on one stream: after each LoadBack it makes
that stream wait on the transfer's per-layer IPC events (as a real engine does before
running layer i), and it synchronizes its writes before Insert, since the daemon's
copies do not wait for the engine's stream.
"""

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..kvbuffers import CudaKvBuffers
from ..layout import KvLayout
from ..types import MatchResult, Prompt
from .kv import KvPattern, page_keys
from .pages import PagePool
from .report import Report
from .workload import Request, Workload


@dataclass
class _Plan:
    """One request between its match and its insert."""

    request: Request
    lease: int
    prefix_pages: list[int]
    device_tokens: int  # on device at match time
    loaded_tokens: int = 0
    deps: set[int] = field(default_factory=set)


class Engine:
    """Owns the device page pool of one registered client (`client.register` done by
    the caller with the same `buffers`). `stream`: the CUDA stream for the engine's KV
    work when the buffers are CUDA tensors (default: their device's current stream).
    `other_ranks`: a tensor-parallel engine's buffers of ranks 1, 2, ... (registered by
    the caller on the same namespace): one page table for all, every page written and
    verified on every rank, each rank's KV its own; `client` is rank 0's."""

    def __init__(self, client, layout: KvLayout, buffers: Sequence[torch.Tensor], num_pages: int, *,
                 max_batch: int = 8, wait_timeout: float = 120.0, stream=None,
                 other_ranks: Sequence[Sequence[torch.Tensor]] = ()):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.client = client
        self.layout = layout
        self.page_size = layout.page_size
        self.pool = PagePool(num_pages)
        self.kv = KvPattern(layout, buffers, num_pages)
        self.ranks = [self.kv] + [KvPattern(layout, b, num_pages, rank=r) for r, b in enumerate(other_ranks, 1)]
        if self.kv.device.type == "cuda" and stream is None:
            stream = torch.cuda.current_stream(self.kv.device)
        self.stream = stream
        self.max_batch = max_batch
        self.wait_timeout = wait_timeout
        self.report = Report()
        self._reclaimed: set[int] = set()  # failed transfers whose pages came back

    # -- the loop ----------------------------------------------------------------------

    def run(self, workload: Workload, progress: Callable[[Report], None] | None = None,
            progress_every: int = 100) -> Report:
        """Run until the workload is done (or no request can get pages: `stalled`)."""
        start = time.monotonic()
        now, limit, shown = 0.0, self.max_batch, 0
        while not workload.done:
            batch = workload.take(now, limit)
            if not batch:
                nxt = workload.next_arrival()
                if nxt is None:
                    break
                now = max(now, nxt)
                continue
            finished = self.step(batch, workload, now)
            now += 1
            if finished:
                limit = self.max_batch
            elif limit > 1:
                limit = 1  # let one request have the whole pool
            else:
                self.report.stalled = True
                self.report.note(f"request {batch[0].rid} ({batch[0].num_tokens} tokens) cannot get "
                                 f"device pages ({self.pool.num_pages} in all); the pool is too small")
                break
            if progress is not None and self.report.requests >= shown + progress_every:
                shown = self.report.requests
                progress(self.report)
        self._check_accounting()
        self.report.seconds = time.monotonic() - start
        return self.report

    def step(self, batch: list[Request], workload: Workload, now: float) -> int:
        """One scheduler step over `batch`; returns how many requests finished."""
        with self._on_stream():
            return self._step(batch, workload, now)

    def _step(self, batch: list[Request], workload: Workload, now: float) -> int:
        self.report.steps += 1
        matches = self.client.match([Prompt(r.prompt, r.extra_key) for r in batch], lease=True)
        if len(matches) != len(batch):
            raise RuntimeError(f"Match answered {len(matches)} results for {len(batch)} prompts")
        plans = [self._plan(r, m) for r, m in zip(batch, matches)]
        deps = set().union(*(p.deps for p in plans))
        outcomes = self.client.wait(deps, timeout=self.wait_timeout) if deps else {}
        self._reclaim(outcomes)
        finished, deferred = 0, []
        for plan in plans:
            if self._finish(plan, outcomes):
                workload.finish(plan.request, now)
                finished += 1
            else:
                deferred.append(plan.request)
        workload.defer(deferred)
        return finished

    # -- phases ------------------------------------------------------------------------

    def _plan(self, r: Request, m: MatchResult) -> _Plan:
        ps = self.page_size
        plan = _Plan(r, m.lease, self._prefix(r, m.device_pages, m.device_tokens, "Match"),
                     m.device_tokens, deps=set(m.depends_on))
        if not m.host_tokens:
            return plan
        if m.host_tokens % ps:
            self._protocol_error(f"Match: host_tokens {m.host_tokens} is not whole pages")
            return plan
        pages = self._allocate(m.host_tokens // ps, partial=True)
        if not pages:
            return plan
        lb = self.client.load_back(m.host_node, pages)
        unused = set(lb.unused_pages)
        if not unused <= set(pages):
            self._protocol_error(f"LoadBack: unused pages {sorted(unused - set(pages))} were not given")
        self.pool.free([p for p in pages if p in unused], "LoadBack unused pages")
        self.pool.to_cache([p for p in pages if p not in unused], "LoadBack used pages")
        plan.prefix_pages = self._prefix(r, lb.device_pages, lb.device_tokens, "LoadBack")
        plan.deps.update(lb.depends_on)
        self._wait_layers(lb)
        if lb.transfer:
            self.report.load_backs += 1
            plan.deps.add(lb.transfer)
            plan.loaded_tokens = lb.loaded_tokens
        return plan

    def _finish(self, plan: _Plan, outcomes: dict) -> bool:
        """Verify, prefill, insert. False (lease released) when pages are short."""
        r, ps, rep = plan.request, self.page_size, self.report
        failed = any(not outcomes[t].ok for t in plan.deps)
        prefix = [] if failed else plan.prefix_pages
        keys = page_keys(r.tokens, ps, r.extra_key)
        self._verify(r, prefix, keys)
        whole = r.num_tokens // ps
        new = self._allocate(len(keys) - len(prefix))
        if new is None:
            self.client.release([plan.lease])
            rep.deferred += 1
            return False
        for kv in self.ranks:
            kv.write(new, keys[len(prefix):])
            kv.synchronize()  # the daemon may copy these pages as soon as it has them
        rep.requests += 1
        rep.prompt_tokens += r.prompt_tokens
        if not failed:
            rep.device_tokens += plan.device_tokens
            rep.host_tokens += plan.loaded_tokens
        rep.computed_tokens += r.num_tokens - len(prefix) * ps
        own, tail = new[: whole - len(prefix)], new[whole - len(prefix):]
        if whole:
            res = self.client.insert(r.tokens[: whole * ps * 4], prefix + own, extra_key=r.extra_key,
                                     release_lease=plan.lease)
            redundant = set(res.redundant_pages)
            self.pool.free(res.redundant_pages, "Insert redundant pages")
            self.pool.to_cache([p for p in own if p not in redundant], "Insert")
            rep.inserted_tokens += whole * ps - res.cached_tokens
            rep.cached_before_insert_tokens += res.cached_tokens
        else:
            self.client.release([plan.lease])
        self.pool.free(tail, "tail page")
        return True

    # -- helpers -----------------------------------------------------------------------

    def _on_stream(self):
        """The engine's stream as the current one (CUDA), else nothing."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _wait_layers(self, lb) -> None:
        """Order the engine's stream after a load-back's per-layer IPC events (CUDA). A
        transfer whose copy already finished comes without events; the shm backend never
        sends any."""
        events = lb.layer_events
        if not events:
            return
        if self.stream is None:
            self._protocol_error(f"LoadBack: {len(events)} CUDA events for an engine without CUDA buffers")
            return
        if len(events) != self.layout.num_layers:
            self._protocol_error(f"LoadBack: {len(events)} layer events for {self.layout.num_layers} layers")
        CudaKvBuffers.wait_events(list(events), self.stream)
        self.report.layer_event_waits += len(events)

    def _prefix(self, r: Request, pages, tokens: int, what: str) -> list[int]:
        """The device prefix as a page list; [] (recompute) if the daemon's answer is
        inconsistent or names pages the engine did not give to the cache."""
        pages = list(pages)
        if tokens != len(pages) * self.page_size or tokens > r.prompt_tokens:
            self._protocol_error(f"{what}: {tokens} device tokens in {len(pages)} pages "
                                 f"for a {r.prompt_tokens}-token prompt")
            return []
        return pages if self.pool.all_cached(pages, f"{what} device prefix") else []

    def _verify(self, r: Request, prefix: list[int], keys: list[int]) -> None:
        found = [kv.mismatches(prefix, keys[: len(prefix)]) for kv in self.ranks]
        bad_bytes, bad_chunks = sum(b for b, _ in found), sum(c for _, c in found)
        if bad_bytes:
            self.report.byte_mismatches += bad_bytes
            self.report.chunk_mismatches += bad_chunks
            self.report.note(f"request {r.rid}: {bad_bytes} wrong bytes in {bad_chunks} chunks "
                             f"of its {len(prefix)}-page prefix")

    def _allocate(self, n: int, partial: bool = False) -> list[int] | None:
        """`n` pages, evicting from the daemon when short. None when they cannot be had;
        with `partial`, as many as could be had instead."""
        short = n - self.pool.num_free
        if short > 0:
            ev = self.client.evict(short)
            self.report.evict_calls += 1
            self.report.evicted_pages += len(ev.freed_pages)
            self.pool.from_cache(ev.freed_pages, "Evict")
        if self.pool.can_allocate(n):
            return self.pool.allocate(n)
        return self.pool.allocate(self.pool.num_free) if partial else None

    def _reclaim(self, outcomes: dict) -> None:
        """Take back the pages of failed loads (once per transfer)."""
        for t, o in outcomes.items():
            if not o.ok and t not in self._reclaimed:
                self._reclaimed.add(t)
                self.report.failed_loads += 1
                self.report.note(f"load-back {t} failed: {o.reason}")
                self.pool.from_cache(o.failed_pages, f"failed load-back {t}")

    def _protocol_error(self, message: str) -> None:
        self.report.protocol_errors += 1
        self.report.note(message)

    def check_daemon(self, namespace: str) -> None:
        """Compare the pages the engine believes the cache holds with the daemon's count
        (call when nothing is in flight); a difference is an accounting error. Also
        records every violated invariant the daemon reports for `namespace`."""
        stats = self.client.stats(namespace)
        for ns in stats.namespaces:
            if ns.namespace == namespace and ns.device_pages_held != self.pool.num_cached:
                self.report.accounting_errors += 1
                self.report.note(f"the daemon holds {ns.device_pages_held} device pages, "
                                 f"the engine gave it {self.pool.num_cached}")
        self.report.violations += [f"{v.namespace}: {v.message}" for v in self.client.check_invariants(namespace)]

    def _check_accounting(self) -> None:
        for problem in self.pool.check(expect_in_use=0):
            self.report.note(problem)
            self.report.accounting_errors += 1
        self.report.accounting_errors += self.pool.errors
        for m in self.pool.messages:
            self.report.note(m)
