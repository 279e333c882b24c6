"""Every daemon call the vLLM connector makes, in one place.

vLLM owns its blocks and its prefix cache, so the connector registers each worker in an
*engine-managed* namespace (docs/vllm.md): the daemon keeps host and storage tiers only,
touches a vLLM block only during a transfer the connector asked for (an Insert copies the
blocks to host, a LoadBack copies host pages into blocks vLLM allocated) and never keeps
one. Any number of sessions share the namespace: every tensor-parallel rank of an engine
(`tp_rank`/`tp_size`, each page sharded over the ranks) and other engines of the model.

Failures never reach vLLM as exceptions after startup: a lookup that fails is a miss, a
load that fails loads nothing (vLLM recomputes), a save that fails is skipped; each is
logged. The client registers again after the daemon restarts.
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

    def __init__(self, config: ConnectorConfig, engine: str, tp_rank: int = 0, tp_size: int = 1,
                 instance: str = ""):
        self.config = config
        self.engine = engine
        self.tp_rank, self.tp_size, self.instance = tp_rank, tp_size, instance
        self.memory: KvMemory | None = None
        self._client = Client(config.target, timeout=config.timeout_s,
                              on_session_lost=self._session_lost)
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------

    def attach(self, memory: KvMemory) -> None:
        """Register vLLM's KV memory. Raises RuntimeError with the daemon's reason when
        the daemon is not reachable within connect_timeout_s or refuses the layout."""
        cfg = self.config
        try:
            self._client.wait_ready(cfg.connect_timeout_s)
            self._client.register(
                cfg.namespace, memory.layout, memory.buffers, memory.num_blocks, backend="shm",
                host_pool_pages=cfg.host_pool_pages, replace_existing=cfg.replace_existing,
                engine=self.engine, model=cfg.model, device_tier="engine_managed", role="engine",
                tp_rank=self.tp_rank, tp_size=self.tp_size, instance=self.instance)
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
        if not prompts:
            return []
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
        return [Hit(r.complete_tokens, r.host_node, r.lease) for r in results]

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
        them, 0 on any failure). Blocks before `local_blocks` (vLLM's own prefix-cache
        hit) are never written. Matches `tokens` again first, so the load ends exactly at
        their end (ranks may have hit more than the hit all of them share). Releases the
        lookup's `lease` in every case."""
        page = self.memory.layout.page_size
        want = len(block_ids) - local_blocks
        with self._lock:
            leases = [lease]
            try:
                [m] = self._client.match([tokens], lease=True)
                leases.append(m.lease)
                result = self._client.load_back(m.host_node, array("i", block_ids[local_blocks:]),
                                                lease=m.lease, start_page=local_blocks)
                if result.transfer:
                    outcome = self._client.wait([result.transfer])[result.transfer]
                    if not outcome.ok:
                        log.warning("radixkv: load of %d pages failed: %s", want, outcome.reason)
                        return 0
                return min(result.loaded_tokens // page, want)
            except RadixKVError as e:
                log.warning("radixkv: load of %d pages failed: %s", want, e)
                return 0
            finally:
                self._release(leases)

    def save(self, tokens: bytes, block_ids) -> bool:
        """Copy whole pages of `tokens` from `block_ids` to the daemon's host tier; vLLM
        may reuse the blocks when this returns. False when the daemon could not take
        them (logged)."""
        with self._lock:
            try:
                self._client.insert(as_packed(tokens), array("i", block_ids))
                return True
            except RadixKVError as e:
                log.warning("radixkv: save of %d pages skipped: %s", len(block_ids), e)
                return False

    def _session_lost(self, lost) -> None:
        """The client registered again (daemon restarted, session expired): lookups
        answered before hold leases of the old session, which are gone; their loads fail
        and vLLM recomputes."""
        log.warning("radixkv: %s", lost)

    def _release(self, leases: list[int]) -> None:
        leases = [x for x in leases if x]
        if leases:
            try:
                self._client.release(leases)
            except RadixKVError as e:
                log.warning("radixkv: releasing %d leases failed: %s", len(leases), e)


__all__ = ["DaemonAdapter", "Hit", "MISS"]
