"""radixkv.routing: what a KV-aware router embeds to follow radixkv daemons' KV events.

- `blockhash`: the block hash chain (vLLM's sha256_cbor scheme), computable without radixkv.
- `wire`: vLLM 0.32's KVEventBatch / BlockStored / BlockRemoved / AllBlocksCleared.
- `RoutingIndex`: per worker, per tier block sets; "who holds the longest prefix".
- `WorkerFeed` / `ZmqFleet`: sequence tracking, gap detection and replay per daemon.
See docs/events.md and docs/examples/router.py.
"""

from .blockhash import block_digests, block_hashes, external_hash
from .index import RoutingIndex, TierWeights, WorkerScore
from .feed import WorkerFeed
from .subscriber import Daemon, ZmqFleet

__all__ = [
    "Daemon", "RoutingIndex", "TierWeights", "WorkerFeed", "WorkerScore", "ZmqFleet",
    "block_digests", "block_hashes", "external_hash",
]
