"""The residency seam: who hears when a node's pages enter or leave a tier.

The KV-events feature (per-tier stored / removed events for routers) builds on this; the
core only reports. `CacheState` calls its listener from the primitives that change
residency, so no operation can change a tier without the listener hearing of it.
"""

from typing import Literal, Protocol

from .node import Node

Tier = Literal["device", "host", "storage"]
Change = Literal["stored", "removed"]


class ResidencyListener(Protocol):
    """Told of every change of where a node's pages live, one call per node and tier.

    The cache's default listener is None: no call at all, so the seam costs one `is None`
    test per change when nobody listens.

    When each call comes:
    - ("device", "stored"): device pages published in the tree (an insert, or a load-back
      at its start: the bytes may still be arriving; a failed load is removed again).
    - ("device", "removed"): device eviction, a finished write-back, a failed load-back's
      pages taken out of the tree, or the engine gone (`drop_device`: one call per node).
    - ("host", "stored"): a host copy became valid: its backup or write-back copy
      finished, or pages fetched from storage joined the tree (fetched pages count as
      host stored, not storage stored: storage held them already).
    - ("host", "removed"): a settled duplicate's host copy reclaimed, or a node with a
      valid host copy left the tree (host eviction, after a store where storage is on).
    - ("storage", "stored"): a store of the node's pages completed successfully.
    - ("storage", "removed"): the store may have lost what it held (a restarted server:
      `HierarchicalCache.storage_lost`); evictions inside the store go unseen.
    A split reports nothing: the same pages stay resident, now under two nodes.

    Contract: called synchronously from inside a cache operation, with the node as it is
    at that moment (still linked to its parent on "removed"). A listener reads what it
    needs (`node.path()`, `node.key`, `node.extra_key`) before returning, must not call
    back into the cache, and must not raise.
    """

    def residency_changed(self, tier: Tier, change: Change, node: Node) -> None:
        """Record one change; see the class docstring for when each comes."""


__all__ = ["Change", "ResidencyListener", "Tier"]
