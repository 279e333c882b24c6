"""PagePool: the simulated engine's device pages and who holds each one.

Every page is in exactly one state:

    FREE    on the engine's free list
    IN_USE  allocated to a running request (prefill pages, a load-back's pages until
            the daemon answers, the partial tail page)
    CACHED  handed to the daemon (inserted, or published by a load-back) until Evict
            or a failed load returns it

so `num_free + num_in_use + num_cached == num_pages` at all times. A move from the
wrong state (the daemon returns a page it does not hold, frees a page twice, reports a
page it never got as cached) changes nothing and is counted in `errors`; nothing here
asserts, the simulator reports the count.
"""

from collections.abc import Iterable

FREE, IN_USE, CACHED = 0, 1, 2
_NAMES = ("free", "in use", "cached")


class PagePool:
    def __init__(self, num_pages: int, max_messages: int = 20):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._state = bytearray(num_pages)  # FREE
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._counts = [num_pages, 0, 0]
        self.errors = 0
        self.messages: list[str] = []  # the first `max_messages` errors, for the report
        self._max_messages = max_messages

    @property
    def num_free(self) -> int:
        return self._counts[FREE]

    @property
    def num_in_use(self) -> int:
        return self._counts[IN_USE]

    @property
    def num_cached(self) -> int:
        return self._counts[CACHED]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self._counts[FREE]

    def allocate(self, n: int) -> list[int]:
        """`n` free pages, now IN_USE. Raises ValueError unless `can_allocate(n)`."""
        if not self.can_allocate(n):
            raise ValueError(f"cannot allocate {n} pages ({self._counts[FREE]} free)")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._set(p, IN_USE)
        return pages

    def free(self, pages: Iterable[int], why: str) -> None:
        """IN_USE -> FREE (the engine's own pages: redundant, unused, tail)."""
        for p in self._checked(pages, IN_USE, why):
            self._set(p, FREE)
            self._free.append(p)

    def to_cache(self, pages: Iterable[int], why: str) -> None:
        """IN_USE -> CACHED (the daemon holds them now)."""
        for p in self._checked(pages, IN_USE, why):
            self._set(p, CACHED)

    def from_cache(self, pages: Iterable[int], why: str) -> None:
        """CACHED -> FREE (evicted, or a failed load handed them back)."""
        for p in self._checked(pages, CACHED, why):
            self._set(p, FREE)
            self._free.append(p)

    def all_cached(self, pages: Iterable[int], why: str) -> bool:
        """True when every page is CACHED (e.g. a match's device prefix); counts each
        page that is not as an error."""
        pages = list(pages)
        return len(self._checked(pages, CACHED, why)) == len(pages)

    def cached(self) -> list[int]:
        """Every page the daemon holds, by the engine's account."""
        return [p for p, s in enumerate(self._state) if s == CACHED]

    def check(self, expect_in_use: int | None = None) -> list[str]:
        """Problems with the accounting; empty when sound. Recounts from the states."""
        problems = []
        counts = [self._state.count(s) for s in (FREE, IN_USE, CACHED)]
        if counts != self._counts:
            problems.append(f"page counts {self._counts} != recount {counts}")
        if sum(counts) != self.num_pages:
            problems.append(f"free + in use + cached = {sum(counts)} != {self.num_pages}")
        if expect_in_use is not None and counts[IN_USE] != expect_in_use:
            problems.append(f"{counts[IN_USE]} pages in use, expected {expect_in_use}")
        return problems

    def _checked(self, pages: Iterable[int], state: int, why: str) -> list[int]:
        """The pages that are valid and in `state`; errors for the others."""
        ok, seen = [], set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                self._error(f"{why}: page {p} out of range 0..{self.num_pages - 1}")
            elif p in seen:
                self._error(f"{why}: page {p} given twice")
            elif self._state[p] != state:
                self._error(f"{why}: page {p} is {_NAMES[self._state[p]]}, expected {_NAMES[state]}")
            else:
                ok.append(p)
            seen.add(p)
        return ok

    def _set(self, p: int, state: int) -> None:
        self._counts[self._state[p]] -= 1
        self._counts[state] += 1
        self._state[p] = state

    def _error(self, message: str) -> None:
        self.errors += 1
        if len(self.messages) < self._max_messages:
            self.messages.append(message)
