"""NamespaceConfig: everything one namespace is built from, derived once at its first
Register from the daemon's `DaemonConfig` and the request (`registration.namespace_config`)."""

import dataclasses
from dataclasses import dataclass

from radixkv.layout import KvLayout

from ..core import CacheConfig


@dataclass(frozen=True, slots=True)
class NamespaceConfig:
    name: str
    layout: KvLayout
    cache: CacheConfig         # page size, write/eviction/storage policies, storage salt
    host_pages: int            # host pool size
    pin_device: int | None     # CUDA device the host pool is pinned for (None: not pinned)
    prefault_host: bool        # fault the host pool in at creation (DaemonConfig.host_pool_prefault)
    copy_workers: int          # threads copying pages between device and host
    storage_workers: int       # threads doing storage I/O
    storage_queue_pages: int   # pages queued for storage writes before new ones are refused
    storage_lookup_timeout: float = 0.0  # seconds an engine call waits for a storage lookup (0: no limit)
    copy_delay: float = 0.0    # fault injection for tests (DaemonConfig.fault_copy_delay)
    fail_loads: float = 0.0    # fault injection for tests (DaemonConfig.fault_fail_loads)
    model: str = ""            # whose KV it holds (Registration.model_name): another model is refused
    tp_size: int = 1           # engine-managed: the ranks whose shards one host page holds

    @property
    def host_layout(self) -> KvLayout:
        """The layout of one host page: `layout` (one rank's page), widened to hold every
        rank's shard when `tp_size` > 1. The host pool, the host memory budget, Stats and
        the gauges all size host pages by it."""
        return host_layout(self.layout, self.tp_size)

    @property
    def host_pool_bytes(self) -> int:
        """The bytes its host pool takes (what the budget and a tenant's quota count)."""
        return self.host_pages * self.host_layout.page_bytes


def host_layout(layout: KvLayout, tp_size: int) -> KvLayout:
    """The layout of one host page holding `tp_size` ranks' shards of `layout`'s page."""
    return layout if tp_size == 1 else dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads * tp_size)
