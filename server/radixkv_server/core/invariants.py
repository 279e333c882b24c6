"""check_invariants: every property the cache promises, recomputed from scratch.

Slow (walks the whole tree) and side-effect free. Run after every operation in the
randomized tests, and by operators through the CheckInvariants RPC. One check per tier:
the tree's structure, device residency, host residency, locks and copies per node, the
derived sets (duplicates, evictable leaves), the transfers and their pins, and the two
pools (device ledger, host allocator).

Each function takes the cache's state (a `CacheState`, or the `HierarchicalCache`
facade, which exposes the same names) and appends one line per violation to `err`.
"""

import hashlib
from dataclasses import dataclass, field
from typing import Callable

from .node import Node
from .pages import count, unpack
from .transfers import TransferKind

Report = Callable[[str], None]


@dataclass
class _Seen:
    """What the walk over the tree found, for the checks that compare totals."""

    device: dict[int, int] = field(default_factory=dict)  # device page -> node id
    host: dict[int, int] = field(default_factory=dict)    # host page -> node id (-transfer: fetch)
    parked: set[int] = field(default_factory=set)         # device pages parked by failed loads
    evictable: int = 0
    protected: int = 0
    reserved: int = 0


def check_invariants(state) -> list[str]:
    """Every violated invariant, one line each; empty when the state is sound."""
    errors: list[str] = []
    err = errors.append
    seen = _Seen()
    for node in state.tree.nodes.values():
        if node.parent is None:
            if state.tree.roots.get(node.extra_key) is not node:
                err(f"root {node.id} is not the root of its extra_key")
            continue
        _check_structure(state.tree, node, err)
        _check_device(state.tree, node, seen, err)
        _check_host(state.tree, node, seen, err)
        _check_locks_and_copies(state.transfers, node, err)
    pinned = sum(1 for node in state.tree.nodes.values() if node.full.pins)
    if state.pinned_nodes != pinned:
        err(f"pinned nodes counted {state.pinned_nodes}, actual {pinned}")
    _check_sets(state, err)
    _check_transfers(state, seen, err)
    _check_device_pool(state, seen, err)
    _check_host_pool(state, seen, err)
    return errors


# -- per node ------------------------------------------------------------------------


def _check_structure(tree, node: Node, err: Report) -> None:
    nid = node.id
    if not node.key or len(node.key) % tree.stride:
        err(f"node {nid}: key of {len(node.key)} bytes is not whole pages")
    if node.parent.children.get(node.key[:tree.stride]) is not node:
        err(f"node {nid}: not linked from its parent {node.parent.id}")
    if tree.nodes.get(node.parent.id) is not node.parent:
        err(f"node {nid}: parent {node.parent.id} is not in the tree")
    if node.full.device_pages is None and node.full.host_pages is None:
        err(f"node {nid}: holds no pages on any tier")


def _check_device(tree, node: Node, seen: _Seen, err: Report) -> None:
    s, nid = node.full, node.id
    dev_children = sum(1 for c in node.children.values() if c.full.device_pages is not None)
    if dev_children != node.device_children:
        err(f"node {nid}: device_children {node.device_children}, actual {dev_children}")
    if s.device_pages is None:
        return
    pages = tree.pages_of(node)
    if count(s.device_pages) != pages:
        err(f"node {nid}: {count(s.device_pages)} device pages for {pages} pages of tokens")
    if node.parent.parent is not None and node.parent.full.device_pages is None:
        err(f"node {nid}: on device but parent {node.parent.id} is not")
    for p in unpack(s.device_pages):
        if p in seen.device:
            err(f"device page {p} held by nodes {seen.device[p]} and {nid}")
        seen.device[p] = nid
    if s.lock_ref > 0:
        seen.protected += pages
    else:
        seen.evictable += pages


def _check_host(tree, node: Node, seen: _Seen, err: Report) -> None:
    s, nid = node.full, node.id
    if s.host_pages is None:
        return
    pages = tree.pages_of(node)
    if count(s.host_pages) != pages:
        err(f"node {nid}: {count(s.host_pages)} host pages for {pages} pages of tokens")
    for p in unpack(s.host_pages):
        if p in seen.host:
            err(f"host page {p} held by nodes {seen.host[p]} and {nid}")
        seen.host[p] = nid


def _check_locks_and_copies(transfers, node: Node, err: Report) -> None:
    s, nid = node.full, node.id
    if s.lock_ref < 0 or s.host_lock < 0:
        err(f"node {nid}: negative lock count (lock_ref {s.lock_ref}, host_lock {s.host_lock})")
    if node.parent.parent is not None and node.parent.full.lock_ref < s.lock_ref:
        err(f"node {nid}: lock_ref {s.lock_ref} exceeds its parent's {node.parent.full.lock_ref}")
    expected_host_lock = (s.backup is not None) + len(s.pins) + (s.store is not None)
    if s.host_lock != expected_host_lock:
        err(f"node {nid}: host_lock {s.host_lock}, but {expected_host_lock} copies use its host pages")
    if s.backup is not None:
        t = transfers.get(s.backup)
        if t is None or t.kind is TransferKind.LOAD or node not in t.nodes:
            err(f"node {nid}: backup names transfer {s.backup}, which does not copy it")
        if s.host_pages is None or s.device_pages is None:
            err(f"node {nid}: backup in flight without both copies")
    if s.evicting and s.backup is None:
        err(f"node {nid}: evicting without a write-back in flight")
    if s.store is not None:
        t = transfers.get(s.store)
        if t is None or t.kind is not TransferKind.STORE or node not in t.nodes:
            err(f"node {nid}: store names transfer {s.store}, which does not store it")
        if not s.host_valid:
            err(f"node {nid}: storing a host copy that is not valid")
    if s.evicting_host and s.store is None:
        err(f"node {nid}: leaving the host without a store in flight")
    _check_pins(transfers, node, err)


def _check_pins(transfers, node: Node, err: Report) -> None:
    for tid in node.full.pins:
        t = transfers.get(tid)
        if t is None:
            err(f"node {node.id}: pin names finished transfer {tid}")
        elif t.kind not in _PINNING or (node not in t.nodes and node not in t.shared):
            err(f"node {node.id}: pin names transfer {tid}, which neither loads it nor depends on it")


# -- derived sets --------------------------------------------------------------------


def _check_sets(state, err: Report) -> None:
    """Tracked duplicates and evictable leaves equal what the tree says they are."""
    settled, device_leaves, host_leaves = set(), set(), set()
    for node in state.tree.iter_nodes():
        s = node.full
        if s.device_pages is not None and s.host_valid and not s.pins and s.host_lock == 0:
            settled.add(node.id)
        if (s.device_pages is not None and node.device_children == 0 and s.lock_ref == 0
                and s.backup is None and not s.pins):
            device_leaves.add(node.id)
        if (s.device_pages is None and s.host_pages is not None and not node.children
                and s.lock_ref == 0 and s.host_lock == 0 and not s.pins):
            host_leaves.add(node.id)
    tracked = state.duplicates.ids()
    for nid in sorted(settled - tracked):
        err(f"Duplicate missing: node {nid} is a settled duplicate but not tracked")
    for nid in sorted(tracked - settled):
        err(f"Duplicate stale: node {nid} is tracked but not a settled duplicate")
    for name, want, have in (("device", device_leaves, state.device_leaves.ids()),
                             ("host", host_leaves, state.host_leaves.ids())):
        if want != have:
            err(f"{name} evictable leaves: missing {sorted(want - have)}, stale {sorted(have - want)}")


# -- transfers and pins ----------------------------------------------------------------


def _check_transfers(state, seen: _Seen, err: Report) -> None:
    room = [tid for tid, t in state.transfers.items()
            if t.kind is TransferKind.STORE and any(n.full.evicting_host for n in t.nodes)]
    if list(state.room_stores) != room:
        err(f"stores freeing host room {list(state.room_stores)}, recomputed {room}")
    for tid, t in state.transfers.items():
        if t.kind is TransferKind.LOAD:
            _check_load(state.tree, tid, t, seen, err)
        elif t.kind is TransferKind.STORE:
            for n in t.nodes:
                if n.full.store != tid:
                    err(f"transfer {tid}: stores node {n.id}, whose store is {n.full.store}")
        elif t.kind in (TransferKind.SAVE, TransferKind.ENGINE_LOAD):
            _check_engine_copy(state.tree, tid, t, err)
        elif t.kind is TransferKind.FETCH:
            seen.reserved += count(t.host_pages)
            for p in unpack(t.host_pages):
                if p in seen.host:
                    err(f"host page {p} reserved by fetch {tid} is held by node {seen.host[p]}")
                seen.host[p] = -tid
        else:
            for n in t.nodes:
                if n.full.backup != tid:
                    err(f"transfer {tid}: copies node {n.id}, whose backup is {n.full.backup}")


_PINNING = (TransferKind.LOAD, TransferKind.SAVE, TransferKind.ENGINE_LOAD)


def _check_engine_copy(tree, tid: int, t, err: Report) -> None:
    """An engine-managed save or load pins the nodes it copies until its copy is done
    (a save) or its ack (a load); it never touches a device residency."""
    pinned = not t.copied or t.kind is TransferKind.ENGINE_LOAD
    for n in t.nodes:
        if (tid in n.full.pins) != pinned:
            err(f"transfer {tid} ({t.kind.value}): node {n.id} pinned {tid in n.full.pins}, expected {pinned}")
        if n.id not in tree.nodes:
            err(f"transfer {tid}: node {n.id} left the tree")


def _check_load(tree, tid: int, t, seen: _Seen, err: Report) -> None:
    for n in (*t.shared, *t.nodes):
        if tid not in n.full.pins:
            err(f"transfer {tid}: uses node {n.id} without pinning it")
        if n.id not in tree.nodes:
            err(f"transfer {tid}: node {n.id} left the tree")
    if t.anchor is not None and t.anchor.full.lock_ref <= 0:
        err(f"transfer {tid}: anchor {t.anchor.id} is not locked")
    if t.error is None and t.parked:
        err(f"transfer {tid}: parked pages without an error")
    for p in unpack(t.parked):
        if p in seen.device or p in seen.parked:
            err(f"device page {p} parked by transfer {tid} is held elsewhere too")
        seen.parked.add(p)


# -- pools -----------------------------------------------------------------------------


def _check_device_pool(state, seen: _Seen, err: Report) -> None:
    ledger = state.device
    held = set(seen.device) | seen.parked
    if ledger.held_pages() != held:
        diff = ledger.held_pages() ^ held
        err(f"device ledger disagrees with the tree on pages {sorted(diff)[:10]}")
    if ledger.num_held != len(held):
        err(f"device ledger counts {ledger.num_held} held pages, the tree holds {len(held)}")
    if ledger.num_held + ledger.num_returned != ledger.num_taken:
        err(f"device pages: held {ledger.num_held} + returned {ledger.num_returned} != taken {ledger.num_taken}")
    if (state.evictable_pages, state.protected_pages) != (seen.evictable, seen.protected):
        err(f"device evictable/protected pages {state.evictable_pages}/{state.protected_pages}, "
            f"actual {seen.evictable}/{seen.protected}")


def _check_host_pool(state, seen: _Seen, err: Report) -> None:
    host = state.host
    free = host.free_pages()
    if len(set(free)) != len(free):
        err("host free list names a page twice")
    if set(free) & set(seen.host):
        err(f"host pages both free and used: {sorted(set(free) & set(seen.host))[:10]}")
    if host.num_free + len(seen.host) != host.capacity:
        err(f"host pages: free {host.num_free} + held {len(seen.host)} (reserved {seen.reserved}) "
            f"!= capacity {host.capacity}")
    if seen.reserved != state.host_reserved:
        err(f"host pages reserved by fetches: counted {state.host_reserved}, actual {seen.reserved}")


# -- digest ----------------------------------------------------------------------------


def state_digest(state) -> str:
    """A hash of everything a caller could observe: tree, residency, locks, pins,
    transfers, pools and counts. Equal digests mean equal states (for tests that check
    a refused request changed nothing)."""
    h = hashlib.sha256()
    for nid in sorted(state.tree.nodes):
        n = state.tree.nodes[nid]
        s = n.full
        h.update(repr((nid, n.parent.id if n.parent else 0, n.key, n.extra_key, s.device_pages,
                       s.host_pages, s.backup, s.evicting, s.lock_ref, s.host_lock, sorted(s.pins),
                       s.store, s.stored, s.evicting_host, n.hit_count, n.device_children)).encode())
    for tid in sorted(state.transfers):
        t = state.transfers[tid]
        h.update(repr((tid, t.kind.value, [n.id for n in t.nodes], [n.id for n in t.shared],
                       t.copied, t.error, t.parked, t.depends_on, list(t.dependents))).encode())
    h.update(repr((sorted(state.host.free_pages()), sorted(state.device.held_pages()),
                   state.device.num_taken, state.device.num_returned, state.evictable_pages,
                   state.host_reserved, state.protected_pages, sorted(state.duplicates.ids()),
                   sorted(state.device_leaves.ids()), sorted(state.host_leaves.ids()))).encode())
    return h.hexdigest()
