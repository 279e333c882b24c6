"""The interface the core calls to move bytes. The data path implements it.

The core decides what to copy and when; an implementation copies and later reports
completion with `HierarchicalCache.on_copy_done(transfer, error)` (fetches: with
`on_fetch_done`). It must never call
back from inside `load` or `backup` (the core is mid-operation there): report on a
later turn of the event loop, or from a test.
"""

from typing import Protocol


class Copier(Protocol):
    def load(self, transfer: int, host_pages: bytes, device_pages: bytes) -> None:
        """Start copying host pages to device pages (host -> device), page i to page i."""

    def backup(self, transfer: int, device_pages: bytes, host_pages: bytes) -> None:
        """Start copying device pages to host pages (device -> host), page i to page i."""

    def store(self, transfer: int, host_pages: bytes, keys: list[bytes]) -> None:
        """Start writing host pages to the storage tier under `keys` (page i as key i).
        Report with `on_copy_done`."""

    def fetch(self, transfer: int, keys: list[bytes], host_pages: bytes, ahead: object = None) -> None:
        """Start reading pages stored under `keys` into host pages; stop at the first
        key missing or unreadable. `ahead`: what the caller of `start_prefetch` read of
        storage already (opaque to the core). Report with `on_fetch_done(transfer, pages_read)`."""
