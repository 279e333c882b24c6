"""Insert: the engine hands finished KV pages to the cache."""

from .errors import InvalidRequest, NotReady
from .device_eviction import DeviceEviction
from .node import Node
from .pages import require_packed
from .results import InsertResult
from .state import CacheState

Segment = tuple[Node, int]  # a node and how many of its pages the prompt covers


def check_tokens(tokens: bytes, what: str) -> None:
    """Raise InvalidRequest unless `tokens` is packed int32."""
    require_packed(tokens, f"{what}: token")


def check_insert(tokens: bytes, device_pages: bytes, page_size: int) -> int:
    """Raise InvalidRequest unless an Insert's tokens are whole pages, one packed device
    page each; returns the number of tokens."""
    check_tokens(tokens, "Insert")
    require_packed(device_pages, "Insert: device page")
    n = len(tokens) // 4
    if n == 0:
        raise InvalidRequest("Insert: no tokens given")
    if n < page_size:
        raise InvalidRequest(f"Insert: {n} tokens is less than one page (page_size {page_size}); "
                             "only whole pages are cached")
    if n % page_size:
        raise InvalidRequest(f"Insert: {n} tokens is not a whole number of pages (page_size {page_size}); "
                             f"insert the first {n - n % page_size}")
    if len(device_pages) // 4 != n // page_size:
        raise InvalidRequest(f"Insert: {n} tokens need {n // page_size} device pages, got {len(device_pages) // 4}")
    return n


class Insertions:
    """Receives the cache's state and the device eviction part (which starts backups)."""

    def __init__(self, state: CacheState, evictions: DeviceEviction):
        self.state = state
        self.evictions = evictions

    def insert(self, tokens: bytes, device_pages: bytes, extra_key: bytes = b"") -> InsertResult:
        """Hand finished KV to the cache: `device_pages[i]` holds page i of `tokens`.

        `tokens` must be whole pages. Where the cache already holds the page on device,
        the caller's page is returned as redundant unless it is that very page; where
        the cache holds it only on host, the caller's page becomes its device copy; the
        rest becomes a new leaf. Every node on the path counts a hit and the write policy
        starts backups. Raises InvalidRequest / PageOwnershipError, or NotReady while part
        of the prefix is still being loaded (wait for those transfers, then insert).
        """
        state = self.state
        num_tokens = check_insert(tokens, device_pages, state.config.page_size)
        segments, partial = self._existing(tokens, extra_key, device_pages)
        if partial is not None:
            segments[-1] = (state.split(partial, segments[-1][1]), segments[-1][1])
        now = state.tick()
        redundant, off = self._reuse(segments, device_pages, now)
        last = segments[-1][0] if segments else state.tree.root(extra_key)
        if off * 4 < len(device_pages):
            last = state.tree.add_child(last, tokens[off * state.tree.stride:])
            last.hit_count = 1
            state.touch(last, now)
            state.set_device(last, device_pages[off * 4:])
        ps = state.config.page_size
        state.counters.inserted_tokens += num_tokens - off * ps
        self.evictions.start_backups(last)
        return InsertResult(off * ps, redundant, last.id)

    def _existing(self, tokens: bytes, extra_key: bytes, device_pages: bytes) -> tuple[list[Segment], Node | None]:
        """The cached part of the prompt as segments (the last one partial when the
        prompt diverges inside a node: that node is returned too, to be split). Raises
        NotReady or PageOwnershipError; changes nothing."""
        state = self.state
        root = state.tree.roots.get(extra_key)
        path, partial, k = state.tree.walk(root, tokens) if root is not None else ([], None, 0)
        segments = [(n, state.pages(n)) for n in path]
        if partial is not None:
            segments.append((partial, k))
        loading = state.copying(n for n, _ in segments)
        if loading:
            raise NotReady("Insert: part of this prefix is still being loaded", tuple(sorted(loading)))
        same = self._same_pages(segments, device_pages)
        state.device.check_new(device_pages, "Insert", allowed=same)
        return segments, partial

    def _reuse(self, segments: list[Segment], device_pages: bytes, now: int) -> tuple[bytes, int]:
        """Count a hit on each cached node: host-only ones take the caller's pages as
        their device copy, device ones make the caller's differing pages redundant.
        Returns the redundant pages and the number of pages covered."""
        state = self.state
        redundant = []
        off = 0
        for node, m in segments:
            given = device_pages[off * 4:(off + m) * 4]
            mine = node.full.device_pages
            if mine is None:
                state.set_device(node, given)  # host-only before: now a duplicate
            elif mine != given:
                redundant.extend(given[i:i + 4] for i in range(0, len(given), 4)
                                 if given[i:i + 4] != mine[i:i + 4])
            node.hit_count += 1
            state.touch(node, now)
            off += m
        return b"".join(redundant), off

    @staticmethod
    def _same_pages(segments: list[Segment], given: bytes) -> bytes:
        """The caller's pages that are the cache's own page at the same position."""
        same = []
        off = 0
        for node, m in segments:
            mine = node.full.device_pages
            if mine is not None:
                mine = mine[:m * 4]
                theirs = given[off * 4:(off + m) * 4]
                if mine == theirs:  # the usual case: the engine passes back what it matched
                    same.append(mine)
                else:
                    same.extend(mine[i:i + 4] for i in range(0, m * 4, 4) if mine[i:i + 4] == theirs[i:i + 4])
            off += m
        return b"".join(same)


__all__ = ["Insertions", "check_tokens"]
