"""Host->device load-backs: planning against the current tree, pins, ACKs, failures.

A load-back publishes its device pages in the tree at once, so later matches and
load-backs see them (with this transfer as a dependency) instead of loading the same
nodes twice. Every source node carries the transfer in its pin set until the ACK; pins
of different transfers may overlap in every write policy, and each ACK removes only
its own. Loaded nodes stay locked, and their host copies host-locked, until the ACK.
"""

from .copier import Copier
from .errors import NotOwner, NotReady, UnknownTransfer
from .node import Node
from .results import FinishResult, LoadBackResult
from .state import CacheState
from .transfers import Transfer, TransferKind


class LoadBacks:
    """Receives the cache's state and copier."""

    def __init__(self, state: CacheState, copier: Copier):
        self.state = state
        self.copier = copier

    def load_back(self, node_id: int, device_pages: bytes, owner: object = None) -> LoadBackResult:
        """Load the host-only part of `node_id`'s path into the caller's `device_pages`.

        Re-plans against the current tree: nodes already on the device (perhaps still
        arriving: see `depends_on`) are not loaded again, and pages not needed come back
        in `unused_pages`. With too few pages, only whole nodes from the top that fit are
        loaded. Mutates: publishes device pages, pins and host-locks the source nodes,
        locks the loaded path until `finish_load_back`, starts the copy.
        Raises UnknownNode, InvalidRequest / PageOwnershipError before changing anything.
        """
        state = self.state
        node = state.tree.get(node_id)
        state.device.check_new(device_pages, "LoadBack")
        on_device, loaded = self._plan(node, len(device_pages) // 4)
        now = state.tick()
        for n in on_device:
            state.touch(n, now)  # needed again: a write-back in flight keeps it on device
        depends_on = tuple(sorted(state.copying(on_device)))
        tid, used = 0, 0
        if loaded:
            tid = state.reserve_transfer_id()
            used = self._start(tid, on_device, loaded, device_pages, depends_on, owner, now)
        prefix = on_device + loaded
        return LoadBackResult(
            transfer=tid,
            device_pages=b"".join(n.full.device_pages for n in prefix),
            device_tokens=sum(state.tokens(n) for n in prefix),
            loaded_tokens=sum(state.tokens(n) for n in loaded),
            depends_on=depends_on,
            unused_pages=device_pages[used:],
        )

    def _plan(self, node: Node, budget: int) -> tuple[list[Node], list[Node]]:
        """The path's device prefix, and the host-only nodes after it that fit in
        `budget` pages (whole nodes, from the top)."""
        path = list(reversed(node.path()))
        first = next((i for i, n in enumerate(path) if n.full.device_pages is None), len(path))
        loaded: list[Node] = []
        for n in path[first:]:
            pages = self.state.pages(n)
            if pages > budget:
                break
            budget -= pages
            loaded.append(n)
        return path[:first], loaded

    def _start(self, tid: int, on_device: list[Node], loaded: list[Node], device_pages: bytes,
               depends_on: tuple[int, ...], owner: object, now: int) -> int:
        """Pin, publish, lock and start copy `tid`; returns the bytes of `device_pages` used."""
        state = self.state
        # Nodes still arriving through earlier loads: this load's prefix relies on their
        # host copies too, so it pins them as well until its own ACK.
        shared = [n for n in on_device if state.copying((n,))]
        for n in shared:
            state.pin(n, tid)
        used = 0
        for n in loaded:
            k = state.pages(n) * 4
            state.pin(n, tid)
            state.set_device(n, device_pages[used:used + k])
            state.touch(n, now)
            used += k
        t = state.new_transfer(TransferKind.LOAD, loaded, tid, anchor=loaded[-1], shared=shared,
                               depends_on=depends_on, owner=owner)
        for d in depends_on:
            state.transfers[d].dependents[tid] = None
        state.lock_path(t.anchor)
        state.counters.loaded_tokens += sum(state.tokens(n) for n in loaded)
        self.copier.load(tid, t.host_pages, t.device_pages)
        return used

    def finish(self, transfer: int, owner: object = None) -> FinishResult:
        """Acknowledge a load-back: drop its pins on the anchor's path, refresh duplicate
        tracking on every node of that path (every policy: a node first becomes a
        device+host duplicate here when its host copy came from storage), release the
        host locks and the path lock.

        Raises NotReady while this copy or one it depends on is still running (the RPC
        layer waits and retries), UnknownTransfer for an id not in flight or not a
        load-back, and NotOwner when `owner` is given and the transfer is another's.
        A failed load finishes too: its device pages come back in `failed_pages`.
        """
        state = self.state
        t = self._acknowledgeable(transfer, owner)
        del state.transfers[transfer]
        for d in t.depends_on:
            if d in state.transfers:
                del state.transfers[d].dependents[transfer]
        for n in t.anchor.path():
            state.unpin(n, transfer)
        state.unlock_path(t.anchor)
        if t.parked:
            state.device.give_back(t.parked)
        return FinishResult(transfer, t.error, t.parked)

    def _acknowledgeable(self, transfer: int, owner: object) -> Transfer:
        """The load-back `transfer`, if `owner` may acknowledge it now; raises otherwise."""
        transfers = self.state.transfers
        t = transfers.get(transfer)
        if t is None or t.kind is not TransferKind.LOAD:
            raise UnknownTransfer(
                f"transfer {transfer} is not a load-back in flight (never started, or already acknowledged)"
            )
        if owner is not None and t.owner is not None and t.owner != owner:
            raise NotOwner(f"transfer {transfer} belongs to another session")
        waiting = tuple(
            tid for tid in (transfer, *t.depends_on)
            if tid in transfers and not transfers[tid].copied
        )
        if waiting:
            raise NotReady(f"transfer {transfer} is still copying", waiting)
        return t

    def copied(self, t: Transfer, error: str | None) -> None:
        """The data path finished load-back `t`'s copy; a failed one leaves the tree now,
        with every load that depends on it. The ACK (`finish`) comes separately."""
        t.copied = True
        if error is not None:
            self._fail(t, f"copy failed: {error}")

    def _fail(self, first: Transfer, reason: str) -> None:
        """The bytes of `first` will not arrive: fail every load that builds on it, then
        take each one's device pages out of the tree (parked until its ACK returns them),
        dependents before what they build on (no recursion: chains may be long)."""
        if first.error is not None:
            return
        first.error = reason
        failed, todo = [], [first]
        while todo:
            t = todo.pop()
            failed.append(t)
            for d in list(t.dependents):
                dependent = self.state.transfers[d]
                if dependent.error is None:
                    dependent.error = f"depends on failed transfer {t.id}"
                    todo.append(dependent)
        for t in reversed(failed):
            parked = [self.state.clear_device(n) for n in reversed(t.nodes)]
            t.parked = b"".join(reversed(parked))
            self.state.counters.failed_load_tokens += sum(self.state.tokens(n) for n in t.nodes)

    def pending(self, owner: object) -> list[int]:
        """Load-backs of `owner` not yet acknowledged."""
        return [tid for tid, t in self.state.transfers.items()
                if t.kind is TransferKind.LOAD and t.owner == owner]


__all__ = ["LoadBacks"]
