"""The storage tier's health as the daemon tells it (storage/health.py): one outage per
direction for the whole daemon, whichever namespace's call began or ended it; a full
store's refusals counted and said at most once a minute, never an outage (a busy
Mooncake pool refused 7% of store batches and made 6 log lines a second, and the
signal flapped too fast for any alert to hold)."""

import logging

from radixkv_server.storage.health import FULL_SAID_EVERY_S, StorageHealth


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def said(caplog, event: str) -> list[dict]:
    """The fields of each `event` line logged."""
    return [r.fields for r in caplog.records if r.getMessage() == event]


def test_an_outage_is_the_stores_whichever_namespace_sees_it(caplog):
    h = StorageHealth("redis://x")
    with caplog.at_level(logging.INFO, logger="radixkv.storage"):
        h.failed("write", "OOM", "a")
        h.failed("write", "OOM", "b")  # the same outage: not said again
        assert (h.failing, h.reads_answer) == ({"write": "OOM"}, True)
        assert h.answered("read", "b") is False  # reads never failed
        assert h.answered("write", "b") is True and h.failing == {}
        assert h.answered("write", "a") is False
    [down] = said(caplog, "storage.unavailable")
    [up] = said(caplog, "storage.recovered")
    assert (down["namespace"], down["direction"], up["namespace"], up["direction"]) == ("a", "write", "b", "write")
    h.failed("read", "refused", "a")
    assert not h.reads_answer


def test_a_full_store_is_no_outage_and_is_said_once_a_minute(caplog):
    clock = Clock()
    h = StorageHealth("mooncake://x", clock=clock)
    with caplog.at_level(logging.INFO, logger="radixkv.storage"):
        for _ in range(500):  # a minute of a busy fleet's refusals
            h.full("store full: 6 of 8 pages not stored (code -200)", "a")
            clock.now += FULL_SAID_EVERY_S / 1000
        assert h.failing == {} and h.full_refusals == 500
        [first] = said(caplog, "storage.store_full")
        assert first["refused_stores"] == 1
        clock.now += FULL_SAID_EVERY_S
        h.full("store full", "b")
        first, second = said(caplog, "storage.store_full")
        assert second["refused_stores"] == 500  # those since the last line, this one too


def test_a_read_outage_a_lookup_began_ends_with_any_namespaces_lookup_one_a_fetch_began_with_a_fetch():
    h = StorageHealth("redis://x")
    h.failed("read", "refused", "a", by="lookup")  # a's lookup failed; a goes quiet
    assert h.answered("read", "b", by="lookup") and h.reads_answer  # b's lookup answered
    h.failed("read", "segment owner gone", "a")  # a fetch failed
    assert not h.answered("read", "b", by="lookup") and not h.reads_answer
    assert h.answered("read", "b") and h.reads_answer  # a fetch answered
