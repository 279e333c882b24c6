"""Paths thousands of nodes deep: one node per turn of a conversation or per chunk of a
chunked prefill, so the engine sets the depth. Dropping the device tier (an engine's
Close, a warm re-Register) and a storage probe of a path storage does not hold yet walk
such a path without recursion: at about a thousand nodes they raised RecursionError, the
Close left the engine's buffers open and every later Register of the namespace failed
(found by a review of the work on the event loop)."""

from harness import Engine, make_cache, tokens

DEPTH = 1500  # past Python's default recursion limit of 1000


def deep_cache(policy: str, storage: str = "off"):
    """A path of DEPTH one-page nodes, each turn extending the last."""
    cache, copier = make_cache(policy, page_size=1, device_pages=DEPTH + 8, host_pages=DEPTH + 8, storage=storage)
    eng = Engine(cache, copier)
    for turn in range(1, DEPTH + 1):
        eng.insert(tokens(*range(turn)))
    assert cache.match(tokens(*range(DEPTH))).device_tokens == DEPTH
    return cache, copier, eng


def test_dropping_the_device_tier_of_a_deep_path():
    cache, copier, eng = deep_cache("write_back")  # device only: every node leaves
    assert cache.drop_device(DEPTH + 8) == DEPTH
    assert cache.match(tokens(*range(DEPTH))).device_tokens == 0
    assert cache.check_invariants() == []


def test_a_storage_probe_of_a_deep_path_storage_does_not_hold():
    cache, copier, eng = deep_cache("write_back", storage="write_back")
    longer = tokens(*range(DEPTH + 3))
    probe = cache.storage_probe(longer)
    assert len(probe.keys) == 3  # the pages after the cached prefix, keyed down the whole chain
    assert cache.check_invariants() == []
