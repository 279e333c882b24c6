"""Namespaces whose engines left give their room to new ones (a real daemon).

A namespace outlives its engines (its host tier stays warm for the model's next
engine), so under churn (models retired, replicas with names of their own, an engine
reconfigured onto a new name, a tenant that left) the departed namespaces held
--max-namespaces and the host memory budget for good: every new namespace was refused
until an operator dropped them by hand (the multi-tenant operator's and the LMCache
user's reviews). A Register refused for room now drops the namespace detached longest,
once detached for --reclaim-detached-after."""

import re

import pytest
from radixkv import errors
from radixkv.v1 import radixkv_pb2 as pb

from tests.support.daemon import wait_for
from tests.support.engine import LAYOUT, EngineDouble, prompt

from faultkit import stub_for

PAGES = 16


@pytest.fixture
def engines():
    made: list[EngineDouble] = []

    def engine(target: str, namespace: str) -> EngineDouble:
        e = EngineDouble.connect(target, namespace, num_pages=PAGES, host_pool_pages=PAGES)
        made.append(e)
        return e

    yield engine
    for e in made:
        e.close()


def names(target: str) -> list[str]:
    channel, stub = stub_for(target)
    try:
        return [ns.namespace for ns in stub.Stats(pb.StatsRequest(), timeout=10).namespaces]
    finally:
        channel.close()


def detached_seconds(target: str, namespace: str) -> float:
    channel, stub = stub_for(target)
    try:
        [ns] = stub.Stats(pb.StatsRequest(namespace=namespace), timeout=10).namespaces
        return ns.detached_seconds
    finally:
        channel.close()


def left(engine: EngineDouble, target: str, namespace: str) -> None:
    """The engine goes, and its namespace is seen detached."""
    engine.close()
    wait_for(lambda: detached_seconds(target, namespace) > 0, 10, "the namespace detached")


def test_the_namespace_limit_drops_the_longest_detached_one(daemon_factory, engines):
    d = daemon_factory("--max-namespaces", "3", "--reclaim-detached-after", "0.001", metrics=True)
    a, b = engines(d.target, "churn/a"), engines(d.target, "churn/b")
    a.prefill(prompt(1, pages=4))
    live = engines(d.target, "churn/live")
    left(a, d.target, "churn/a")
    left(b, d.target, "churn/b")
    engines(d.target, "churn/c")  # past the limit: churn/a (detached first) goes, the live one stays
    assert names(d.target) == ["churn/b", "churn/live", "churn/c"]
    log = d.log()
    assert re.search(r"event=namespace\.reclaimed namespace=churn/a for_namespace=churn/c detached_seconds=\S+ "
                     rf"host_tokens={4 * LAYOUT.page_size} ", log), log[-2000:]
    assert "radixkv_namespaces_reclaimed_total 1.0" in d.scrape()
    engines(d.target, "churn/d")  # then churn/b; the live namespace is never taken
    assert names(d.target) == ["churn/live", "churn/c", "churn/d"]
    assert live.client.check_invariants() == []
    with pytest.raises(errors.ResourceExhausted) as refused:  # nothing detached is left
        engines(d.target, "churn/e")
    assert refused.value.metadata == {"limit": "--max-namespaces"}
    assert "DropNamespace one no engine uses" in refused.value.message


def test_a_namespace_detached_for_less_than_the_grace_is_kept(daemon_factory, engines):
    """An engine restarting keeps its warm namespace (default 60 s); 0 turns reclaiming off."""
    for flags in (("--max-namespaces", "1"), ("--max-namespaces", "1", "--reclaim-detached-after", "0")):
        d = daemon_factory(*flags)
        left(engines(d.target, "grace/a"), d.target, "grace/a")
        with pytest.raises(errors.ResourceExhausted, match="namespace limit reached"):
            engines(d.target, "grace/b")
        assert names(d.target) == ["grace/a"]
        d.stop()


def test_the_host_memory_budget_drops_detached_namespaces_until_the_newcomer_fits(daemon_factory, engines):
    pool = PAGES * LAYOUT.page_bytes
    d = daemon_factory("--max-host-memory", str(3 * pool), "--reclaim-detached-after", "0.001")
    first, second = engines(d.target, "budget/a"), engines(d.target, "budget/b")
    third = engines(d.target, "budget/c")
    for e, name in ((first, "budget/a"), (second, "budget/b"), (third, "budget/c")):
        left(e, d.target, name)
    # A pool of two: the two detached longest go, the youngest stays.
    big = EngineDouble.connect(d.target, "budget/big", num_pages=PAGES, host_pool_pages=2 * PAGES)
    try:
        assert names(d.target) == ["budget/c", "budget/big"]
    finally:
        big.close()
