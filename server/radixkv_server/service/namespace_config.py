"""NamespaceConfig: everything one namespace is built from, derived once at its first
Register from the daemon's `DaemonConfig` and the request (`registration.namespace_config`)."""

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
