"""Which of the engine's device pages the cache holds, and the accounting that proves it.

The engine allocates device pages; the cache takes them on insert and load-back and
hands them back (redundant on insert, unused on load-back, freed on eviction, failed on
a broken load). The ledger validates every page list a caller passes and keeps the
counts behind the invariant  held + returned == taken.
"""

from .errors import InvalidRequest, PageOwnershipError
from .pages import count, require_packed, unpack


class DeviceLedger:
    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError("number of device pages must be >= 0")
        self.num_pages = num_pages
        self._held = bytearray(num_pages)  # 1 where the cache holds the page
        self.num_held = 0
        self.num_taken = 0
        self.num_returned = 0

    def check_new(self, pages: bytes, what: str, allowed: bytes = b"") -> None:
        """Raise unless every page is in range, listed once, and not held by the cache.

        `allowed` lists held pages the caller may pass back (an insert repeating the
        pages it matched). Checks only; changes nothing.
        """
        require_packed(pages, f"{what}: page list")
        n = self.num_pages
        held = self._held
        seen = set()
        ok_held = set(unpack(allowed)) if allowed else ()
        for p in unpack(pages):
            if p < 0 or p >= n:
                raise InvalidRequest(f"{what}: device page {p} is out of range [0, {n})")
            if p in seen:
                raise PageOwnershipError(f"{what}: device page {p} is listed twice")
            seen.add(p)
            if held[p] and p not in ok_held:
                raise PageOwnershipError(f"{what}: device page {p} is already held by the cache")

    def take(self, pages: bytes) -> None:
        for p in unpack(pages):
            self._held[p] = 1
        k = count(pages)
        self.num_held += k
        self.num_taken += k

    def give_back(self, pages: bytes) -> None:
        for p in unpack(pages):
            self._held[p] = 0
        k = count(pages)
        self.num_held -= k
        self.num_returned += k

    def held_pages(self) -> set[int]:
        return {i for i, h in enumerate(self._held) if h}
