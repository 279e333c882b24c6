"""Ids a restarted daemon does not hand out again.

Engines keep node, lease and transfer ids across calls, and a daemon that restarts
(SIGKILL, upgrade) behind the same socket is reached by the same engines, which may still
hold ids from before. Counted from 1 in every process, an old id named a new daemon's
node, lease or transfer of the same number: a held hit loaded another prompt's KV. Each
counter starts at a random point instead, so an old id is unknown (NOT_FOUND) and the
engine matches or recomputes.
"""

import itertools
import secrets
from collections.abc import Iterator

_START_BELOW = 1 << 52  # ids stay exact in a float64 (JSON readers of grpcurl output) and far from 2**64


def fresh_ids() -> Iterator[int]:
    """A counter of positive ids from a random start (distinct per call and per process)."""
    return itertools.count(secrets.randbelow(_START_BELOW) + 1)


__all__ = ["fresh_ids"]
