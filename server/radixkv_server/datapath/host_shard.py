"""HostShard: one tensor-parallel rank's slice of every page of a host pool.

In an engine-managed namespace with `tp_size` ranks, host page p holds every rank's
shard back to back: [rank 0 page bytes | rank 1 page bytes | ...]. A rank's copies see
the pool through a HostShard: the same page numbers, pages of `layout.page_bytes` (the
rank's layout), each a strided slice of the real page. Device backends copy through it
as through a `HostPool` (it has the attributes they read).
"""

from radixkv.layout import KvLayout

from .host_pool import HostPool


class HostShard:
    """Rank `rank` of `tp_size` in `pool`, whose pages are `tp_size` x `layout.page_bytes`.
    Raises ValueError when the pool's pages are not that size or the rank is out of range."""

    pinned = False  # not a pinned pool itself: the CUDA backend maps `pool` and views the shard in it

    def __init__(self, pool: HostPool, layout: KvLayout, rank: int, tp_size: int):
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} out of range 0..{tp_size - 1}")
        if pool.layout.page_bytes != layout.page_bytes * tp_size:
            raise ValueError(f"host pages are {pool.layout.page_bytes} bytes, not {tp_size} shards of "
                             f"{layout.page_bytes}")
        self.pool = pool
        self.layout = layout
        self.rank = rank
        self.tp_size = tp_size

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def tensor(self):
        """uint8 [num_pages, page_bytes]: this rank's slice of every page (None once closed)."""
        t = self.pool.tensor
        if t is None:
            return None
        return t.view(self.num_pages, self.tp_size, self.layout.page_bytes)[:, self.rank]

    def chunks(self, chunk_bytes: int):
        """`HostPool.chunks` of this rank's slice: [num_pages, page_bytes // chunk_bytes]
        opaque chunks. ValueError when the pool is closed or the chunk does not divide a
        shard's page."""
        if chunk_bytes <= 0 or self.layout.page_bytes % chunk_bytes:
            raise ValueError(f"chunks of {chunk_bytes} bytes do not divide a {self.layout.page_bytes}-byte shard")
        per = self.layout.page_bytes // chunk_bytes
        return self.pool.chunks(chunk_bytes)[:, self.rank * per:(self.rank + 1) * per]

    def read_page(self, page: int) -> bytes:
        """The shard's bytes of host page `page` (tests, debugging)."""
        return bytes(self.tensor[page].numpy().tobytes())

    def __repr__(self) -> str:
        return f"HostShard(rank={self.rank}/{self.tp_size}, {self.pool!r})"


__all__ = ["HostShard"]
