"""Every daemon call the vLLM connector makes, in one place.

The connector needs an *engine-managed device tier*: vLLM owns its blocks and its prefix
cache, so the daemon may touch a vLLM block only during a transfer the connector asked
for, and must forget it afterwards (docs/vllm.md, "What the daemon must provide").
Today's daemon has only the managed-device mode (Insert hands device pages to the tree;
one session per namespace), so `DaemonAdapter` emulates the engine-managed contract on it:

- the namespace uses the `write_back` policy, and after every Insert or LoadBack the
  adapter calls Evict for every device page the tree holds: Evict copies new pages to
  host (waiting for the copy) and hands every page back, so between calls the tree holds
  no vLLM block and Match reports host hits only;
- `load` first labels the blocks vLLM already holds (its own prefix-cache hit) with an
  Insert, so LoadBack writes only the blocks after them, never a block vLLM shares;
- every call sequence runs under one lock, so a Match never sees another sequence's
  transient device pages;
- the scheduler has no session: workers look prefixes up for it (`radixkv.vllm.scheduler`).

When the daemon grows the engine-managed mode, only this module changes. Failures never
reach vLLM as exceptions after startup: a lookup that fails is a miss, a load that fails
loads nothing (vLLM recomputes), a save that fails is skipped; each is logged.
"""

import logging
import threading
from array import array
from dataclasses import dataclass

from radixkv.client import Client
from radixkv.errors import RadixKVError
from radixkv.types import as_packed

from .config import ConnectorConfig
from .kvmemory import KvMemory

log = logging.getLogger("vllm.radixkv")  # vLLM's log handlers show it

WRITE_POLICY = "write_back"  # Insert copies nothing; the Evict that follows copies, then frees


@dataclass(frozen=True)
class Hit:
    """A lookup's answer for one prompt: the first `tokens` tokens are cached (host
    tier), ending at `node`; `lease` (0: none) keeps them until released."""

    tokens: int
    node: int
    lease: int


MISS = Hit(0, 0, 0)


class DaemonAdapter:
    """One worker's session on the daemon. Thread-safe: the worker's lookup thread
    matches while the worker loads and saves."""

    def __init__(self, config: ConnectorConfig, engine: str):
        self.config = config
        self.engine = engine
        self.memory: KvMemory | None = None
        self._client = Client(config.target, timeout=config.timeout_s,
                              on_session_lost=self._session_lost)
        self._lock = threading.Lock()
        self._held = 0  # vLLM blocks the daemon's tree holds right now (0 between calls)
        self.broken = ""  # why loads and saves stopped (the daemon kept vLLM blocks)

    # -- lifecycle ---------------------------------------------------------------------

    def attach(self, memory: KvMemory) -> None:
        """Register vLLM's KV memory. Raises RuntimeError with the daemon's reason when
        the daemon is not reachable within connect_timeout_s or refuses the layout."""
        cfg = self.config
        try:
            self._client.wait_ready(cfg.connect_timeout_s)
            self._client.register(
                cfg.namespace, memory.layout, memory.buffers, memory.num_blocks, backend="shm",
                write_policy=WRITE_POLICY, host_pool_pages=cfg.host_pool_pages,
                replace_existing=cfg.replace_existing, engine=self.engine, model=cfg.model)
        except RadixKVError as e:
            raise RuntimeError(f"radixkv: cannot register vLLM's KV cache with the daemon at "
                               f"{cfg.target} (namespace {cfg.namespace!r}): {e}") from None
        self.memory = memory
        log.info("radixkv: registered %d blocks x %d layers with %s, namespace %r",
                 memory.num_blocks, memory.layout.num_layers, cfg.target, cfg.namespace)

    def close(self) -> None:
        """End the session (the daemon then no longer touches vLLM's memory). Idempotent."""
        with self._lock:
            self._client.close()

    # -- scheduler side ----------------------------------------------------------------

    def lookup(self, prompts: list[bytes]) -> list[Hit]:
        """The host-tier hit of each prompt (packed tokens), leased: one batched Match
        that also asks the storage tier; prompts with more in storage are staged to host
        (Prefetch, waiting for it) and matched again. Runs on the lookup thread, so the
        staging never blocks vLLM's scheduler. A daemon that cannot answer gives misses."""
        if not prompts or self.broken:
            return [MISS] * len(prompts)
        try:
            results = self._match(prompts)
            staged = [i for i, r in enumerate(results) if r.storage_tokens]
            for i in staged:  # under the lock: one client, one recovery at a time
                with self._lock:
                    self._client.prefetch(prompts[i], policy="wait_complete")
            if staged:
                again = self._match([prompts[i] for i in staged])
                self._release([results[i].lease for i in staged])
                for i, r in zip(staged, again):
                    results[i] = r
        except RadixKVError as e:
            log.warning("radixkv: lookup of %d prompts failed, treated as misses: %s", len(prompts), e)
            return [MISS] * len(prompts)
        hits = []
        for r in results:
            if r.device_tokens:  # the tree should hold no vLLM block between calls
                self._release([r.lease])
                hits.append(MISS)
            else:
                hits.append(Hit(r.host_tokens, r.host_node, r.lease))
        return hits

    def _match(self, prompts: list[bytes]):
        with self._lock:
            return self._client.match(prompts, lease=True, include_storage=True)

    def release(self, leases: list[int]) -> None:
        """Release lookup leases (0s skipped); failures are logged (the daemon releases a
        lost session's leases itself)."""
        with self._lock:
            self._release(leases)

    # -- worker side -------------------------------------------------------------------

    def load(self, tokens: bytes, block_ids, local_blocks: int, lease: int) -> int:
        """Copy the cached pages of `tokens` after the first `local_blocks` into the blocks
        `block_ids[local_blocks:]`; returns how many of those pages arrived (a prefix of
        them, 0 on any failure). Blocks before `local_blocks` are read-only here. Matches
        `tokens` again first, so the load ends exactly at their end (ranks may have hit
        more than the hit all of them share). Releases the lookup's `lease` in every case."""
        page = self.memory.layout.page_size
        want = len(block_ids) - local_blocks
        with self._lock:
            leases = [lease]
            try:
                if self.broken:
                    return 0
                [m] = self._client.match([tokens], lease=True)
                leases.append(m.lease)
                if m.device_tokens:
                    return 0  # the tree should hold no vLLM block between calls
                if local_blocks:
                    self._insert(tokens[:local_blocks * page * 4], block_ids[:local_blocks])
                return self._load_back(m.host_node, block_ids, local_blocks, want)
            except RadixKVError as e:
                log.warning("radixkv: load of %d pages failed: %s", want, e)
                return 0
            finally:
                self._release(leases)  # a leased path cannot leave the device
                self._forget_device()

    def _load_back(self, node: int, block_ids, local_blocks: int, want: int) -> int:
        page = self.memory.layout.page_size
        result = self._client.load_back(node, array("i", block_ids[local_blocks:]))
        self._held += want - len(result.unused_pages)
        if result.transfer:
            outcome = self._client.wait([result.transfer])[result.transfer]
            if not outcome.ok:  # the failed load's pages came back with the outcome
                self._held -= len(outcome.failed_pages)
                log.warning("radixkv: load of %d pages failed: %s", want, outcome.reason)
                return 0
        loaded = result.loaded_tokens // page
        if result.device_tokens != (local_blocks + loaded) * page:
            log.warning("radixkv: load planned against blocks vLLM does not own; ignored")
            return 0
        return min(loaded, want)

    def save(self, tokens: bytes, block_ids) -> bool:
        """Insert whole pages of `tokens` from `block_ids` and wait until the daemon holds
        its own copy; vLLM may reuse the blocks when this returns. False when the daemon
        could not take them (logged)."""
        with self._lock:
            if self.broken:
                return False
            try:
                self._insert(tokens, block_ids)
                return True
            except RadixKVError as e:
                log.warning("radixkv: save of %d pages skipped: %s", len(block_ids), e)
                return False
            finally:
                self._forget_device()

    # -- emulation of the engine-managed tier on today's daemon ------------------------

    def _insert(self, tokens: bytes, block_ids) -> None:
        result = self._client.insert(as_packed(tokens), array("i", block_ids))
        self._held += len(block_ids) - len(result.redundant_pages)

    def _forget_device(self) -> None:
        """Take every vLLM block back from the tree (Evict copies to host what it lacks
        first). If the daemon keeps some, it could later claim stale blocks as a hit:
        loads and saves stop (`broken`), and the error says why."""
        if self.memory is None or self._held == 0:
            return
        try:
            freed = len(self._client.evict(self.memory.num_blocks).freed_pages)
        except RadixKVError as e:  # unreachable: retried after the next call, or the
            log.warning("radixkv: could not take vLLM's blocks back yet: %s", e)  # session is lost
            return
        self._held -= freed
        if self._held > 0:
            self.broken = f"the daemon kept vLLM blocks: Evict returned {freed} of {freed + self._held}"
            log.error("radixkv: %s; loads and saves are off for this engine", self.broken)

    def _session_lost(self, lost) -> None:
        """The client registered again (daemon restarted or session expired): the new
        session holds no device page, so nothing of vLLM's is held any more."""
        log.warning("radixkv: %s", lost)
        self._held = 0

    def _release(self, leases: list[int]) -> None:
        leases = [x for x in leases if x]
        if leases:
            try:
                self._client.release(leases)
            except RadixKVError as e:
                log.warning("radixkv: releasing %d leases failed: %s", len(leases), e)


__all__ = ["DaemonAdapter", "Hit", "MISS"]
