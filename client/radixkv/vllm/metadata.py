"""What the two sides of the connector tell each other through vLLM, every step.

`RadixKVMetadata` goes from the scheduler to every worker (pickled by vLLM with the step);
`RadixKVWorkerMetadata` comes back from each worker, merged across workers by `aggregate`,
to the scheduler's `update_connector_output`. So the scheduler side makes no daemon call:
the workers, which hold the daemon sessions, look prefixes up for it.

Block ids are vLLM's, which are also the page numbers the daemon was registered with.
Tokens travel packed (little-endian int32 bytes), as the daemon takes them.
"""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Load a radixkv hit into a request's blocks before this step's forward.

    The request's first `local_blocks` blocks already hold its prefix (vLLM's own prefix
    cache); `tokens` are the whole pages of the prefix up to the end of the hit, and
    `block_ids[i]` is the block of page i. The worker's lookup lease for `req_id` keeps
    the pages until the load is done."""

    req_id: str
    tokens: bytes
    block_ids: tuple[int, ...]
    local_blocks: int

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
    """One step's work for every worker, in this order: `lookups` to start (request id ->
    packed tokens, whole blocks), `releases` (request ids whose lookup lease is no longer
    needed), `loads` before the forward, `saves` after it."""

    lookups: dict[str, bytes] = field(default_factory=dict)
    releases: list[str] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class RadixKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Lookups answered since the worker's last report: request id -> {tp rank: tokens}."""

    hits: dict[str, dict[int, int]] = field(default_factory=dict)

    def aggregate(self, other: "RadixKVWorkerMetadata") -> "RadixKVWorkerMetadata":
        merged = {req: dict(ranks) for req, ranks in self.hits.items()}
        for req, ranks in other.hits.items():
            merged.setdefault(req, {}).update(ranks)
        return RadixKVWorkerMetadata(merged)


__all__ = ["LoadSpec", "RadixKVMetadata", "RadixKVWorkerMetadata", "SaveSpec"]
