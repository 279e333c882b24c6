"""Operator views of a namespace: Stats and Inspect messages built from the core."""

from collections import deque

from radixkv.messages import layout_pb
from radixkv.v1 import radixkv_pb2 as pb

from ..core.invariants import state_digest
from .namespace import Namespace


def namespace_stats(ns: Namespace) -> pb.NamespaceStats:
    cache = ns.cache
    return pb.NamespaceStats(
        namespace=ns.name, layout=layout_pb(ns.layout),
        write_policy=ns.config.cache.write_policy.value, eviction_policy=ns.config.cache.eviction_policy,
        attached=ns.attached, nodes=len(cache.tree.nodes) - len(cache.tree.roots),
        device_pages=cache.device.num_pages, device_pages_held=cache.device.num_held,
        device_pages_evictable=cache.evictable_pages, device_pages_protected=cache.protected_pages,
        host_pages_used=cache.host.num_used, host_pages_capacity=cache.host.capacity,
        host_page_bytes=ns.host_pool.layout.page_bytes, transfers_in_flight=len(cache.transfers),
        pinned_nodes=cache.pinned_nodes,
        tracked_duplicates=len(cache.duplicates), counters=ns.counters(), tp_size=ns.config.tp_size,
        ranks_missing=ns.group.missing() if ns.group is not None else [])


def inspect_namespace(ns: Namespace, max_nodes: int) -> pb.InspectResponse:
    """Totals over the whole tree, and the first `max_nodes` nodes breadth-first."""
    cache = ns.cache
    out = pb.InspectResponse()
    queue = deque((root, 0) for root in cache.tree.roots.values())
    while queue:
        node, depth = queue.popleft()
        queue.extend((c, depth + 1) for c in node.children.values())
        if node.parent is None:
            continue
        s = node.full
        out.total_nodes += 1
        out.max_depth = max(out.max_depth, depth)
        out.device_nodes += s.device_pages is not None
        out.host_nodes += s.host_pages is not None
        out.duplicate_nodes += node in cache.duplicates
        if len(out.nodes) < max_nodes:
            out.nodes.append(pb.NodeInfo(
                id=node.id, parent=node.parent.id, depth=depth, tokens=len(node.key) // 4,
                on_device=s.device_pages is not None, on_host=s.host_pages is not None,
                lock_ref=s.lock_ref, host_lock=s.host_lock, pins=sorted(s.pins), backup=s.backup or 0,
                evicting=s.evicting, hit_count=node.hit_count, extra_key=node.extra_key))
        else:
            out.truncated = True
    out.digest = state_digest(cache)
    return out
