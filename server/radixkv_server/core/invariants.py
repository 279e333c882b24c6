"""check_invariants: every property the cache promises, recomputed from scratch.

Slow (walks the whole tree) and side-effect free. Run after every operation in the
randomized tests, and by operators through the CheckInvariants RPC.
"""

import hashlib

from .pages import count, unpack
from .transfers import TransferKind


def check_invariants(cache) -> list[str]:
    errors: list[str] = []
    err = errors.append
    tree = cache.tree
    stride = tree.stride

    settled, device_leaves, host_leaves = set(), set(), set()
    device_seen: dict[int, int] = {}
    host_seen: dict[int, int] = {}
    evictable = protected = 0

    for node in tree.nodes.values():
        if node.parent is None:
            if tree.roots.get(node.extra_key) is not node:
                err(f"root {node.id} is not the root of its extra_key")
            continue
        s = node.full
        nid = node.id
        if not node.key or len(node.key) % stride:
            err(f"node {nid}: key of {len(node.key)} bytes is not whole pages")
        if node.parent.children.get(node.key[:stride]) is not node:
            err(f"node {nid}: not linked from its parent {node.parent.id}")
        if tree.nodes.get(node.parent.id) is not node.parent:
            err(f"node {nid}: parent {node.parent.id} is not in the tree")
        pages = cache._pages(node)
        dev_children = sum(1 for c in node.children.values() if c.full.device_pages is not None)
        if dev_children != node.device_children:
            err(f"node {nid}: device_children {node.device_children}, actual {dev_children}")
        if s.device_pages is None and s.host_pages is None:
            err(f"node {nid}: holds no pages on any tier")
        if s.device_pages is not None:
            if count(s.device_pages) != pages:
                err(f"node {nid}: {count(s.device_pages)} device pages for {pages} pages of tokens")
            if node.parent.parent is not None and node.parent.full.device_pages is None:
                err(f"node {nid}: on device but parent {node.parent.id} is not")
            for p in unpack(s.device_pages):
                if p in device_seen:
                    err(f"device page {p} held by nodes {device_seen[p]} and {nid}")
                device_seen[p] = nid
            if s.lock_ref > 0:
                protected += pages
            else:
                evictable += pages
        if s.host_pages is not None:
            if count(s.host_pages) != pages:
                err(f"node {nid}: {count(s.host_pages)} host pages for {pages} pages of tokens")
            for p in unpack(s.host_pages):
                if p in host_seen:
                    err(f"host page {p} held by nodes {host_seen[p]} and {nid}")
                host_seen[p] = nid
        if s.lock_ref < 0 or s.host_lock < 0:
            err(f"node {nid}: negative lock count (lock_ref {s.lock_ref}, host_lock {s.host_lock})")
        if node.parent.parent is not None and node.parent.full.lock_ref < s.lock_ref:
            err(f"node {nid}: lock_ref {s.lock_ref} exceeds its parent's {node.parent.full.lock_ref}")
        expected_host_lock = (s.backup is not None) + len(s.pins) + (s.store is not None)
        if s.host_lock != expected_host_lock:
            err(f"node {nid}: host_lock {s.host_lock}, but {expected_host_lock} copies use its host pages")
        if s.backup is not None:
            t = cache.transfers.get(s.backup)
            if t is None or t.kind is TransferKind.LOAD or node not in t.nodes:
                err(f"node {nid}: backup names transfer {s.backup}, which does not copy it")
            if s.host_pages is None or s.device_pages is None:
                err(f"node {nid}: backup in flight without both copies")
        if s.evicting and s.backup is None:
            err(f"node {nid}: evicting without a write-back in flight")
        if s.store is not None:
            t = cache.transfers.get(s.store)
            if t is None or t.kind is not TransferKind.STORE or node not in t.nodes:
                err(f"node {nid}: store names transfer {s.store}, which does not store it")
            if not s.host_valid:
                err(f"node {nid}: storing a host copy that is not valid")
        if s.evicting_host and s.store is None:
            err(f"node {nid}: leaving the host without a store in flight")
        for tid in s.pins:
            t = cache.transfers.get(tid)
            if t is None:
                err(f"node {nid}: pin names finished transfer {tid}")
            elif t.kind is not TransferKind.LOAD or (node not in t.nodes and node not in t.shared):
                err(f"node {nid}: pin names transfer {tid}, which neither loads it nor depends on it")
        if s.device_pages is not None and s.host_valid and not s.pins:
            settled.add(nid)
        if (s.device_pages is not None and node.device_children == 0 and s.lock_ref == 0
                and s.backup is None and not s.pins):
            device_leaves.add(nid)
        if (s.device_pages is None and s.host_pages is not None and not node.children
                and s.lock_ref == 0 and s.host_lock == 0 and not s.pins):
            host_leaves.add(nid)

    tracked = cache.duplicates.ids()
    for nid in sorted(settled - tracked):
        err(f"Duplicate missing: node {nid} is a settled duplicate but not tracked")
    for nid in sorted(tracked - settled):
        err(f"Duplicate stale: node {nid} is tracked but not a settled duplicate")
    for name, want, have in (("device", device_leaves, cache.device_leaves.ids()),
                             ("host", host_leaves, cache.host_leaves.ids())):
        if want != have:
            err(f"{name} evictable leaves: missing {sorted(want - have)}, stale {sorted(have - want)}")

    parked: set[int] = set()
    reserved = 0
    for tid, t in cache.transfers.items():
        if t.kind is TransferKind.LOAD:
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
                if p in device_seen or p in parked:
                    err(f"device page {p} parked by transfer {tid} is held elsewhere too")
                parked.add(p)
        elif t.kind is TransferKind.STORE:
            for n in t.nodes:
                if n.full.store != tid:
                    err(f"transfer {tid}: stores node {n.id}, whose store is {n.full.store}")
        elif t.kind is TransferKind.FETCH:
            reserved += count(t.host_pages)
            for p in unpack(t.host_pages):
                if p in host_seen:
                    err(f"host page {p} reserved by fetch {tid} is held by node {host_seen[p]}")
                host_seen[p] = -tid
        else:
            for n in t.nodes:
                if n.full.backup != tid:
                    err(f"transfer {tid}: copies node {n.id}, whose backup is {n.full.backup}")

    ledger = cache.device
    held = set(device_seen) | parked
    if ledger.held_pages() != held:
        diff = ledger.held_pages() ^ held
        err(f"device ledger disagrees with the tree on pages {sorted(diff)[:10]}")
    if ledger.num_held != len(held):
        err(f"device ledger counts {ledger.num_held} held pages, the tree holds {len(held)}")
    if ledger.num_held + ledger.num_returned != ledger.num_taken:
        err(f"device pages: held {ledger.num_held} + returned {ledger.num_returned} != taken {ledger.num_taken}")
    if (cache.evictable_pages, cache.protected_pages) != (evictable, protected):
        err(f"device evictable/protected pages {cache.evictable_pages}/{cache.protected_pages}, "
            f"actual {evictable}/{protected}")

    host = cache.host
    free = host.free_pages()
    if len(set(free)) != len(free):
        err("host free list names a page twice")
    if set(free) & set(host_seen):
        err(f"host pages both free and used: {sorted(set(free) & set(host_seen))[:10]}")
    if host.num_free + len(host_seen) != host.capacity:
        err(f"host pages: free {host.num_free} + held {len(host_seen)} (reserved {reserved}) "
            f"!= capacity {host.capacity}")
    if reserved != cache.host_reserved:
        err(f"host pages reserved by fetches: counted {cache.host_reserved}, actual {reserved}")
    return errors


def state_digest(cache) -> str:
    """A hash of everything a caller could observe: tree, residency, locks, pins,
    transfers, pools and counts. Equal digests mean equal states (for tests that check
    a refused request changed nothing)."""
    h = hashlib.sha256()
    for nid in sorted(cache.tree.nodes):
        n = cache.tree.nodes[nid]
        s = n.full
        h.update(repr((nid, n.parent.id if n.parent else 0, n.key, n.extra_key, s.device_pages,
                       s.host_pages, s.backup, s.evicting, s.lock_ref, s.host_lock, sorted(s.pins),
                       s.store, s.stored, s.evicting_host, n.hit_count, n.device_children)).encode())
    for tid in sorted(cache.transfers):
        t = cache.transfers[tid]
        h.update(repr((tid, t.kind.value, [n.id for n in t.nodes], [n.id for n in t.shared],
                       t.copied, t.error, t.parked, t.depends_on, t.dependents)).encode())
    h.update(repr((sorted(cache.host.free_pages()), sorted(cache.device.held_pages()),
                   cache.device.num_taken, cache.device.num_returned, cache.evictable_pages, cache.host_reserved,
                   cache.protected_pages, sorted(cache.duplicates.ids()),
                   sorted(cache.device_leaves.ids()), sorted(cache.host_leaves.ids()))).encode())
    return h.hexdigest()
