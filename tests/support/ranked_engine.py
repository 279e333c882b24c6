"""A tensor-parallel engine on one managed-device namespace, for tests.

`tp_size` ranks, each an `EngineDouble` with buffers of its own whose KV pattern is
salted with its rank (rank 1 holding rank 0's bytes is a mismatch). One page table
serves every rank, as in SGLang: rank 0 (`RankZero`) allocates, makes the tree calls
and, where it writes or checks KV, does so on every rank's buffers.
"""

import uuid

import torch

from radixkv.client import Client

from .engine import LAYOUT, RPC_TIMEOUT_S, EngineDouble


class RankZero(EngineDouble):
    """Rank 0: its client drives the namespace; `others` are the other ranks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.others: list[EngineDouble] = []

    def write_kv(self, pages, packed, extra_key=b"") -> None:
        for rank in (self, *self.others):
            EngineDouble.write_kv(rank, pages, packed, extra_key)
        if self.buffers.backend == "cuda":  # written before the Insert: no engine event is sent
            torch.cuda.synchronize()

    def verify(self, packed, pages, extra_key=b"") -> tuple[int, int]:
        """Mismatches summed over every rank's buffers."""
        found = [EngineDouble.verify(rank, packed, pages, extra_key) for rank in (self, *self.others)]
        return sum(b for b, _ in found), sum(c for _, c in found)


class RankedEngine:
    """`ranks[r]` is rank r; `driver` (rank 0) makes the calls. `register` registers the
    ranks named (all by default), in that order."""

    def __init__(self, tp_size: int = 2, num_pages: int = 128, layout=LAYOUT, backend: str = "shm", device: int = 0):
        self.tp_size = tp_size
        self.instance = uuid.uuid4().hex  # one id for the engine's ranks
        self.driver = RankZero(layout, num_pages, backend, device)
        self.ranks: list[EngineDouble] = [self.driver]
        for r in range(1, tp_size):
            rank = EngineDouble(layout, num_pages, backend, device)
            rank.kv_salt = b"rank%d" % r
            self.ranks.append(rank)
        self.driver.others = self.ranks[1:]

    @classmethod
    def connect(cls, target: str, namespace: str, tp_size: int = 2, **register) -> "RankedEngine":
        engine = cls(tp_size)
        engine.register(target, namespace, **register)
        return engine

    def register(self, target: str, namespace: str, ranks=None, **options) -> None:
        """Register the ranks named (all by default) under this engine's `instance`
        unless `options` names another."""
        options.setdefault("instance", self.instance)
        for r in range(self.tp_size) if ranks is None else ranks:
            self.ranks[r].register(Client(target, timeout=RPC_TIMEOUT_S), namespace, tp_rank=r,
                                   tp_size=self.tp_size, **options)

    def restart(self) -> None:
        """The engine restarted: every rank's KV is gone (the pages are the engine's)."""
        for rank in self.ranks:
            rank.forget_cache()

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


__all__ = ["RankZero", "RankedEngine"]
