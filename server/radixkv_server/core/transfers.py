"""Copies in flight between the device and the host, as the cache tracks them."""

import enum
from dataclasses import dataclass, field

from .node import Node


class TransferKind(enum.Enum):
    LOAD = "load"              # host -> device (load-back); finished by the engine's ACK
    BACKUP = "backup"          # device -> host (write-through); settles on completion
    WRITE_BACK = "write_back"  # device -> host before the device pages are freed (eviction)
    STORE = "store"            # host -> storage
    FETCH = "fetch"            # storage -> host (prefetch into reserved host pages)
    SAVE = "save"              # engine-managed: engine pages -> host shard; finished by the ACK
    ENGINE_LOAD = "engine_load"  # engine-managed: host shard -> engine pages; finished by the ACK


@dataclass(eq=False)
class Transfer:
    """One copy the data path is running for the cache.

    `nodes` are the nodes whose pages it copies, top-down. A node split while the copy
    runs adds its new upper half here, so completion settles both halves.
    `device_pages` / `host_pages` are the packed page lists handed to the data path.

    Stores and fetches: `keys` are the pages' storage keys. A fetch has no nodes yet:
    its `host_pages` are reserved, and the pages of `tokens` from `start_page` on become
    host-only nodes when it completes.

    Load-backs only:
    - `anchor`: deepest loaded node; its path stays locked until the ACK.
    - `shared`: nodes above `nodes` that earlier loads were still filling when this one
      started; pinned (and host-locked) by this transfer too, since its prefix relies on
      their host copies until those loads finish.
    - `depends_on`: earlier load-backs, still copying at start, whose device pages this
      one's prefix uses; `dependents` is the reverse edge. A failure cascades along it.
    - `error`: why the load failed (its copy, or a dependency); then `parked` holds the
      device pages taken out of the tree, returned to the engine at the ACK.
    """

    id: int
    kind: TransferKind
    nodes: list[Node]
    device_pages: bytes
    host_pages: bytes
    anchor: Node | None = None
    shared: list[Node] = field(default_factory=list)
    depends_on: tuple[int, ...] = ()
    dependents: dict[int, None] = field(default_factory=dict)  # an ordered set: acks in any order cost O(1)
    copied: bool = False
    error: str | None = None
    parked: bytes = b""
    owner: object = None
    keys: list[bytes] = field(default_factory=list)
    tokens: bytes = b""
    extra_key: bytes = b""
    start_page: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.device_pages) // 4
