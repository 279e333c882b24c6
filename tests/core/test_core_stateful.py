"""Randomized operation sequences against the core, in every write policy (the machine
and its checks: machine.py)."""

import random

import pytest
from hypothesis import HealthCheck, settings

from machine import CoreMachine, walk


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def machine(policy, eviction="lru", storage="off"):
    """The hypothesis test case for one configuration. Bound only to a `Test*` name at
    module level, so pytest collects each machine once."""
    cls = type(f"CoreMachine_{policy}_{eviction}_{storage}", (CoreMachine,),
               {"policy": policy, "eviction": eviction, "storage": storage})
    case = cls.TestCase
    case.settings = SETTINGS
    return case


TestWriteThrough = machine("write_through")
TestWriteThroughSelective = machine("write_through_selective")
TestWriteBack = machine("write_back")
TestWriteBackLFU = machine("write_back", "lfu")
TestWriteThroughStorageBack = machine("write_through", storage="write_back")
TestWriteBackStorageThrough = machine("write_back", storage="write_through")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy,storage", [
    ("write_through", "off"), ("write_through_selective", "off"), ("write_back", "off"),
    ("write_through", "write_back"), ("write_back", "write_through")])
def test_machine_runs_long_sequences(policy, storage, seed):
    """Long seeded walks per policy, beyond what the shrinking examples cover; the store
    loses everything now and then, with fetches that read it before in flight."""
    m = type("M", (CoreMachine,), {"policy": policy, "storage": storage, "loses_storage": True})()
    walk(m, random.Random(seed), 2000)
    m.teardown()
