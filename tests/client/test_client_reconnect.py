"""The client's reconnect schedule: capped exponential backoff with jitter, and the
lost-session state both clients drive (no I/O)."""

import random

import pytest

from radixkv import errors
from radixkv.reconnect import Backoff, Recovery


def test_backoff_grows_to_its_cap_with_jitter_below():
    b = Backoff(initial=0.1, maximum=1.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(1)
    for attempt, base in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]):
        delays = [b.delay(attempt, rng) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in delays)
        assert max(delays) - min(delays) > base * 0.3  # jittered: engines do not retry in step
    assert b.delay(10**6, rng) <= 1.0  # no overflow on long outages


def test_no_jitter_is_exact():
    assert Backoff(initial=0.5, maximum=4, jitter=0).delay(2) == 2.0


@pytest.mark.parametrize("bad", [dict(initial=-1), dict(initial=2, maximum=1), dict(multiplier=0.5),
                                 dict(jitter=1.5)])
def test_bad_backoff_is_refused(bad):
    with pytest.raises(ValueError):
        Backoff(**bad)


def test_recovery_schedule():
    r = Recovery(Backoff(initial=1.0, maximum=8.0, jitter=0), random.Random(0))
    assert not r.lost
    r.lose("stream broke", now=100.0)
    r.lose("a later reason", now=105.0)  # the first reason and schedule stay
    assert r.lost and r.reason == "stream broke" and r.due(100.0)
    r.failed(now=100.0)
    assert not r.due(100.5) and r.due(101.0) and r.wait_time(100.25) == 0.75
    r.failed(now=101.0)
    assert r.next_at == 103.0 and r.attempts == 2
    r.recovered()
    assert not r.lost and r.attempts == 0


def test_wait_ready_says_why_it_cannot_connect(tmp_path):
    """A wrong socket path is not a slow daemon: the error names the connect failure."""
    from radixkv.client import Client
    c = Client(f"unix://{tmp_path}/no-such-dir/radixkv.sock", timeout=5)
    try:
        with pytest.raises(errors.Unavailable, match="No such file or directory"):
            c.wait_ready(0.5)
    finally:
        c.close()
