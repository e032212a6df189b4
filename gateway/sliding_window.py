"""Sliding-window rate counters: per-second buckets over the last minute.

A tenant's requests (RPM) and tokens (TPM) are each a map ``unix second -> amount``. At time
``now`` the window holds the buckets ``b`` with ``floor(now) - b <= WINDOW_S`` (61 buckets:
the current second and the 60 before it):

    b-1 |  b  | b+1 | ... | b+60 | b+61
        [ counted from b until b + SPAN_S )

so two events at most 60 s apart are always counted together, and no closed 60 s interval
ever holds more than the limit wherever the minute boundary falls (fixed per-minute windows
let a burst at :59 and another at :00 both through: twice the limit in a second). The price
is up to one second of extra wait. A bucket leaves the window at ``b + SPAN_S``; Retry-After
is the time until enough of the oldest buckets have left.

MemoryStore uses these helpers; RedisStore runs the same arithmetic in Lua, atomically.
"""

from __future__ import annotations

import math

WINDOW_S = 60
SPAN_S = WINDOW_S + 1
"""Seconds a bucket counts: bucket b counts from time b until b + SPAN_S."""


def second_of(now: float) -> int:
    """The bucket of time ``now`` (unix seconds)."""
    return math.floor(now)


def oldest_live(now: float) -> int:
    """The oldest bucket still in the window at ``now``."""
    return second_of(now) - WINDOW_S


def prune(buckets: dict[int, int], now: float) -> int:
    """Drop the buckets that left the window; the sum of the rest."""
    oldest = oldest_live(now)
    for second in [s for s in buckets if s < oldest]:
        del buckets[second]
    return sum(buckets.values())


def wait_s(buckets: dict[int, int], total: int, need: int, limit: int, now: float) -> int:
    """Whole seconds (>= 1) until ``need`` more fits under ``limit``, the oldest buckets
    leaving first; SPAN_S when it never fits (need > limit). ``total``: prune()'s sum."""
    for second in sorted(buckets):
        total -= buckets[second]
        if total + need <= limit:
            return max(1, math.ceil(second + SPAN_S - now))
    return SPAN_S
