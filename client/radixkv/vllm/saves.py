"""A worker's asynchronous saves, and when vLLM may free a finished request's blocks.

Each Insert the worker starts (`start`) copies vLLM blocks in the daemon's copy threads
after the call returned; vLLM must not reuse those blocks until the daemon acknowledged
the copy. The worker reports, per request, how many of its planned saves are over
(`report`, in the worker metadata); the scheduler answers `request_finished` with True
while a save of the request is not over on every rank, and names such requests in the
next step's metadata (`delayed`). This worker then lists a delayed request in `finished`
(vLLM's `get_finished` finished_sending) once none of its copies is in flight. `flush`
waits for the copies of preempted requests, whose blocks vLLM frees at once.
"""

from .daemon import DaemonAdapter
from .metadata import SaveSpec


FINISHED_KEPT = 1 << 16  # finished ids remembered (vLLM names a request's delay and finish in one step)


class Saves:
    """Copies in flight per request (worker thread only)."""

    def __init__(self, adapter: DaemonAdapter):
        self._adapter = adapter
        self._pending: dict[str, set[int]] = {}  # request -> transfers in flight
        self._transfers: dict[int, str] = {}  # transfer in flight -> request
        self._over: dict[str, int] = {}  # request -> saves over since the last report
        self._finished: dict[str, None] = {}  # vLLM reported them finished (the latest ones)
        self._delayed: set[str] = set()  # finished, blocks kept until we list them

    def start(self, spec: SaveSpec) -> None:
        """Start the Insert of `spec`'s blocks (over at once when nothing is copied)."""
        transfer = self._adapter.save(spec.tokens, spec.block_ids)
        if transfer:
            self._pending.setdefault(spec.req_id, set()).add(transfer)
            self._transfers[transfer] = spec.req_id
        else:
            self.skip(spec.req_id)

    def skip(self, req_id: str) -> None:
        """A save planned for `req_id` and not started: over."""
        self._over[req_id] = self._over.get(req_id, 0) + 1

    def flush(self, req_ids) -> None:
        """Wait until no copy of `req_ids` is in flight (their blocks are about to be reused)."""
        ids = set().union(*(self._pending.get(r, ()) for r in req_ids))
        if ids:
            self._landed(self._adapter.done(ids, timeout=None))

    def finished(self, finished_req_ids, delayed) -> set[str]:
        """The `delayed` requests (now or before) that vLLM reported finished (now or
        before) with no copy in flight: vLLM frees their blocks. Each is returned once."""
        self._finished.update(dict.fromkeys(finished_req_ids))
        while len(self._finished) > FINISHED_KEPT:
            del self._finished[next(iter(self._finished))]
        self._delayed.update(delayed)
        self.poll()
        ready = {r for r in self._delayed if r in self._finished and not self._pending.get(r)}
        self._delayed -= ready
        for r in ready:
            del self._finished[r]
        return ready

    def poll(self) -> None:
        """Take the acks that arrived (never blocks)."""
        if self._transfers:
            self._landed(self._adapter.done(list(self._transfers)))

    def report(self) -> dict[str, int]:
        """Request -> saves over since the last report."""
        over, self._over = self._over, {}
        return over

    def _landed(self, done: set[int]) -> None:
        for t in done:
            req_id = self._transfers.pop(t, None)
            if req_id is None:
                continue
            pending = self._pending.get(req_id)
            if pending is not None:
                pending.discard(t)
                if not pending:
                    del self._pending[req_id]
            self.skip(req_id)


__all__ = ["Saves"]
