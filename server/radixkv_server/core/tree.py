"""The radix tree's structure: nodes, walking a prompt, splitting and removing nodes.

Keys are packed int32 token bytes, always whole pages. Children are keyed by the bytes
of their first page, so one dict lookup and one slice comparison per node match a run.
Each `extra_key` (LoRA id, cache salt) has a root of its own. Residency bookkeeping is
the cache's; `split` copies a node's state to its new upper half and nothing more.
"""

from .errors import UnknownNode
from .ids import fresh_ids
from .node import NO_CHILDREN, NO_PINS, Node


class RadixTree:
    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.stride = page_size * 4  # bytes of one page of tokens
        self.roots: dict[bytes, Node] = {}
        self.nodes: dict[int, Node] = {}
        self._ids = fresh_ids()
        self._emptied: list[Node] = []  # roots of an extra_key whose last child left

    def root(self, extra_key: bytes) -> Node:
        """The root for `extra_key`, created on first use. Here, where no caller holds a
        root, the roots of extra keys whose last node left are dropped (one per LoRA id
        or cache salt ever seen would otherwise stay); the b"" root always stays."""
        if self._emptied:
            self._drop_emptied()
        root = self.roots.get(extra_key)
        if root is None:
            root = Node(next(self._ids), None, b"", extra_key)
            self.roots[extra_key] = root
            self.nodes[root.id] = root
        return root

    def get(self, node_id: int) -> Node:
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNode(f"node {node_id} is not in the cache (evicted or never existed); match again")
        return node

    def pages_of(self, node: Node) -> int:
        return len(node.key) // self.stride

    def walk(self, root: Node, tokens: bytes) -> tuple[list[Node], Node | None, int]:
        """Follow page-aligned `tokens` down from `root`. Changes nothing.

        Returns the fully matched nodes (top-down), then the next node if the prompt
        matches only its first `k` pages (0 < k < its length), else (None, 0).
        """
        stride = self.stride
        end = len(tokens)
        path: list[Node] = []
        node, off = root, 0
        while off < end:
            child = node.children.get(tokens[off:off + stride])
            if child is None:
                break
            key = child.key
            klen = len(key)
            if off + klen <= end and tokens[off:off + klen] == key:
                path.append(child)
                node, off = child, off + klen
                continue
            # Partial: the first page matched; binary-search the longest equal run.
            lo, hi = 1, min(klen, end - off) // stride
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if tokens[off:off + mid * stride] == key[:mid * stride]:
                    lo = mid
                else:
                    hi = mid - 1
            return path, child, lo
        return path, None, 0

    def add_child(self, parent: Node, key: bytes) -> Node:
        node = Node(next(self._ids), parent, key, parent.extra_key)
        if not parent.children:
            parent.children = {}
        parent.children[key[:self.stride]] = node
        self.nodes[node.id] = node
        return node

    def split(self, node: Node, pages: int) -> Node:
        """Cut `node` after `pages` pages. A new node takes the first part and becomes
        `node`'s parent; `node` keeps its id (and its leases, anchors) for the rest.
        The new node inherits locks, pins and in-flight state of the whole."""
        cut = pages * self.stride
        parent = node.parent
        top = Node(next(self._ids), parent, node.key[:cut], node.extra_key)
        parent.children[node.key[:self.stride]] = top
        node.key = node.key[cut:]
        node.parent = top
        top.children = {node.key[:self.stride]: node}
        self.nodes[top.id] = top

        s, t = node.full, top.full
        n = pages * 4
        if s.device_pages is not None:
            t.device_pages, s.device_pages = s.device_pages[:n], s.device_pages[n:]
            top.device_children = 1
        if s.host_pages is not None:
            t.host_pages, s.host_pages = s.host_pages[:n], s.host_pages[n:]
        t.backup = s.backup
        t.evicting = s.evicting
        t.lock_ref = s.lock_ref
        t.host_lock = s.host_lock
        t.pins = set(s.pins) if s.pins else NO_PINS
        t.store = s.store
        t.stored = s.stored
        t.evicting_host = s.evicting_host
        t.shards_missing = s.shards_missing
        top.hit_count = node.hit_count
        top.last_access = node.last_access
        return top

    def unlink_all(self) -> None:
        """Forget every node, each unlinked from the others: the tree is empty after. A
        parent and its children refer to each other, so a tree merely dropped is freed only
        by a full garbage collection, which may come much later; unlinked, each node goes
        as its last holder lets go."""
        for node in self.nodes.values():
            node.parent = None
            node.children = NO_CHILDREN
        self.nodes.clear()
        self.roots.clear()
        self._emptied.clear()

    def remove(self, node: Node) -> None:
        """Unlink a childless node. A root it leaves empty stays until the next `root`
        call (the operation removing it may still hold that root)."""
        parent = node.parent
        del parent.children[node.key[:self.stride]]
        if not parent.children:
            parent.children = NO_CHILDREN
        del self.nodes[node.id]
        if parent.parent is None and not parent.children and parent.extra_key:
            self._emptied.append(parent)

    def _drop_emptied(self) -> None:
        for root in self._emptied:
            if not root.children and self.roots.get(root.extra_key) is root:
                del self.roots[root.extra_key]
                del self.nodes[root.id]
        self._emptied.clear()

    def newest_id(self) -> int:
        """The id of the newest node (0 in an empty tree): ids grow with creation and
        `nodes` keeps creation order, so a node with a larger id was made later."""
        return next(reversed(self.nodes), 0)

    def iter_nodes(self):
        """Every non-root node (unordered)."""
        return (n for n in self.nodes.values() if n.parent is not None)
