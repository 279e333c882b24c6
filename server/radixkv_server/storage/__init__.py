"""L3 storage: whole KV pages kept across restarts and shared across daemons.

Keys come from `page_keys` (a hash chain salted by `namespace_salt`); values are
checksummed `record`s. Backends are blocking and thread-safe (the daemon calls them from
worker threads): `FileStorage` (a directory, the embedded default), `RedisStorage`
(Redis or Valkey), and for fleets `RedisClusterStorage` (redis_cluster.py) and
`MooncakeStorage` (mooncake_store.py). `open_storage(url)` picks one. Prefetch finds the
run of pages storage holds (`StorageBackend.read_ahead`: Redis reads it then and there)
and puts it straight into the host pool (`place`, `get_into`). A store fault raises
`StorageUnavailable`; a damaged page reads as a miss.
"""

from .base import MAX_KEY_BYTES, Read, ReadAhead, StorageBackend
from .stats import StorageStats
from .errors import StorageFull, StorageTimeout, StorageUnavailable
from .open import open_storage
from .file import FileStorage
from ..core.page_keys import KEY_BYTES, namespace_salt, page_keys
from .record import CorruptPage, decode, encode

__all__ = [
    "KEY_BYTES", "MAX_KEY_BYTES", "CorruptPage", "FileStorage", "Read", "ReadAhead", "RedisStorage",
    "StorageBackend", "StorageFull", "StorageStats", "StorageTimeout", "StorageUnavailable", "decode", "encode",
    "namespace_salt", "open_storage", "page_keys",
]


def __getattr__(name: str):
    # RedisStorage imports redis-py; load it only when asked for.
    if name == "RedisStorage":
        from .redis_store import RedisStorage
        return RedisStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
