"""Host page allocator: which pages of the host pool are free. Bookkeeping only.

The bytes live in the data path's host pool; this class hands out indices. Running out
is a normal outcome (`alloc` returns None), never an exception: the cache then evicts.
"""

from array import array



class HostAllocator:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError("host pool capacity must be >= 0 pages")
        self.capacity = capacity
        # Pop from the end; start with low indices on top so early pages are used first.
        self._free = array("i", range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> bytes | None:
        """Take `n` pages; packed indices, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return b""
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()  # ascending on a fresh pool: runs of pages copy as one slice
        return taken.tobytes()

    def free(self, pages: bytes) -> None:
        """Return pages taken by `alloc`. The caller guarantees they are not free already."""
        self._free.frombytes(pages)

    def free_pages(self) -> array:
        """A copy of the free list (for invariant checks)."""
        return array("i", self._free)

    def __repr__(self) -> str:
        return f"HostAllocator(used={self.num_used}, free={self.num_free})"


__all__ = ["HostAllocator"]
