"""The pure cache core: radix tree, tiers, write policies, load-back pins, eviction.

No grpc, protobuf, asyncio, threads or I/O. Bytes move through the `Copier` the
caller provides; see `cache.HierarchicalCache` for the public API, and `state.CacheState`
for the one state object its parts (eviction, load-back, storage, ...) receive.
"""

from .cache import HierarchicalCache
from .copier import Copier
from .errors import (
    CacheError, InvalidRequest, LockError, NotOwner, NotReady, PageOwnershipError, UnknownNode,
    UnknownTransfer,
)
from .cache_config import CacheConfig, WritePolicy
from .residency import ResidencyListener
from .results import (
    CacheCounters, CopyOutcome, EvictResult, FinishResult, InsertResult, LoadBackResult,
    MatchResult,
)

__all__ = [
    "CacheConfig", "CacheCounters", "CacheError", "Copier", "CopyOutcome", "EvictResult",
    "FinishResult", "HierarchicalCache", "InsertResult", "InvalidRequest", "LoadBackResult",
    "LockError", "MatchResult", "NotOwner", "NotReady", "PageOwnershipError", "ResidencyListener",
    "UnknownNode", "UnknownTransfer", "WritePolicy",
]
