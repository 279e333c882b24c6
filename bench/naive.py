"""The baseline: a radix tree written the naive way, "what an in-process cache does".

Keys and values are Python lists of ints; children are keyed by a tuple of their first
page; a run is matched by comparing token by token (SGLang's `RadixCache._key_match` for
page_size 1). Eviction scans the whole tree for leaves on every call and heapifies them
(SGLang's `evict` before its evictable-leaf set). Device residency only: no tiers.
"""

import heapq


class NaiveNode:
    __slots__ = ("children", "parent", "key", "value", "last_access")

    def __init__(self, parent, key: list[int], value: list[int]):
        self.children: dict[tuple, NaiveNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.last_access = 0


def key_match(key0: list[int], key1: list[int]) -> int:
    i = 0
    for a, b in zip(key0, key1):
        if a != b:
            break
        i += 1
    return i


class NaiveRadix:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = NaiveNode(None, [], [])
        self.clock = 0

    def _page(self, key: list[int]) -> tuple:
        return tuple(key[:self.page_size])

    def match(self, key: list[int]) -> list[int]:
        """Device pages of the longest cached prefix (whole pages)."""
        self.clock += 1
        key = key[:len(key) - len(key) % self.page_size]
        node, value = self.root, []
        while key:
            child = node.children.get(self._page(key))
            if child is None:
                break
            child.last_access = self.clock
            n = key_match(child.key, key)
            n -= n % self.page_size
            if n < len(child.key):
                child = self._split(child, n)
                value += child.value
                break
            value += child.value
            node = child
            key = key[n:]
        return value

    def _split(self, child: NaiveNode, n: int) -> NaiveNode:
        pages = n // self.page_size
        top = NaiveNode(child.parent, child.key[:n], child.value[:pages])
        top.last_access = child.last_access
        child.parent.children[self._page(child.key)] = top
        child.key, child.value, child.parent = child.key[n:], child.value[pages:], top
        top.children[self._page(child.key)] = child
        return top

    def insert(self, key: list[int], value: list[int]) -> int:
        """Cache whole pages of `key` (value[i] holds page i); returns tokens already cached."""
        self.clock += 1
        node, done = self.root, 0
        while done < len(key):
            child = node.children.get(self._page(key[done:]))
            if child is None:
                break
            child.last_access = self.clock
            n = key_match(child.key, key[done:])
            n -= n % self.page_size
            if n < len(child.key):
                child = self._split(child, n)
            node = child
            done += n
        if done < len(key):
            leaf = NaiveNode(node, key[done:], value[done // self.page_size:])
            leaf.last_access = self.clock
            node.children[self._page(leaf.key)] = leaf
        return done

    def evict(self, num_pages: int) -> list[int]:
        """Free at least `num_pages` pages, least recently used leaves first."""
        leaves = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                leaves.append((n.last_access, id(n), n))
        heapq.heapify(leaves)
        freed: list[int] = []
        while len(freed) < num_pages and leaves:
            _, _, n = heapq.heappop(leaves)
            freed += n.value
            parent = n.parent
            del parent.children[self._page(n.key)]
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed
