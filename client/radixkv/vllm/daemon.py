"""A vLLM worker's daemon session (`DaemonAdapter`), and what every session of the
connector shares: its registration options and the lookup's `Hit`.

vLLM owns its blocks and its prefix cache, so the connector registers in an
*engine-managed* namespace (docs/vllm.md): the daemon keeps host and storage tiers only,
touches a vLLM block only during a transfer the connector asked for (an Insert copies the
blocks to host, a LoadBack copies host pages into blocks vLLM allocated) and never keeps
one. Any number of sessions share the namespace: each engine's scheduler (role
"scheduler": lookups with leases, no buffers; `radixkv.vllm.lookups`), every
tensor-parallel rank (role "engine", `tp_rank`/`tp_size`, each page sharded over the
ranks) and other engines of the model.

Failures never reach vLLM as exceptions after startup: a lookup that fails is a miss, a
load that fails loads nothing (vLLM recomputes), a save that fails is skipped; each is
logged. The client registers again after the daemon restarts.
"""

import contextlib
import logging
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from radixkv.client import Client
from radixkv.errors import DeadlineExceeded, RadixKVError, Unavailable
from radixkv.layout import KvLayout
from radixkv.types import as_packed

from .config import ConnectorConfig
from .outages import OutageLog, RegisteringAgain

log = logging.getLogger("vllm.radixkv")  # vLLM's log handlers show it


@dataclass(frozen=True)
class Hit:
    """A lookup's answer for one prompt: the first `tokens` tokens are cached on host with
    every rank's shard, ending at (or before) `node`; `lease` (0: none) keeps them until
    released. The last `stored` of them were fetched from the storage tier for this
    lookup (the rest were on host already)."""

    tokens: int
    node: int
    lease: int
    stored: int = 0


MISS = Hit(0, 0, 0)


@dataclass
class PendingLoad:
    """A load `DaemonAdapter.begin_load` started: the `want` blocks `pages` of `node`'s
    path from page `local_blocks`, and the stream's answer to come (None: not sent;
    `error`: why)."""

    node: int
    pages: array
    local_blocks: int
    lease: int
    want: int
    answer: Future | None = None
    error: RadixKVError | None = None
    transfer: int = 0  # a load answered once queued: the copy to settle (`settle_loads`)

    @property
    def late(self) -> bool:
        """The daemon has not answered yet. After `finish_load` (which waits timeout_s at
        most): it stopped waiting, and the daemon may write the blocks until `answer` completes."""
        return self.answer is not None and not self.answer.done()


def register_options(config: ConnectorConfig, *, engine: str, role: str, tp_rank: int = 0, tp_size: int = 1,
                     instance: str = "") -> dict:
    """The `register` options every session of the connector sends (worker or scheduler):
    an engine-managed namespace, the session's role and rank, the configured pool."""
    return dict(host_pool_pages=config.host_pool_pages, replace_existing=config.replace_existing,
                engine=engine, model=config.model, device_tier="engine_managed", role=role,
                tp_rank=tp_rank, tp_size=tp_size, instance=instance)


def registration_refused(config: ConnectorConfig, who: str, error: RadixKVError) -> RuntimeError:
    """What stops vLLM at startup when a session cannot register (`who`: which one)."""
    return RuntimeError(f"radixkv: cannot register vLLM's {who} with the daemon at {config.target} "
                        f"(namespace {config.namespace!r}): {error}")


def hit_of(result, on_host: int | None = None) -> Hit:
    """A lookup's hit from its MatchResult: the host tokens every rank's shard is in. With
    `on_host` (the tokens on host before the lookup fetched from storage), those past it
    count as `stored`."""
    tokens = result.complete_tokens
    stored = 0 if on_host is None else max(0, tokens - on_host)
    return Hit(tokens, result.host_node, result.lease, stored)


class DaemonAdapter:
    """A worker's session on the daemon (role "engine": one tensor-parallel rank).
    Thread-safe: one lock serialises the blocking calls on the shared client; calls
    started on the session stream (loads begun early) and waiting for acks take no lock."""

    def __init__(self, config: ConnectorConfig, engine: str, tp_rank: int = 0, tp_size: int = 1,
                 instance: str = ""):
        self.config = config
        self.engine = engine
        self.tp_rank, self.tp_size, self.instance = tp_rank, tp_size, instance
        self.page_size = 0
        self.cuda_device: int | None = None  # vLLM's GPU when its KV cache is on CUDA
        self._client = Client(config.target, timeout=config.timeout_s, stream=True,
                              on_session_lost=self._session_lost, **config.channel())
        self._lock = threading.Lock()
        self._skipped = OutageLog(log, "saves are skipped while they fail", "saves go through again")
        self._saves_resume_at = 0.0  # time.monotonic(): saves skipped until then (daemon not answering)
        self._registering: threading.Thread | None = None  # one attempt at registering again
        self._registering_lock = threading.Lock()  # not `_lock`: a call may hold it for timeout_s
        self._registering_log = RegisteringAgain(log, "worker")  # used by the one attempt under way

    # -- lifecycle ---------------------------------------------------------------------

    def attach(self, layout: KvLayout, buffers: Iterable = (), num_blocks: int = 0, *,
               cuda_device: int | None = None, device_uuid: str = "") -> None:
        """Register with the KV memory's buffers and block count. `cuda_device` (vLLM's
        KV cache on CUDA): backend "cuda", buffers exported by IPC handle
        (`cudamemory.export`, re-exported for each re-registration), the GPU named by
        `device_uuid`; copies are then ordered after vLLM's stream with events. Raises
        RuntimeError with the daemon's reason when the daemon is not reachable within
        connect_timeout_s or refuses the layout."""
        cfg = self.config
        try:
            self._client.wait_ready(cfg.connect_timeout_s)
            self._client.register(
                cfg.namespace, layout, buffers if hasattr(buffers, "fresh") else list(buffers), num_blocks,
                backend="shm" if cuda_device is None else "cuda", device=cuda_device or 0,
                device_uuid=device_uuid, **register_options(cfg, engine=self.engine, role="engine",
                                                            tp_rank=self.tp_rank, tp_size=self.tp_size,
                                                            instance=self.instance))
        except RadixKVError as e:
            raise registration_refused(cfg, f"worker (rank {self.tp_rank})", e) from None
        self.page_size = layout.page_size
        self.cuda_device = cuda_device
        log.info("radixkv: worker rank %d registered (%d blocks x %d layers) with %s, namespace %r",
                 self.tp_rank, num_blocks, layout.num_layers, cfg.target, cfg.namespace)

    def close(self) -> None:
        """End the session (the daemon finishes its copies first and then no longer
        touches vLLM's memory). Idempotent."""
        with self._lock:
            self._client.close()

    # -- loads and saves -------------------------------------------------------------

    def load(self, node: int, block_ids, local_blocks: int, lease: int) -> int:
        """Copy the complete host pages of `node`'s path after the first `local_blocks`
        into the blocks `block_ids[local_blocks:]` (one per page, no more); returns how
        many of those blocks were filled (a prefix of them, 0 on any failure). Blocks
        before `local_blocks` (vLLM's own prefix-cache hit) are never written. `lease` is
        the scheduler's Match lease on the path; the caller releases it."""
        return self.finish_load(self.begin_load(node, block_ids, local_blocks, lease))

    def begin_load(self, node: int, block_ids, local_blocks: int, lease: int, *,
                   queued: bool = False) -> "PendingLoad":
        """`load`'s copy sent on the session stream without waiting for it, so that it runs
        while vLLM prepares the forward; `finish_load` waits for it (and must be called:
        the daemon writes the blocks until then). Where the stream cannot take it now (the
        session lost, or closed) the load is not sent: it fills no block, so no answer can
        come too late for blocks vLLM gave to another request meanwhile. `queued` (CUDA):
        the daemon answers once the copy is queued, with its per-layer events for vLLM's
        stream to wait on, and `finish_load` leaves `pending.transfer` to `settle_loads`
        after the forward (the copy's outcome comes with its acknowledgement)."""
        want = len(block_ids) - local_blocks
        pages = array("i", block_ids[local_blocks:])
        pending = PendingLoad(node, pages, local_blocks, lease, want)
        if want > 0:
            try:
                pending.answer = self._client.start_load_back(node, pages, lease=lease, start_page=local_blocks,
                                                              engine_event=self.step_event(), wait=not queued)
            except RadixKVError as e:
                pending.error = e
        return pending

    def finish_load(self, pending: "PendingLoad", loaded_events: Callable[[tuple], None] | None = None) -> int:
        """Wait for a `begin_load`: the blocks it filled, as `load` returns them. Past
        timeout_s it fills none and `pending.late` holds: the caller must keep the blocks
        from reuse until `pending.answer` completes (`Saves.hold`). On CUDA the answer
        comes once the copy is queued: vLLM's stream waits for its per-layer events
        (`wait_loaded`), or `loaded_events` gets them to wait for layer by layer."""
        if pending.want <= 0:
            return 0
        try:
            if pending.error is not None:
                raise pending.error
            if pending.answer is None:
                self._register_again()
                raise Unavailable("the session stream is down: the load was not sent")
            try:
                result = pending.answer.result(self.config.timeout_s)
            except FutureTimeout:
                raise DeadlineExceeded(f"LoadBack: no answer within {self.config.timeout_s}s "
                                       "(its blocks stay held until the daemon answers)") from None
            if isinstance(result, RadixKVError):
                raise result
            pending.transfer = result.transfer
            (loaded_events or self.wait_loaded)(tuple(result.layer_events))
            return min(result.loaded_tokens // self.page_size, pending.want)
        except RadixKVError as e:
            log.warning("radixkv: load of %d pages failed: %s", pending.want, e)
            return 0

    def settle_loads(self, transfers: Iterable[int]) -> tuple[set[int], set[int]]:
        """Acknowledge loads begun `queued` and wait (timeout_s at most) for their copies:
        (failed, unanswered). Failed: the copy failed, the session was lost, or no answer
        came in time; vLLM's forward may have read those blocks before their bytes were in
        place, so their requests recompute. Unanswered: the daemon may still write those
        blocks (keep them from reuse: `Saves.hold_transfer`)."""
        ids = [t for t in transfers if t]
        if not ids:
            return set(), set()
        outcomes = self._outcomes(ids, self.config.timeout_s)
        unanswered = set(ids) - outcomes.keys()
        failed = unanswered | {t for t, outcome in outcomes.items() if not outcome.ok}
        if failed:
            log.warning("radixkv: %d of %d loads failed or went unanswered within %gs (recomputed)",
                        len(failed), len(ids), self.config.timeout_s)
        return failed, unanswered

    def save(self, tokens: bytes, block_ids, engine_event=None, extra_key: bytes = b"") -> "int | Future":
        """Start copying whole pages of `tokens` (under `extra_key`) from `block_ids` to the
        daemon's host tier (asynchronous Insert, on the session stream), after
        `engine_event` (`step_event()` of the step that filled the blocks) on CUDA. Returns
        the transfer to wait for before vLLM may reuse the blocks; 0 when nothing is being
        copied (all there already, or the daemon could not take the save: logged); or,
        when the daemon did not answer within timeout_s, the Future of its answer: the
        daemon may still take the Insert and read the blocks, so they stay held until it
        completes and, if it names a transfer, that is acknowledged (`Saves`). After such a
        save, the saves of the next timeout_s are skipped without asking: each would wait
        timeout_s in turn, and a finished request keeps its blocks until its saves are
        over, so queued saves would hold vLLM's KV cache for that long."""
        if time.monotonic() < self._saves_resume_at:
            return self._skip_save(len(block_ids), "the daemon did not answer the last save")
        if self._registering is not None and self._registering.is_alive():
            return self._skip_save(len(block_ids), "the lost session is being registered again")
        try:
            answer = self._client.start_insert(as_packed(tokens), array("i", block_ids), extra_key=extra_key,
                                               engine_event=engine_event)
        except RadixKVError as e:  # the client closed
            return self._skip_save(len(block_ids), e)
        if answer is None:  # not sent: nothing reads the blocks
            self._register_again()
            return self._skip_save(len(block_ids), "the session stream is down")
        try:
            result = answer.result(self.config.timeout_s)
        except FutureTimeout:  # not answered: the next would wait as long
            self._saves_resume_at = time.monotonic() + self.config.timeout_s
            self._skipped.failed(f"{len(block_ids)} pages now, no answer within {self.config.timeout_s}s "
                                 "(their blocks stay held until the daemon answers)")
            return answer
        if isinstance(result, RadixKVError):
            return self._skip_save(len(block_ids), result)
        self._skipped.worked()
        return result.transfer

    def _skip_save(self, pages: int, why) -> int:
        """A save not made (logged as part of a run of them). Returns 0."""
        self._skipped.failed(f"{pages} pages now, {why}")
        return 0

    def done(self, transfers: Iterable[int], timeout: float | None = 0) -> set[int]:
        """Of `transfers`, those whose copy is over (copied, failed, or the session gone:
        the daemon no longer reads the blocks). `timeout` 0 only looks; None waits for all."""
        ids = [t for t in transfers if t]
        if not ids:
            return set()
        try:
            return set(self._outcomes(ids, timeout))
        except RadixKVError:
            return set()

    def _outcomes(self, ids: list[int], timeout: float | None) -> dict:
        """Acknowledge `ids` and wait `timeout` (0: only look; None: for all): the outcomes
        of those answered by then, each asked alone without waiting once time is up."""
        try:
            return self._client.wait(ids, timeout=timeout)
        except DeadlineExceeded:
            if len(ids) == 1:
                return {}  # that one is not answered: no need to ask again
        outcomes = {}
        for t in ids:
            with contextlib.suppress(DeadlineExceeded):
                outcomes.update(self._client.wait([t], timeout=0))
        return outcomes

    def step_event(self):
        """CUDA: an event after every kernel vLLM queued so far (the daemon's copy waits
        for it on the GPU); None on CPU (shared memory: the forward is over)."""
        if self.cuda_device is None:
            return None
        from .cudamemory import step_event
        return step_event(self.cuda_device)

    def wait_loaded(self, layer_events) -> None:
        """CUDA: vLLM's current stream waits for these load events (all of a load's layers,
        or one layer's of several loads) before reading."""
        if self.cuda_device is not None and layer_events:
            from .cudamemory import wait_loaded
            wait_loaded(tuple(layer_events), self.cuda_device)

    def _session_lost(self, lost) -> None:
        """The client registered again (daemon restarted, session expired): leases and
        transfers of the old session are gone; loads planned with them fail and vLLM
        recomputes, saves in flight count as over (the old daemon reads nothing more)."""
        log.warning("radixkv: %s", lost)

    def _register_again(self) -> None:
        """Start one attempt at registering a lost session again, on a thread of its own
        and without waiting for its backoff, unless one is under way: the step that found
        the stream down goes on at once (against a daemon that does not answer, the
        attempt takes up to timeout_s), and the next load goes on the new stream."""
        with self._registering_lock:
            if self._registering is not None and self._registering.is_alive():
                return
            self._registering = threading.Thread(target=self._recover, name="radixkv-register-again", daemon=True)
            self._registering.start()

    def _recover(self) -> None:
        """One attempt at registering a lost session again; failures are left to later loads."""
        try:
            with self._lock:
                self._client.reconnect(timeout=0)
        except RadixKVError as e:
            self._registering_log.failed(e)
        else:
            self._registering_log.worked()


__all__ = ["DaemonAdapter", "Hit", "MISS", "hit_of", "register_options", "registration_refused"]
