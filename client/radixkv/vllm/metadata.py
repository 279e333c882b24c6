"""What the scheduler-side connector tells the worker side each step (pickled by vLLM
to every worker process).

Block ids are vLLM's, which are also the page numbers the daemon was registered with.
Tokens travel packed (little-endian int32 bytes), as the daemon takes them.
"""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Load a radixkv hit into a request's blocks before this step's forward.

    The request's first `local_blocks` blocks already hold its prefix (vLLM's own prefix
    cache); `tokens` are the whole pages of the prefix up to the end of the hit, and
    `block_ids[i]` is the block of page i. The hit is `node` of the lookup's match, kept
    from eviction by `lease` until the load is done."""

    req_id: str
    tokens: bytes
    block_ids: tuple[int, ...]
    local_blocks: int
    node: int
    lease: int

    @property
    def load_blocks(self) -> tuple[int, ...]:
        """The blocks the load writes."""
        return self.block_ids[self.local_blocks:]


@dataclass(frozen=True)
class SaveSpec:
    """Insert a request's full blocks, computed by the end of this step: `tokens` (whole
    pages from the start of the request) in `block_ids`, page i in block i."""

    req_id: str
    tokens: bytes
    block_ids: tuple[int, ...]


@dataclass
class RadixKVMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


__all__ = ["LoadSpec", "RadixKVMetadata", "SaveSpec"]
