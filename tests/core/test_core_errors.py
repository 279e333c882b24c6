"""Every error a caller can cause: a typed exception, a clear message, no state change."""

import pytest
from radixkv_server.core import (
    InvalidRequest, LockError, NotOwner, PageOwnershipError, UnknownNode, UnknownTransfer,
)
from radixkv_server.core.invariants import state_digest
from radixkv_server.core.pages import pack

from harness import Engine, make_cache, tokens


@pytest.fixture
def setup():
    """A cache with one device prompt [1..4] (pages held), one host-only prompt [5..8],
    and one load-back in flight owned by 'alice'."""
    cache, copier = make_cache("write_back", page_size=2, device_pages=16, host_pages=16)
    eng = Engine(cache, copier)
    eng.insert(tokens(5, 6, 7, 8))
    r = cache.evict_device(2)
    eng.give(copier.complete(cache, r.pending[0]).freed_pages)
    eng.insert(tokens(1, 2, 3, 4))
    eng.insert(tokens(9, 9))
    cache.evict_device(1)  # a write-back stays in flight
    lb = cache.load_back(cache.match(tokens(5, 6, 7, 8)).host_node, pack(eng.alloc(2)), owner="alice")
    assert cache.check_invariants() == []
    held = sorted(cache.device.held_pages())
    cache.device_node = cache.match(tokens(1, 2, 3, 4)).host_node  # looked up before the digest
    return cache, eng, held, lb.transfer


def case(name, exc, text, call):
    return pytest.param(exc, text, call, id=name)


CASES = [
    case("match-odd-bytes", InvalidRequest, "multiple of 4", lambda c, e, h, t: c.match(b"\x01\x02\x03")),
    case("insert-odd-bytes", InvalidRequest, "multiple of 4", lambda c, e, h, t: c.insert(b"\x01", b"")),
    case("insert-empty", InvalidRequest, "no tokens", lambda c, e, h, t: c.insert(b"", b"")),
    case("insert-misaligned", InvalidRequest, "whole number of pages",
         lambda c, e, h, t: c.insert(tokens(1, 2, 3), pack([10, 11]))),
    case("insert-too-few-pages", InvalidRequest, "need 2 device pages, got 1",
         lambda c, e, h, t: c.insert(tokens(7, 7, 7, 7), pack([10]))),
    case("insert-too-many-pages", InvalidRequest, "need 1 device pages, got 2",
         lambda c, e, h, t: c.insert(tokens(7, 7), pack([10, 11]))),
    case("insert-page-out-of-range", InvalidRequest, "out of range",
         lambda c, e, h, t: c.insert(tokens(7, 7), pack([16]))),
    case("insert-negative-page", InvalidRequest, "out of range",
         lambda c, e, h, t: c.insert(tokens(7, 7), pack([-1]))),
    case("insert-page-twice", PageOwnershipError, "listed twice",
         lambda c, e, h, t: c.insert(tokens(7, 7, 8, 8), pack([10, 10]))),
    case("insert-page-held-by-cache", PageOwnershipError, "already held",
         lambda c, e, h, t: c.insert(tokens(7, 7), pack([h[0]]))),
    case("load-back-unknown-node", UnknownNode, "not in the cache",
         lambda c, e, h, t: c.load_back(12345, pack([10]))),
    case("load-back-page-held", PageOwnershipError, "already held",
         lambda c, e, h, t: c.load_back(c.match(tokens(5, 6, 7, 8)).host_node, pack([h[0]]))),
    case("load-back-page-out-of-range", InvalidRequest, "out of range",
         lambda c, e, h, t: c.load_back(c.match(tokens(5, 6, 7, 8)).host_node, pack([99]))),
    case("load-back-odd-bytes", InvalidRequest, "multiple of 4",
         lambda c, e, h, t: c.load_back(c.match(tokens(5, 6, 7, 8)).host_node, b"\x00")),
    case("ack-unknown", UnknownTransfer, "not a load-back in flight", lambda c, e, h, t: c.finish_load_back(777)),
    case("ack-a-backup", UnknownTransfer, "not a load-back in flight",
         lambda c, e, h, t: c.finish_load_back(min(c.transfers))),
    case("ack-foreign", NotOwner, "another session", lambda c, e, h, t: c.finish_load_back(t, owner="bob")),
    case("copy-done-unknown", UnknownTransfer, "never started", lambda c, e, h, t: c.on_copy_done(777)),
    case("lock-unknown", UnknownNode, "not in the cache", lambda c, e, h, t: c.lock(12345)),
    case("unlock-unlocked", LockError, "not locked",
         lambda c, e, h, t: c.unlock(c.device_node)),
]


@pytest.mark.parametrize("exc,text,call", CASES)
def test_each_domain_error(setup, exc, text, call):
    cache, eng, held, transfer = setup
    before = state_digest(cache)
    with pytest.raises(exc, match=text):
        call(cache, eng, held, transfer)
    assert state_digest(cache) == before
    assert cache.check_invariants() == []
