"""RankedBuffers: every tensor-parallel rank's buffers, copied as one device.

A managed-device namespace shared by `tp_size` ranks keeps one page id space: device
page p names page p of every rank's buffers, and host page p holds every rank's shard
back to back (`HostShard`). A copy of pages is then one copy per rank, each between the
rank's buffers and its shard of the host pages, and it is done only when every rank's
is: a transfer never completes on some ranks and fails on others, so the ranks cannot
come to hold different KV under one page id.

It is a `DeviceBuffers`, so the namespace's `CopyEngine` copies through it as through
one engine's buffers: the core and the copy threads do not know about ranks.

Threads: as any DeviceBuffers (`submit_*` and `CopyJob.wait` on copy threads).
"""

from radixkv.layout import KvLayout

from .device import CopyError, CopyJob, DeviceBuffers
from .host_shard import HostShard


class RankedBuffers(DeviceBuffers):
    """`ranks[r]` is rank r's opened buffers (one rank's `layout`, `num_pages` pages
    each, all alike). Closing it closes every rank's buffers. Loads carry no per-layer
    events: an event is one GPU's, and each rank's GPU would need its own."""

    layer_events = False

    def __init__(self, ranks: list[DeviceBuffers], layout: KvLayout):
        if not ranks:
            raise ValueError("RankedBuffers needs at least one rank's buffers")
        pages = {r.num_pages for r in ranks}
        if len(pages) != 1:
            raise ValueError(f"the ranks' buffers hold different page counts: {sorted(pages)}")
        self.ranks = list(ranks)
        self.layout = layout
        self.num_pages = pages.pop()
        self._shards: tuple[object, list[HostShard]] | None = None  # (host pool, its shards)

    def submit_load(self, host_pool, host_pages: bytes, device_pages: bytes, after: bytes = b"") -> CopyJob:
        return self._each(lambda rank, shard, extra: rank.submit_load(shard, host_pages, device_pages, **extra),
                          host_pool, after)

    def submit_store(self, device_pages: bytes, host_pool, host_pages: bytes, after: bytes = b"") -> CopyJob:
        return self._each(lambda rank, shard, extra: rank.submit_store(device_pages, shard, host_pages, **extra),
                          host_pool, after)

    def _each(self, submit, host_pool, after: bytes) -> CopyJob:
        """Submit one copy per rank; one job that is done once every rank's is. A rank
        whose copy cannot start raises CopyError naming it, after the ranks already
        started finished theirs (nothing is left running)."""
        extra = {"after": after} if after else {}
        jobs = []
        for index, (rank, shard) in enumerate(zip(self.ranks, self._shards_of(host_pool))):
            try:
                jobs.append(submit(rank, shard, extra))
            except Exception as e:  # CopyError, or the backend's own (a CUDA call): nothing may stay running
                _wait_all(jobs)
                raise CopyError(f"rank {index}: {e if isinstance(e, CopyError) else f'{type(e).__name__}: {e}'}") \
                    from None
        if not any(job.pending for job in jobs):
            return CopyJob()
        return CopyJob(wait=lambda: _raise_first(_wait_all(jobs)))

    def _shards_of(self, host_pool) -> list[HostShard]:
        """Each rank's view of `host_pool` (made once per pool; the namespace has one)."""
        if self._shards is None or self._shards[0] is not host_pool:
            n = len(self.ranks)
            self._shards = (host_pool, [HostShard(host_pool, self.layout, r, n) for r in range(n)])
        return self._shards[1]

    def close(self) -> None:
        """Close every rank's buffers (each is idempotent), all of them even when one
        raises (the first error is raised after)."""
        failed = None
        for rank in self.ranks:
            try:
                rank.close()
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed


def _wait_all(jobs: list[CopyJob]) -> list[tuple[int, CopyError]]:
    """Wait for every job; the (rank, error) of those that failed."""
    failed = []
    for index, job in enumerate(jobs):
        try:
            job.wait()
        except Exception as e:
            failed.append((index, e if isinstance(e, CopyError) else CopyError(f"{type(e).__name__}: {e}")))
    return failed


def _raise_first(failed: list[tuple[int, CopyError]]) -> None:
    if failed:
        index, error = failed[0]
        raise CopyError(f"rank {index}: {error}")


__all__ = ["RankedBuffers"]
