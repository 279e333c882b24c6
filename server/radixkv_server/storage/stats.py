"""StorageStats: the counters one storage backend keeps of its calls (read by the
metrics scrape and by Stats)."""

from dataclasses import dataclass, replace


@dataclass(slots=True)
class StorageStats:
    """Counters of one backend since it was opened; `hits = gets - misses - corrupt`."""

    gets: int = 0          # pages asked for by get()
    get_bytes: int = 0     # payload bytes get() returned
    misses: int = 0        # pages get() found absent
    corrupt: int = 0       # pages get() found damaged (returned as None and removed)
    puts: int = 0          # pages put() stored
    put_bytes: int = 0     # payload bytes of those pages
    put_skipped: int = 0   # pages put() left alone because their key was present
    errors: int = 0        # calls that raised StorageUnavailable
    evicted: int = 0       # pages the backend removed: to stay in its bound (file max_size), or on a full disk
    seconds: float = 0.0   # wall time spent talking to the store

    def snapshot(self) -> "StorageStats":
        """A copy, consistent enough for metrics (fields are read without a lock)."""
        return replace(self)


__all__ = ["StorageStats"]
