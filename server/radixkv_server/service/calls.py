"""What an engine asks of a namespace, and what it gets back: small frozen types.

The servicer builds the requests from protobuf messages (`convert`), a `Namespace`
answers them, and the servicer turns the answers back into messages. Core results
travel inside the answers unchanged; the answers add what the service layer owns
(lease ids, storage probes, CUDA layer events).
"""

import enum
from dataclasses import dataclass

from ..core.results import FetchOutcome, InsertResult, LoadBackResult, MatchResult


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a Match: packed int32 tokens and the key separating equal prefixes."""

    tokens: bytes
    extra_key: bytes = b""


@dataclass(frozen=True, slots=True)
class MatchAnswer:
    """A prompt's match; `lease` is 0 unless one was asked for and something matched;
    `storage_tokens` counts the tokens past the cache that storage holds (when asked)."""

    result: MatchResult
    lease: int = 0
    storage_tokens: int = 0
    complete_tokens: int = 0  # engine-managed: host tokens every rank's shard arrived for


@dataclass(frozen=True, slots=True)
class InsertRequest:
    """Finished KV: `device_pages[i]` holds page i of `tokens`. `release_lease` (0: none)
    is released once the insert succeeded; `lease` takes one on the inserted path."""

    tokens: bytes
    device_pages: bytes
    extra_key: bytes = b""
    chunked: bool = False
    release_lease: int = 0
    lease: bool = False
    async_: bool = False  # engine-managed: answer with the save's transfer at once


@dataclass(frozen=True, slots=True)
class InsertAnswer:
    result: InsertResult
    lease: int = 0
    transfer: int = 0  # engine-managed async save: acknowledge it before reusing the pages


@dataclass(frozen=True, slots=True)
class LoadBackAnswer:
    """The core's answer, plus one CUDA IPC event per layer on the cuda backend."""

    result: LoadBackResult
    layer_events: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class EvictAnswer:
    freed_pages: bytes
    written_back_pages: int


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best_effort"      # answer once the fetch started
    WAIT_COMPLETE = "wait_complete"  # answer once it completed
    TIMEOUT = "timeout"              # wait at most the request's timeout


@dataclass(frozen=True, slots=True)
class PrefetchRequest:
    tokens: bytes
    extra_key: bytes = b""
    policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    timeout: float | None = None  # seconds, for PrefetchPolicy.TIMEOUT (None: no limit)


class PrefetchState(enum.Enum):
    NOTHING = "nothing"              # storage holds nothing past the cache
    STARTED = "started"
    DONE = "done"
    WAITING_ENDED = "waiting_ended"  # the timeout passed; the fetch goes on


@dataclass(frozen=True, slots=True)
class PrefetchStep:
    """One progress report of a prefetch; token counts are whole pages."""

    state: PrefetchState
    transfer: int = 0
    storage_tokens: int = 0
    fetched_tokens: int = 0
    host_tokens_added: int = 0

    @classmethod
    def done(cls, transfer: int, storage_tokens: int, outcome: FetchOutcome | None,
             page_size: int) -> "PrefetchStep":
        if outcome is None:  # finished before anyone waited: nothing to report
            return cls(PrefetchState.DONE, transfer, storage_tokens)
        return cls(PrefetchState.DONE, transfer, storage_tokens,
                   outcome.pages_read * page_size, outcome.added_tokens)
