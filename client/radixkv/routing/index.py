"""Per-worker, per-tier block index: which worker holds the longest prefix of a prompt.

Per namespace and tier (GPU, CPU, STORAGE) one dict maps a block hash to a bit set of the
workers holding it (a Python int), so an update is a dict write and a query hashes the
prompt's blocks once and does three dict reads per block, stopping at the first block no
candidate holds. A worker's prefix is its longest run of blocks from the start held on any
tier; each block counts with the weight of the best tier the worker holds it on.

Threading: one thread applies events, any thread may query; a query can see a batch
half-applied, never a broken structure.
"""

from dataclasses import dataclass
from typing import NamedTuple
from collections import Counter
from itertools import accumulate, repeat
from operator import and_, or_

from .blockhash import DEFAULT_SEED, block_digests, external_hash
from .wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

TIERS = ("GPU", "CPU", "STORAGE")
_TIER_OF = {name: i for i, name in enumerate(TIERS)}


@dataclass(frozen=True)
class TierWeights:
    """Worth of one cached block by where it sits (a device hit needs no copy)."""

    device: float = 1.0
    host: float = 0.6
    storage: float = 0.3


class WorkerScore(NamedTuple):
    worker: str
    score: float          # weighted blocks of the worker's cached prefix
    device_blocks: int    # prefix blocks the worker holds on GPU
    host_blocks: int      # ... on CPU and not on GPU
    storage_blocks: int   # ... only in storage

    @property
    def prefix_blocks(self) -> int:
        return self.device_blocks + self.host_blocks + self.storage_blocks


def _by_score(s: WorkerScore) -> float:
    return -s.score


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class RoutingIndex:
    def __init__(self, block_size: int, weights: TierWeights = TierWeights(), seed: str = DEFAULT_SEED):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.weights = weights
        self.seed = seed
        self._bit: dict[str, int] = {}
        self._name: dict[int, str] = {}
        self._tiers: dict[str, tuple[dict, dict, dict]] = {}
        self._counts: dict[tuple[str, int], list[int]] = {}  # (namespace, bit) -> per tier
        self.num_unknown_medium = 0  # events for a medium outside GPU/CPU/STORAGE (ignored)

    # -- workers --------------------------------------------------------------------------

    def add_worker(self, name: str) -> None:
        """Track `name` (idempotent)."""
        if name not in self._bit:
            bit = next(i for i in range(len(self._bit) + 1) if i not in self._name)
            self._bit[name], self._name[bit] = bit, name

    def remove_worker(self, name: str) -> None:
        """Forget `name` and everything it held (idempotent)."""
        if name in self._bit:
            self.clear_worker(name)
            del self._name[self._bit.pop(name)]

    @property
    def workers(self) -> list[str]:
        return list(self._bit)

    def clear_worker(self, name: str, namespace: str | None = None,
                     media: tuple[str, ...] | None = None) -> None:
        """Forget what `name` holds in `namespace` (None: every namespace) on `media`
        (None: every medium). O(blocks)."""
        bit = self._bit[name]
        keep = ~(1 << bit)
        tiers_cleared = range(3) if media is None else [_TIER_OF[m] for m in media]
        for ns in ([namespace] if namespace is not None else list(self._tiers)):
            tiers = self._tiers.get(ns)
            if tiers is None:
                continue
            self._tiers[ns] = tuple({h: m & keep for h, m in d.items() if m & keep}
                                    if i in tiers_cleared else d for i, d in enumerate(tiers))
            counts = self._counts.get((ns, bit))
            for i in tiers_cleared:
                if counts is not None:
                    counts[i] = 0

    # -- updates ------------------------------------------------------------------------

    def apply(self, worker: str, namespace: str, batch: KVEventBatch,
              media: tuple[str, ...] | None = None) -> None:
        """Apply one batch of `worker`'s events for `namespace`. An AllBlocksCleared in
        namespace "" (a daemon's restart announcement) clears every namespace. With `media`
        (a stream that speaks for some tiers of the worker, such as a vLLM engine's own GPU
        events beside its radixkv daemon's), only those tiers change: the stream's events
        of other tiers (the connector's relay of the daemon's CPU and STORAGE blocks) are
        another stream's to tell."""
        self.add_worker(worker)
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.clear_worker(worker, namespace or None, media)
            elif isinstance(event, BlockStored):
                if media is None or (event.medium or "GPU") in media:
                    self._store(worker, namespace, event)
            elif isinstance(event, BlockRemoved):
                if media is None or event.medium is None or event.medium in media:
                    self._remove(worker, namespace, event, media)

    def _tier_dicts(self, namespace: str) -> tuple[dict, dict, dict]:
        tiers = self._tiers.get(namespace)
        if tiers is None:
            tiers = self._tiers[namespace] = ({}, {}, {})
        return tiers

    def _count(self, namespace: str, bit: int) -> list[int]:
        key = (namespace, bit)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = [0, 0, 0]
        return counts

    def _store(self, worker: str, namespace: str, event: BlockStored) -> None:
        tier = _TIER_OF.get(event.medium or "GPU")
        if tier is None:
            self.num_unknown_medium += 1
            return
        bit = self._bit[worker]
        flag = 1 << bit
        d = self._tier_dicts(namespace)[tier]
        added = 0
        for h in event.block_hashes:
            if type(h) is not int:
                h = external_hash(h)
            old = d.get(h, 0)
            if not old & flag:
                d[h] = old | flag
                added += 1
        self._count(namespace, bit)[tier] += added

    def _remove(self, worker: str, namespace: str, event: BlockRemoved,
                media: tuple[str, ...] | None = None) -> None:
        if event.medium is None:  # from every tier (of those the stream speaks for)
            tiers = range(3) if media is None else [_TIER_OF[m] for m in media]
        elif event.medium in _TIER_OF:
            tiers = (_TIER_OF[event.medium],)
        else:
            self.num_unknown_medium += 1
            return
        bit = self._bit[worker]
        flag = 1 << bit
        dicts = self._tier_dicts(namespace)
        counts = self._count(namespace, bit)
        for tier in tiers:
            d = dicts[tier]
            removed = 0
            for h in event.block_hashes:
                if type(h) is not int:
                    h = external_hash(h)
                old = d.get(h, 0)
                if old & flag:
                    if old == flag:
                        del d[h]
                    else:
                        d[h] = old & ~flag
                    removed += 1
            counts[tier] -= removed

    # -- queries --------------------------------------------------------------------------

    def num_blocks(self, worker: str, namespace: str = "") -> tuple[int, int, int]:
        """Blocks `worker` holds in `namespace` on GPU, CPU and STORAGE."""
        counts = self._counts.get((namespace, self._bit.get(worker, -1)))
        return tuple(counts) if counts else (0, 0, 0)

    def blocks(self, worker: str, namespace: str, medium: str) -> set[int]:
        """Every block hash `worker` holds on `medium` in `namespace`. O(blocks): for
        checks and debugging, not for routing."""
        tiers = self._tiers.get(namespace)
        bit = self._bit.get(worker)
        if tiers is None or bit is None:
            return set()
        flag = 1 << bit
        return {h for h, m in tiers[_TIER_OF[medium]].items() if m & flag}

    def hashes(self, tokens, extra_key: bytes = b"") -> list[int]:
        """The block hashes of `tokens` (list, numpy array or packed int32 bytes)."""
        return [external_hash(d) for d in block_digests(
            tokens, self.block_size, extra_key=extra_key, seed=self.seed)]

    def score(self, tokens=None, *, namespace: str = "", extra_key: bytes = b"",
              workers: list[str] | None = None, hashes: list[int] | None = None) -> list[WorkerScore]:
        """Every candidate worker (default: all) with its cached prefix of `tokens` (or of
        precomputed `hashes`), best first; ties keep the order of `workers`."""
        names = workers if workers is not None else list(self._bit)
        if hashes is None:
            hashes = self.hashes(tokens, extra_key) if tokens is not None else []
        bit_of = self._bit
        candidates = 0
        for name in names:
            if name in bit_of:
                candidates |= 1 << bit_of[name]
        per_bit = self._prefix_counts(hashes, namespace, candidates)
        wd, wh, ws = self.weights.device, self.weights.host, self.weights.storage
        none = (0, 0, 0)
        out = []
        for name in names:
            dev, host, sto = per_bit.get(bit_of.get(name, -1), none)
            out.append(WorkerScore(name, wd * dev + wh * host + ws * sto, dev, host, sto))
        out.sort(key=_by_score)
        return out

    def best(self, tokens=None, **kwargs) -> WorkerScore | None:
        """The best-scoring worker (None without workers); see `score`."""
        scores = self.score(tokens, **kwargs)
        return scores[0] if scores else None

    def _prefix_counts(self, hashes: list[int], namespace: str, alive: int) -> dict[int, list[int]]:
        """Per worker bit: prefix blocks on GPU, on CPU only, in storage only. The per-block
        work runs in C (map, accumulate, Counter); Python loops only over the distinct
        holder sets along the prefix, which are few."""
        tiers = self._tiers.get(namespace)
        if tiers is None or not alive or not hashes:
            return {}
        zeros = repeat(0)
        dev, host, sto = (list(map(d.get, hashes, zeros)) for d in tiers)
        held = map(or_, map(or_, dev, host), sto)
        still = list(accumulate(held, and_, initial=alive))[1:]
        cut = still.index(0) if 0 in still else len(still)
        out: dict[int, list[int]] = {}
        for (d, h, s, a), n in Counter(zip(dev[:cut], host[:cut], sto[:cut], still[:cut])).items():
            for tier, mask in enumerate((d & a, h & a & ~d, s & a & ~d & ~h)):
                for bit in _bits(mask):
                    out.setdefault(bit, [0, 0, 0])[tier] += n
        return out
