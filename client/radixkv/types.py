"""Client-side values: packed int32 helpers and the frozen results of each RPC.

Tokens and page indices travel as packed little-endian int32 bytes. Results expose page
lists as `array('i')` (one `frombytes`, no per-element Python work); callers that want
to send them back pass the array as is (`as_packed` takes bytes, arrays and int lists).
"""

import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from radixkv.v1 import radixkv_pb2 as pb

from .errors import code_from_int

if sys.byteorder != "little":  # array('i') is native-endian; the wire is little-endian.
    raise ImportError("radixkv assumes a little-endian host")

INT32 = 4


def pack(values: Iterable[int]) -> bytes:
    """Pack ints as little-endian int32 bytes. Raises OverflowError/TypeError on bad values.
    (struct packs a list of 2k ints in ~17 us, array element by element in ~33 us.)"""
    if not isinstance(values, (list, tuple)):
        values = list(values)
    try:
        return struct.pack(f"<{len(values)}i", *values)
    except struct.error:  # array says precisely what was wrong, as OverflowError or TypeError
        return array("i", values).tobytes()


def unpack(buf: bytes) -> array:
    """Packed int32 bytes -> array('i'). Raises ValueError if len(buf) is not a multiple of 4."""
    out = array("i")
    out.frombytes(buf)
    return out


def as_packed(values) -> bytes:
    """Wire form of a token or page list: bytes-like objects pass through (already
    packed); `array('i')`, numpy arrays and CPU torch tensors of integers are converted
    whole (a 2k-token tensor in ~6 us, not element by element: ~60 us); any other iterable
    of ints is packed. OverflowError for a value outside int32, TypeError for non-integers."""
    if isinstance(values, bytes):
        return values
    if isinstance(values, (bytearray, memoryview)):
        return bytes(values)
    if isinstance(values, array):
        if values.typecode == "i":
            return values.tobytes()
        return pack(values)
    if hasattr(values, "__array__") and str(getattr(values, "device", "cpu")) == "cpu":  # not a CUDA tensor
        if getattr(values, "ndim", 1) == 0:  # one token: a prompt given where a batch of them belongs
            raise TypeError("got one token (a 0-d array), not a list of them: Match takes a batch of prompts, "
                            "[tokens]")
        return _pack_ndarray(values)
    if hasattr(values, "tolist"):
        values = values.tolist()
    return pack(values)


def _pack_ndarray(values) -> bytes:
    import numpy as np
    a = np.asarray(values).reshape(-1)
    if a.dtype.kind not in "iu":
        raise TypeError(f"tokens and pages must be integers, got an array of {a.dtype}")
    if a.size and (int(a.min()) < -2**31 or int(a.max()) >= 2**31):
        raise OverflowError("a value does not fit in int32")
    return a.astype("<i4", copy=False).tobytes()


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt for `match`: packed tokens and an optional `extra_key` (LoRA id, cache
    salt) that separates otherwise equal prefixes."""

    tokens: bytes
    extra_key: bytes = b""

    @classmethod
    def of(cls, value) -> "Prompt":
        """A `Prompt` as is, or a token list / packed bytes without extra key."""
        if isinstance(value, Prompt):
            return value
        return cls(as_packed(value))


@dataclass(frozen=True, slots=True)
class Registration:
    """A session: pass nothing back, the client keeps it. `warm` says the namespace's
    host tier survived a previous engine; `dropped_device_tokens`, the tokens the cache
    lost with that engine's device residency (KV it held on the device only);
    `daemon_instance` changes when the daemon restarts;
    `storage` is the daemon's storage tier by URL scheme ("file", "redis", "redis+cluster",
    "mooncake"; "" without one); `max_prompts_per_match`, the most prompts one Match may
    carry (0: a daemon too old to say); `lease_timeout_s`, `ack_timeout_s` and
    `idle_session_timeout_s` (a session that never opened a stream), the daemon's
    timeouts (0: off, or a daemon too old to say); `ranks_missing`, a tensor-parallel
    managed-device rank's: the ranks of its group not registered yet when the daemon
    answered (empty: rank 0's calls are served; see `wait_for_ranks`);
    `max_message_bytes` and `max_leases_per_session`, the daemon's limits (0: a daemon
    too old to say)."""

    session: str
    daemon_instance: str
    host_pool_pages: int
    write_policy: str
    warm: bool
    dropped_device_tokens: int
    storage: str = ""
    device_uuid: str = ""  # cuda: the GPU the daemon opened the buffers on
    max_prompts_per_match: int = 0
    lease_timeout_s: float = 0.0
    ack_timeout_s: float = 0.0
    idle_session_timeout_s: float = 0.0
    ranks_missing: tuple[int, ...] = ()
    max_message_bytes: int = 0
    max_leases_per_session: int = 0

    @classmethod
    def from_pb(cls, m: pb.RegisterResponse) -> "Registration":
        return cls(m.session, m.daemon_instance, m.host_pool_pages, m.write_policy, m.warm,
                   m.dropped_device_tokens, m.storage, m.device_uuid, m.max_prompts_per_match,
                   m.lease_timeout_ms / 1000, m.ack_timeout_ms / 1000, m.idle_session_timeout_ms / 1000,
                   tuple(m.ranks_missing), m.max_message_bytes, m.max_leases_per_session)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest cached prefix of one prompt.

    `device_pages` hold the first `device_tokens` tokens on the device; wait for every
    transfer in `depends_on` before reading them. The next `host_tokens` tokens are on
    host only: allocate `host_tokens // page_size` pages and `load_back(host_node, pages)`.
    `lease` (0 if none) protects the path from eviction until released.
    `storage_tokens` (asked for with include_storage) follow on the storage tier only:
    `prefetch` brings them to host. `complete_tokens` (engine-managed namespaces): of the
    matched host tokens, those every tensor-parallel rank's shard arrived for (what a
    load can copy).
    """

    device_pages: array
    device_tokens: int
    host_tokens: int
    device_node: int
    host_node: int
    depends_on: tuple[int, ...]
    lease: int
    storage_tokens: int = 0
    complete_tokens: int = 0

    @classmethod
    def from_pb(cls, m: pb.MatchResult) -> "MatchResult":
        return cls(unpack(m.device_pages), m.device_tokens, m.host_tokens, m.device_node,
                   m.host_node, tuple(m.depends_on), m.lease, m.storage_tokens, m.complete_tokens)

    @classmethod
    def all_from_pb(cls, m: pb.MatchResponse) -> list["MatchResult"]:
        """A Match answer's results, one per prompt, in order."""
        return [cls.from_pb(r) for r in m.results]


@dataclass(frozen=True, slots=True)
class PrefetchProgress:
    """One progress report of a prefetch. `state` is "started", "done", "nothing" or
    "waiting_ended" (the timeout policy stopped waiting; the fetch goes on)."""

    state: str
    transfer: int
    storage_tokens: int
    fetched_tokens: int
    host_tokens_added: int

    @classmethod
    def from_pb(cls, m: pb.PrefetchProgress) -> "PrefetchProgress":
        state = pb.PrefetchProgress.State.Name(m.state).lower()
        return cls(state, m.transfer, m.storage_tokens, m.fetched_tokens, m.host_tokens_added)


@dataclass(frozen=True, slots=True)
class InsertResult:
    """`cached_tokens` were cached before this insert. `redundant_pages` are the
    caller's again (free them); every other page given now belongs to the cache until
    an `evict` returns it. `lease` is set when the insert asked for one.
    `transfer` (engine-managed, asked with `async_`): the save copying the pages to host;
    the pages stay the engine's, but must not be reused before `wait([transfer])`."""

    cached_tokens: int
    redundant_pages: array
    node: int
    lease: int
    transfer: int = 0

    @classmethod
    def from_pb(cls, m: pb.InsertResponse) -> "InsertResult":
        return cls(m.cached_tokens, unpack(m.redundant_pages), m.node, m.lease, m.transfer)


@dataclass(frozen=True, slots=True)
class LoadBackResult:
    """`device_pages` cover the first `device_tokens` tokens (the whole device prefix
    after this load). `transfer` (0: nothing loaded) copies `loaded_tokens` of them;
    wait for it and for `depends_on` before reading. `unused_pages` stay the caller's.
    `layer_events` (cuda backend) are IPC event handles, one per layer."""

    transfer: int
    device_pages: array
    device_tokens: int
    loaded_tokens: int
    depends_on: tuple[int, ...]
    unused_pages: array
    layer_events: tuple[bytes, ...]

    @classmethod
    def from_pb(cls, m: pb.LoadBackResponse) -> "LoadBackResult":
        return cls(m.transfer, unpack(m.device_pages), m.device_tokens, m.loaded_tokens,
                   tuple(m.depends_on), unpack(m.unused_pages), tuple(m.layer_events))


@dataclass(frozen=True, slots=True)
class EvictResult:
    """`freed_pages` are the caller's again; `written_back_pages` of them were copied to
    host first."""

    freed_pages: array
    written_back_pages: int

    @classmethod
    def from_pb(cls, m: pb.EvictResponse) -> "EvictResult":
        return cls(unpack(m.freed_pages), m.written_back_pages)


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """How a load-back ended. `ok` only when the daemon confirmed the bytes arrived.

    Otherwise `reason` says why (the copy failed, the ack was refused, the daemon or the
    ack stream was lost) and the tokens must be recomputed; `failed_pages` are device
    pages the daemon handed back with a failed load (the caller's again; empty when the
    daemon did not answer). `expired`: the daemon finished the transfer itself because
    it was not acknowledged within the daemon's --ack-timeout (told unasked on the ack stream;
    `reason` says what became of it): a load's device pages other than `failed_pages`
    stay with the cache; an engine-managed save's pages are the engine's, stored or not.
    """

    transfer: int
    ok: bool
    reason: str
    failed_pages: array
    expired: bool = False

    @classmethod
    def success(cls, transfer: int) -> "LoadOutcome":
        return cls(transfer, True, "", array("i"))

    @classmethod
    def failure(cls, transfer: int, reason: str, failed_pages: bytes = b"") -> "LoadOutcome":
        return cls(transfer, False, reason, unpack(failed_pages))

    @classmethod
    def from_pb(cls, m: pb.AckResponse) -> "LoadOutcome":
        if m.expired:
            return cls(m.transfer, False, m.message, unpack(m.failed_pages), True)
        if m.code != 0:
            name = code_from_int(m.code).name
            return cls.failure(m.transfer, f"ack refused ({name}): {m.message}", m.failed_pages)
        if m.load_failed:
            return cls.failure(m.transfer, m.message or "load failed", m.failed_pages)
        return cls.success(m.transfer)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant reported by `check_invariants`."""

    namespace: str
    message: str


__all__ = [
    "EvictResult", "InsertResult", "LoadBackResult", "LoadOutcome", "MatchResult", "Prompt",
    "Registration", "Violation", "as_packed", "pack", "unpack",
]
