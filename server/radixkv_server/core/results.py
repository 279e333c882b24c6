"""Frozen results of the cache's operations, and its running counters."""

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest cached prefix of a prompt.

    `device_pages` hold the first `device_tokens` tokens on the device. The next
    `host_tokens` tokens sit on the host only; load them with `load_back(host_node)`.
    The device pages may still be arriving: wait for every transfer in `depends_on`
    before reading them. Node ids are the root's id when nothing matched.
    """

    device_pages: bytes
    device_tokens: int
    host_tokens: int
    device_node: int
    host_node: int
    depends_on: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class InsertResult:
    """`cached_tokens` of the inserted prompt were cached before (on any tier).
    `redundant_pages` were the caller's and duplicate what the cache holds: the caller
    frees them. Every other page passed is now held by the cache. `node` ends the prompt."""

    cached_tokens: int
    redundant_pages: bytes
    node: int


@dataclass(frozen=True, slots=True)
class LoadBackResult:
    """`device_pages` cover the first `device_tokens` tokens of the node's path (the
    whole device prefix after this load). `transfer` (0 when nothing was loaded) copies
    `loaded_tokens` of them; wait for it and every id in `depends_on` before reading,
    and acknowledge `transfer`. `unused_pages` were not needed: the caller keeps them."""

    transfer: int
    device_pages: bytes
    device_tokens: int
    loaded_tokens: int
    depends_on: tuple[int, ...]
    unused_pages: bytes


@dataclass(frozen=True, slots=True)
class FinishResult:
    """Outcome of acknowledging a load-back. When `error` is set, the bytes did not
    arrive: `failed_pages` (the transfer's device pages, now the caller's again) hold
    garbage, and the tokens they covered must be recomputed."""

    transfer: int
    error: str | None
    failed_pages: bytes


@dataclass(frozen=True, slots=True)
class EvictResult:
    """`freed_pages` are the caller's again now. Write-backs in `pending` free more pages
    when their copies complete (see `on_copy_done`). `backing_up`: when fewer pages than
    asked were freed or planned, the write-through backups in flight, whose nodes may
    be evicted once they completed (a backing-up node is never evicted)."""

    freed_pages: bytes
    pending: tuple[int, ...]
    backing_up: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CopyOutcome:
    """What a completed copy released: device pages of write-back evictions."""

    freed_pages: bytes


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    """A prefetch finished: `pages_read` pages arrived from storage, of which
    `added_tokens` worth became new host copies in the cache."""

    pages_read: int
    added_tokens: int


@dataclass
class CacheCounters:
    """Monotonic counts since the cache was created (tokens unless named pages)."""

    match_requests: int = 0
    match_prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    inserted_tokens: int = 0
    loaded_tokens: int = 0
    failed_load_tokens: int = 0
    backed_up_tokens: int = 0
    failed_backup_tokens: int = 0
    skipped_backup_tokens: int = 0
    device_evicted_tokens: int = 0
    written_back_tokens: int = 0
    dropped_write_back_tokens: int = 0
    reclaimed_duplicate_tokens: int = 0
    host_evicted_tokens: int = 0
    storage_hit_tokens: int = 0
    stored_tokens: int = 0
    store_failed_tokens: int = 0
    store_dropped_tokens: int = 0
    prefetched_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
