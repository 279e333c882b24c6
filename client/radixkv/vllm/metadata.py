"""What the two sides of the connector tell each other through vLLM, every step.

`RadixKVMetadata` goes from the scheduler to every worker (pickled by vLLM with the step);
`RadixKVWorkerMetadata` comes back from each worker, merged across workers by `aggregate`,
to the scheduler's `update_connector_output`. The scheduler looks prefixes up on its own
daemon session (`radixkv.vllm.lookups`); the workers load, save and report their loads.

Block ids are vLLM's, which are also the page numbers the daemon was registered with.
Tokens travel packed (little-endian int32 bytes), as the daemon takes them.
"""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Load a radixkv hit into a request's blocks before this step's forward.

    The request's first `local_blocks` blocks already hold its prefix (vLLM's own prefix
    cache); `block_ids[i]` is the block of page i, up to the end of the hit. `node` is the
    daemon's host node the scheduler's Match ended at and `lease` that Match's lease (the
    scheduler's session), which keeps the pages until every rank reported the load."""

    req_id: str
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
    pages from the start of the request, as radixkv keys them) in `block_ids`, page i in
    block i, under the request's `extra_key` (`request_keys`)."""

    req_id: str
    tokens: bytes
    block_ids: tuple[int, ...]
    extra_key: bytes = b""


@dataclass
class RadixKVMetadata(KVConnectorMetadata):
    """One step's work for every worker: `flush` (request ids preempted this step: their
    saves in flight must finish before the forward, which may reuse their blocks), `loads`
    before the forward, `saves` after it, and `delayed` (finished requests whose blocks
    vLLM keeps until every worker lists them in `get_finished`). `early_loads`: the loads
    may start as the step begins, before vLLM prepares the forward (the step neither
    zeroes nor copies blocks meanwhile)."""

    flush: list[str] = field(default_factory=list)
    delayed: list[str] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    early_loads: bool = False


@dataclass
class RadixKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Since the worker's last report: loads it finished (request id -> {tp rank: pages
    loaded}), saves and held loads that are over (request id -> {tp rank: count}), and
    loads it stopped waiting for, which the daemon may still be writing (request id ->
    {tp rank: count}: `Saves.hold`)."""

    loaded: dict[str, dict[int, int]] = field(default_factory=dict)
    saved: dict[str, dict[int, int]] = field(default_factory=dict)
    held: dict[str, dict[int, int]] = field(default_factory=dict)

    def aggregate(self, other: "RadixKVWorkerMetadata") -> "RadixKVWorkerMetadata":
        return RadixKVWorkerMetadata(_merge(self.loaded, other.loaded), _merge(self.saved, other.saved),
                                     _merge(self.held, other.held))


def _merge(a: dict[str, dict[int, int]], b: dict[str, dict[int, int]]) -> dict[str, dict[int, int]]:
    merged = {req: dict(ranks) for req, ranks in a.items()}
    for req, ranks in b.items():
        merged.setdefault(req, {}).update(ranks)
    return merged


__all__ = ["LoadSpec", "RadixKVMetadata", "RadixKVWorkerMetadata", "SaveSpec"]
