"""The residency seam (issue #13's KV events build on it): a listener that records every
("device" | "host" | "storage", "stored" | "removed", node) call must, after every step
of a randomized walk, hold exactly what the tree holds on each tier.

Pages are recorded by identity (extra_key and the prefix through the page), the form a
KV event names a block in, so a split (which reports nothing) changes nothing here.
"""

import random

import pytest

from harness import identity
from machine import PAGE, CoreMachine, walk

TIERS = ("device", "host", "storage")


def page_identities(node, page_size: int) -> set[bytes]:
    """Identities of the node's pages: extra_key and the whole prefix through each."""
    prompt = b"".join(n.key for n in reversed(node.path()))
    stride = page_size * 4
    first = (len(prompt) - len(node.key)) // stride
    return {identity(prompt, node.extra_key, i, page_size) for i in range(first, len(prompt) // stride)}


class Recorder:
    """A residency listener that keeps one set of page identities per tier, and notes
    any call that does not fit what it heard before."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.tiers: dict[str, set[bytes]] = {tier: set() for tier in TIERS}
        self.calls = 0
        self.errors: list[str] = []

    def residency_changed(self, tier, change, node) -> None:
        self.calls += 1
        pages = page_identities(node, self.page_size)
        held = self.tiers[tier]
        if change == "stored":
            if tier != "storage" and pages & held:  # storage may be written twice
                self.errors.append(f"{tier} stored twice: node {node.id}")
            held |= pages
        elif change == "removed":
            if not pages <= held:
                self.errors.append(f"{tier} removed but never stored: node {node.id}")
            held -= pages
        else:
            self.errors.append(f"unknown change {change!r}")


def tree_residency(cache) -> dict[str, set[bytes]]:
    """Page identities per tier as the tree holds them (device pages published; valid
    host copies)."""
    out = {"device": set(), "host": set()}
    for node in cache.tree.iter_nodes():
        pages = page_identities(node, cache.config.page_size)
        if node.full.device_pages is not None:
            out["device"] |= pages
        if node.full.host_valid:
            out["host"] |= pages
    return out


class ListenedMachine(CoreMachine):
    loses_storage = True
    def __init__(self):
        super().__init__()
        self.recorder = Recorder(PAGE)
        self.cache.residency_listener = self.recorder
        self.lost = False

    def storage_lost(self):
        super().storage_lost()
        self.lost = True

    def check_all(self) -> None:
        super().check_all()
        self.residency_matches()

    def residency_matches(self) -> None:
        rec = self.recorder
        assert rec.errors == []
        tree = tree_residency(self.cache)
        assert rec.tiers["device"] == tree["device"]
        assert rec.tiers["host"] == tree["host"]
        # Storage reports removals only when the store lost everything (`storage_lost`),
        # and then only for nodes in the tree: until such a loss, what was stored is
        # exactly what the storage tier holds; after one, every page it holds was told,
        # and so was every page of a node the tree records as stored.
        held = set(self.copier.storage.values())
        if not self.lost:
            assert rec.tiers["storage"] == held
        assert held <= rec.tiers["storage"]
        stored = set()
        for node in self.cache.tree.iter_nodes():
            if node.full.stored:
                stored |= page_identities(node, self.cache.config.page_size)
        assert stored <= rec.tiers["storage"]


@pytest.mark.parametrize("policy,storage", [
    ("write_through", "off"), ("write_through_selective", "off"), ("write_back", "off"),
    ("write_through", "write_back"), ("write_back", "write_through")])
def test_listener_sees_every_residency_change(policy, storage):
    m = type("M", (ListenedMachine,), {"policy": policy, "storage": storage})()
    walk(m, random.Random(7), 1500)
    m.teardown()
    m.residency_matches()
    assert m.recorder.calls > 0
    if storage != "off":
        assert m.recorder.tiers["storage"], "the walk stored nothing: the storage check saw nothing"
    assert m.recorder.tiers["device"] == set()  # teardown evicted the whole device tier

