"""What a storage call raises when the store fails (shared by every backend), and how a
store's URL is shown in errors and logs (`redact_url`)."""

from urllib.parse import urlsplit


class StorageUnavailable(Exception):
    """The store could not be reached, or refused an operation (I/O error, lost
    connection, timeout, out of memory, closed backend). `store` names it (credentials
    left out), `operation` is the call that failed, `__cause__` the underlying error."""

    def __init__(self, store: str, operation: str, cause: BaseException | None = None,
                 detail: str | None = None):
        self.store = store
        self.operation = operation
        reason = detail if detail is not None else f"{type(cause).__name__}: {cause}"
        super().__init__(f"storage {store} unavailable during {operation}: {reason}")


class StorageFull(StorageUnavailable):
    """The store answered but had no room for some pages (a Mooncake pool at capacity,
    evicting in the background): a write refused, not an outage."""


class StorageTimeout(StorageUnavailable):
    """A call the store did not answer within the backend's timeout. The store's own call
    may still be running: `settled` (a concurrent.futures.Future) completes when it
    returns, and until then it may still read or write the buffers it was given."""

    def __init__(self, store: str, operation: str, seconds: float, settled):
        super().__init__(store, operation, detail=f"no answer within {seconds:g}s")
        self.settled = settled


__all__ = ["StorageFull", "StorageTimeout", "StorageUnavailable"]


def redact_url(url: str) -> str:
    """The URL without credentials and query (which may carry a password)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # a malformed port: show none rather than fail while reporting
        port = None
    host = (parts.hostname or "") + (f":{port}" if port is not None else "")
    return f"{parts.scheme}://{host}{parts.path}"
