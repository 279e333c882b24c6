"""A radix-tree node and its per-component residency record.

radixkv caches FULL attention KV only for now. Residency, locks and pins live in a
`ComponentState` (one per component) rather than on the node, so sliding-window and Mamba
state can be added later as further components without reshaping the tree.
"""

from dataclasses import dataclass
from types import MappingProxyType

# Shared empty values: most nodes have no pin and leaves no child, and an empty set or dict
# per node would cost ~200 and ~64 bytes and one more object for every full garbage
# collection to scan. Only `CacheState.pin`/`unpin` and `RadixTree` replace them.
NO_PINS: frozenset[int] = frozenset()
NO_CHILDREN = MappingProxyType({})


@dataclass(slots=True, eq=False)
class ComponentState:
    """Where one component of a node's KV lives, and what protects it.

    - `device_pages`: packed device page indices, one per page of the node's key, or None.
    - `host_pages`: packed host page indices, or None. While `backup` is set they are
      allocated but not yet valid (the device->host copy is in flight).
    - `backup`: id of the device->host transfer filling `host_pages`.
    - `evicting`: the device copy leaves once `backup` completes (write-back eviction).
      An evicting node is invisible to match and load-back.
    - `lock_ref`: leases and unacknowledged load-backs; >0 means never evicted.
      Kept path-wise: locking a node locks every ancestor.
    - `host_lock`: in-flight copies reading or writing `host_pages`; >0 means the host
      copy may not be freed.
    - `pins`: ids of load-back transfers reading this node's host pages (a set: several
      may overlap; the shared empty `NO_PINS` when none). A pinned node is not a settled duplicate.
    - `store`: id of the host->storage transfer reading `host_pages`; `stored`: the
      storage tier holds this node's pages; `evicting_host`: the host copy leaves once
      `store` completes (host eviction with storage write-back).
    - `shards_missing` (engine-managed namespaces): bitmask of tensor-parallel ranks whose
      shard of `host_pages` has not arrived; the host copy is complete (matchable,
      storable) only at 0. Always 0 elsewhere, and for pages fetched from storage.
    """

    device_pages: bytes | None = None
    host_pages: bytes | None = None
    backup: int | None = None
    evicting: bool = False
    lock_ref: int = 0
    host_lock: int = 0
    pins: set[int] | frozenset[int] = NO_PINS
    store: int | None = None
    stored: bool = False
    evicting_host: bool = False
    shards_missing: int = 0

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def host_valid(self) -> bool:
        """A host copy exists and its bytes have arrived."""
        return self.host_pages is not None and self.backup is None


class Node:
    """One run of whole pages. `key` is the packed tokens; `children` maps the first
    page's bytes of each child to the child (the shared, read-only `NO_CHILDREN` for a
    node without one: only `RadixTree` changes children). A root has an empty key and no pages."""

    __slots__ = (
        "id", "parent", "key", "children", "extra_key", "full",
        "hit_count", "last_access", "device_children", "chain", "event_path",
    )

    def __init__(self, node_id: int, parent: "Node | None", key: bytes, extra_key: bytes):
        self.id = node_id
        self.parent = parent
        self.key = key
        self.children: dict[bytes, Node] | MappingProxyType = NO_CHILDREN
        self.extra_key = extra_key
        self.full = ComponentState()
        self.hit_count = 0
        self.last_access = 0
        self.device_children = 0  # children whose FULL component is on device
        self.chain: bytes | None = None  # storage key of the last page, computed on demand
        self.event_path: tuple | None = None  # the KV-event layer's record of the path (events/hub.py)

    def path(self) -> list["Node"]:
        """Nodes from this one up to (excluding) the root, deepest first."""
        out = []
        node = self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out

    def __repr__(self) -> str:
        s = self.full
        return (
            f"Node({self.id}, tokens={len(self.key) // 4}, dev={s.on_device}, "
            f"host={s.host_pages is not None}, lock={s.lock_ref}, pins={sorted(s.pins)})"
        )
