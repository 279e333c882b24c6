"""Domain errors a caller can cause. The RPC layer maps each class to one gRPC status.

Every error is raised before the cache changes any state, so a failed call leaves the
tree, the pools and the transfers exactly as they were.
"""


class CacheError(Exception):
    """Base class: a request the cache refuses. The message says what was wrong."""


class InvalidRequest(CacheError):
    """Malformed input: misaligned tokens, wrong page counts, out-of-range page indices."""


class PageOwnershipError(InvalidRequest):
    """A device page the caller passed is already held by the cache (or passed twice)."""


class UnknownNode(CacheError):
    """The node id names no node, usually because it was evicted since the match."""


class UnknownTransfer(CacheError):
    """The transfer id names no transfer in flight (never started, or already finished)."""


class NotReady(CacheError):
    """The operation must wait for copies still in flight; `transfers` names them.

    Not a caller error: the RPC layer awaits those copies and retries the call.
    """

    def __init__(self, message: str, transfers: tuple[int, ...]):
        super().__init__(message)
        self.transfers = transfers


class NotOwner(CacheError):
    """The transfer belongs to another session."""


class LockError(CacheError):
    """Unlock of a node that holds no lock."""
