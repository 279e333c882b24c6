"""Residency records -> vLLM KV events, on the publisher thread (never on the event loop).

A record is what the loop captured when a node's residency changed: the tier, stored or
removed, the node's `extra_key` and its path to the root as immutable cells
`(node_id, key, parent's cell)` (the root's: None; `hub.token_path`). Keys are immutable
`bytes`, so a record stays valid whatever the tree does afterwards. One vLLM block is one
radixkv page: a node of k pages gives one event with k block hashes
(`radixkv.routing.blockhash`). A LoRA or salted prompt's key in vLLM's form
(`radixkv.routing.extra_keys`) is published as vLLM publishes it: `lora_name`, and per
block the untagged extra keys, the salt in the prompt's first block only.

With `presence` (for routers that ignore `medium`, as Dynamo's does: to them a CPU
removal of a block still on the GPU reads as the block gone), events carry no medium: the
hub records only a node's first arrival on the device or host and its leaving the last of
them, and no storage change (`hub._told_in_presence`: a store serves every daemon).

The digest of a node's last page names the whole token path from the root to the node's
end, which no split changes, so it is cached by node id (per namespace attachment: ids
restart with a new tree) and dropped when the node leaves the device and host tiers, or
past `max_cached`: a cache only, recomputed from the path where a later record needs it
(a storage removal, reported only when the store lost its contents).
"""

from radixkv.routing.blockhash import DEFAULT_SEED, as_token_array, block_digests, external_hash
from radixkv.routing.extra_keys import event_extra_keys, lora_name
from radixkv.routing.wire import (
    MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, Event,
)

TIER_MEDIUM = {"device": MEDIUM_GPU, "host": MEDIUM_CPU, "storage": MEDIUM_STORAGE}
# Residency tracked per node for device and host; storage evicts unseen (its removals are
# reported only when the store lost its contents), so it is not tracked.
_TIER_BIT = {MEDIUM_GPU: 1, MEDIUM_CPU: 2, MEDIUM_STORAGE: 0}
STORED, REMOVED, CLEARED = 0, 1, 2
CLEAR_RECORD = (CLEARED, None, b"", None)
FULL_ATTENTION = "full_attention"  # radixkv caches FULL attention KV (group 0) only
_RECENT_NODES = 1024


class EventBuilder:
    """Turns one namespace attachment's records into events. Used by one thread only."""

    def __init__(self, block_size: int, seed: str = DEFAULT_SEED, max_cached: int = 1 << 20,
                 presence: bool = False):
        self.block_size = block_size
        self.seed = seed
        self.presence = presence
        self._digests: dict[int, bytes] = {}  # node id -> digest of its last page
        self._resident: dict[int, int] = {}   # node id -> bit set of device/host residency
        self._max_cached = max_cached
        # The last nodes' blocks: a write-through node is stored on device, then on host.
        # (node id, key length, start digest) names the content: keys only shrink by splits.
        # Hashes only: token lists are made per event (a 2k-token node's list of Python
        # ints is 80 KiB; a thousand of them kept here would be 80 MiB).
        self._recent: dict[tuple, tuple[bytes, list[int]]] = {}
        self._tokens: dict[tuple[int, int], list[int]] = {}

    def build(self, records) -> tuple[list[Event], list[bytes]]:
        """The records' events, and per event the radixkv extra_key of its blocks."""
        out: list[Event] = []
        keys: list[bytes] = []
        self._tokens: dict[tuple[int, int], list[int]] = {}  # this batch's token lists, shared
        for kind, medium, extra_key, path in records:
            if kind == CLEARED:
                self._digests.clear()
                self._resident.clear()
                self._recent.clear()
                out.append(AllBlocksCleared())
            else:
                out.append(self._event(kind, medium, extra_key, path))
            keys.append(extra_key)
        if len(self._digests) > self._max_cached:  # a cache only: recomputed on demand
            self._digests.clear()
        self._tokens = {}
        return out, keys

    def _blocks(self, node_id: int, key: bytes, start: bytes | None, extra_key: bytes):
        """(last digest, block hashes) of a node's pages, memoised briefly."""
        memo = (node_id, len(key), start)
        hit = self._recent.get(memo)
        if hit is None:
            digests = block_digests(key, self.block_size, parent=start, extra_key=extra_key, seed=self.seed)
            hit = (digests[-1], [external_hash(d) for d in digests])
            self._recent[memo] = hit
            if len(self._recent) > _RECENT_NODES:
                del self._recent[next(iter(self._recent))]
        return hit

    def _event(self, kind: int, medium: str, extra_key: bytes, path) -> Event:
        node_id, key, up = path
        bit = _TIER_BIT[medium]
        was = self._resident.get(node_id, 0)
        start = self._start_digest(up, extra_key)
        last, hashes = self._blocks(node_id, key, start, extra_key)
        if self.presence:
            medium = None
        if kind == REMOVED:
            left = was & ~bit
            if left:
                self._resident[node_id] = left
                self._digests[node_id] = last
            else:
                self._resident.pop(node_id, None)
                self._digests.pop(node_id, None)
            return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)
        if bit:
            self._resident[node_id] = was | bit
            self._digests[node_id] = last
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if start is None else external_hash(start),
            token_ids=self._token_list(node_id, key),
            block_size=self.block_size,
            lora_id=None,
            medium=medium,
            lora_name=lora_name(extra_key),
            extra_keys=event_extra_keys(extra_key, len(hashes), starts_prompt=start is None),
            group_idx=0,
            kv_cache_spec_kind=FULL_ATTENTION,
        )

    def _token_list(self, node_id: int, key: bytes) -> list[int]:
        """A node's tokens as a list, made once per batch: a write-through node's device
        and host events share it."""
        memo = (node_id, len(key))
        tokens = self._tokens.get(memo)
        if tokens is None:
            tokens = self._tokens[memo] = as_token_array(key).tolist()
        return tokens

    def _start_digest(self, cell, extra_key: bytes) -> bytes | None:
        """Digest of the last page of `cell`'s node (None for the root's cell), caching
        the digests of ancestors it had to compute."""
        todo = []
        while cell is not None and cell[0] not in self._digests:
            todo.append(cell)
            cell = cell[2]
        prev = None if cell is None else self._digests[cell[0]]
        for node_id, key, _ in reversed(todo):
            prev = block_digests(key, self.block_size, parent=prev, extra_key=extra_key, seed=self.seed)[-1]
            self._digests[node_id] = prev
        return prev
