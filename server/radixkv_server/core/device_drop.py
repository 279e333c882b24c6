"""Dropping the whole device tier: the engine that owned the device pages is gone (its
Close, or a Register replacing it). Host copies stay; a node without one leaves the tree
with every node below it. Walks are iterative: a path may be thousands of nodes deep, one
per turn of a conversation or chunk of a prefill."""

from .node import Node
from .state import CacheState
from .transfers import TransferKind


def waits_for(state: CacheState) -> list[int]:
    """The transfers `drop` needs finished first: see `HierarchicalCache.device_drop_waits_for`."""
    doomed = None
    waits = []
    for tid, t in state.transfers.items():
        if t.kind is TransferKind.FETCH:
            continue
        if t.kind is TransferKind.STORE:
            if doomed is None:
                doomed = dropped_nodes(state)
            if not any(node in doomed for node in t.nodes):
                continue
        waits.append(tid)
    return waits


def dropped_nodes(state: CacheState) -> set[Node]:
    """The nodes `drop` would remove: each with no host copy, and every node below it."""
    doomed: set[Node] = set()
    todo = [child for root in state.tree.roots.values() for child in root.children.values()]
    while todo:
        node = todo.pop()
        if node.full.host_pages is None:
            doomed.update(_preorder(node))
        else:
            todo.extend(node.children.values())
    return doomed


def drop(state: CacheState) -> int:
    """Forget every device page (the ledger is the caller's to replace). Device-only
    nodes leave with the host-only nodes below them; host copies stay. Returns the tokens
    dropped from the tree. No transfer but stores of nodes it keeps may be in flight
    (`waits_for`)."""
    dropped = 0
    for root in state.tree.roots.values():
        for node in list(root.children.values()):
            dropped += _drop_below(state, node)
    return dropped


def _drop_below(state: CacheState, top: Node) -> int:
    """Children before their parent: each node leaves the device tier, and one without a
    host copy leaves with what is still below it."""
    dropped = 0
    for node in reversed(_preorder(top)):
        s = node.full
        if s.device_pages is not None:
            state.clear_device(node)
        if s.host_pages is None:
            below = _preorder(node)
            dropped += sum(state.tokens(n) for n in below)
            for n in reversed(below):  # leaves first
                state.remove_node(n)
    return dropped


def _preorder(top: Node) -> list[Node]:
    """`top` and every node below it, each before its children."""
    out, todo = [], [top]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(node.children.values())
    return out
