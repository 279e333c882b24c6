"""The cache's own configuration: page size, write policy, eviction order."""

import enum
from dataclasses import dataclass

from .evictable import STRATEGIES


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"                # back up every new device node
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # back up once hit often enough
    WRITE_BACK = "write_back"                      # copy to host only on device eviction


class StoragePolicy(enum.Enum):
    OFF = "off"                      # no third tier
    WRITE_THROUGH = "write_through"  # store a node as soon as its host copy is valid
    WRITE_BACK = "write_back"        # store a node when it is evicted from the host


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """One namespace's cache policy. `write_through_threshold` applies to
    write_through_selective (write_through backs up on the first insert).
    `storage_salt` seeds the storage keys (see page_keys.namespace_salt)."""

    page_size: int = 16
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    eviction_policy: str = "lru"
    storage: StoragePolicy = StoragePolicy.OFF
    storage_salt: bytes = b""

    def __post_init__(self):
        if isinstance(self.write_policy, str):
            try:
                object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
            except ValueError:
                names = [p.value for p in WritePolicy]
                raise ValueError(f"unknown write policy {self.write_policy!r}; choose one of {names}") from None
        if isinstance(self.storage, str):
            try:
                object.__setattr__(self, "storage", StoragePolicy(self.storage))
            except ValueError:
                names = [p.value for p in StoragePolicy]
                raise ValueError(f"unknown storage policy {self.storage!r}; choose one of {names}") from None
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.write_through_threshold < 1:
            raise ValueError(f"write_through_threshold must be >= 1, got {self.write_through_threshold}")
        if self.eviction_policy not in STRATEGIES:
            raise ValueError(f"unknown eviction policy {self.eviction_policy!r}; choose one of {sorted(STRATEGIES)}")

    @property
    def backup_threshold(self) -> int | None:
        """Hits after which a device node is backed up to host; None: never on insert."""
        if self.write_policy is WritePolicy.WRITE_BACK:
            return None
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            return 1
        return self.write_through_threshold
