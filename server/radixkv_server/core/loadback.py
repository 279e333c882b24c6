"""Host->device load-backs: planning against the current tree, pins, ACKs, failures.

A load-back publishes its device pages in the tree at once, so later matches and
load-backs see them (with this transfer as a dependency) instead of loading the same
nodes twice. Every source node carries the transfer in its pin set until the ACK; pins
of different transfers may overlap in every write policy, and each ACK removes only
its own. Loaded nodes stay locked, and their host copies host-locked, until the ACK.
"""

from .errors import NotOwner, NotReady, UnknownTransfer
from .eviction import Evictions
from .node import Node
from .results import FinishResult, LoadBackResult
from .transfers import Transfer, TransferKind


class LoadBacks(Evictions):
    def load_back(self, node_id: int, device_pages: bytes, owner: object = None) -> LoadBackResult:
        """Load the host-only part of `node_id`'s path into the caller's `device_pages`.

        Re-plans against the current tree: nodes already on the device (perhaps still
        arriving: see `depends_on`) are not loaded again, and pages not needed come back
        in `unused_pages`. With too few pages, only whole nodes from the top that fit are
        loaded. Mutates: publishes device pages, pins and host-locks the source nodes,
        locks the loaded path until `finish_load_back`, starts the copy.
        Raises UnknownNode, InvalidRequest / PageOwnershipError before changing anything.
        """
        node = self.tree.get(node_id)
        self.device.check_new(device_pages, "LoadBack")
        path = list(reversed(node.path()))
        first = next((i for i, n in enumerate(path) if n.full.device_pages is None), len(path))
        on_device, to_load = path[:first], path[first:]
        budget = len(device_pages) // 4
        loaded: list[Node] = []
        for n in to_load:
            if self._pages(n) > budget:
                break
            budget -= self._pages(n)
            loaded.append(n)

        now = self._tick()
        for n in on_device:
            n.full.evicting = False  # needed again: a write-back in flight keeps it on device
            n.last_access = now
        depends_on = tuple(sorted(self._copying(on_device)))
        tid, used = 0, 0
        if loaded:
            tid = self._reserve_transfer_id()
            # Nodes still arriving through earlier loads: this load's prefix relies on
            # their host copies too, so it pins them as well until its own ACK.
            shared = [n for n in on_device if self._copying((n,))]
            for n in shared:
                n.full.pins.add(tid)
                n.full.host_lock += 1
                self._refresh(n)
            for n in loaded:
                k = self._pages(n) * 4
                pages = device_pages[used:used + k]
                used += k
                s = n.full
                s.pins.add(tid)
                s.host_lock += 1
                self.device.take(pages)
                self._set_device(n, pages)
                n.last_access = now
            t = self._new_transfer(TransferKind.LOAD, loaded, tid, anchor=loaded[-1], shared=shared,
                                   depends_on=depends_on, owner=owner)
            for d in depends_on:
                self.transfers[d].dependents.append(tid)
            self._lock_path(t.anchor)
            self.counters.loaded_tokens += sum(self._tokens(n) for n in loaded)
            self._copier.load(tid, t.host_pages, t.device_pages)
        prefix = on_device + loaded
        return LoadBackResult(
            transfer=tid,
            device_pages=b"".join(n.full.device_pages for n in prefix),
            device_tokens=sum(self._tokens(n) for n in prefix),
            loaded_tokens=sum(self._tokens(n) for n in loaded),
            depends_on=depends_on,
            unused_pages=device_pages[used:],
        )

    def finish_load_back(self, transfer: int, owner: object = None) -> FinishResult:
        """Acknowledge a load-back: drop its pins on the anchor's path, refresh duplicate
        tracking on every node of that path (every policy: a node first becomes a
        device+host duplicate here when its host copy came from storage), release the
        host locks and the path lock.

        Raises NotReady while this copy or one it depends on is still running (the RPC
        layer waits and retries), UnknownTransfer for an id not in flight or not a
        load-back, and NotOwner when `owner` is given and the transfer is another's.
        A failed load finishes too: its device pages come back in `failed_pages`.
        """
        t = self.transfers.get(transfer)
        if t is None or t.kind is not TransferKind.LOAD:
            raise UnknownTransfer(
                f"transfer {transfer} is not a load-back in flight (never started, or already acknowledged)"
            )
        if owner is not None and t.owner is not None and t.owner != owner:
            raise NotOwner(f"transfer {transfer} belongs to another session")
        waiting = tuple(
            tid for tid in (transfer, *t.depends_on)
            if tid in self.transfers and not self.transfers[tid].copied
        )
        if waiting:
            raise NotReady(f"transfer {transfer} is still copying", waiting)
        del self.transfers[transfer]
        for d in t.depends_on:
            if d in self.transfers:
                self.transfers[d].dependents.remove(transfer)
        for n in (*t.shared, *t.nodes):
            n.full.host_lock -= 1
        for n in t.anchor.path():
            n.full.pins.discard(transfer)
            self._refresh(n)
        self._unlock_path(t.anchor)
        if t.parked:
            self.device.give_back(t.parked)
        return FinishResult(transfer, t.error, t.parked)

    def _fail_load(self, t: Transfer, reason: str) -> None:
        """The bytes of `t` will not arrive: take its device pages out of the tree now
        (parked until the ACK returns them), and fail every load that builds on it."""
        if t.error is not None:
            return
        t.error = reason
        for d in list(t.dependents):
            self._fail_load(self.transfers[d], f"depends on failed transfer {t.id}")
        parked = [self._clear_device(n) for n in reversed(t.nodes)]
        t.parked = b"".join(reversed(parked))
        self.counters.failed_load_tokens += sum(self._tokens(n) for n in t.nodes)

    def pending_loads(self, owner: object) -> list[int]:
        """Load-backs of `owner` not yet acknowledged."""
        return [tid for tid, t in self.transfers.items()
                if t.kind is TransferKind.LOAD and t.owner == owner]
