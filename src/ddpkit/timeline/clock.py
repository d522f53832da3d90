"""Each rank's clock offset to rank 0's, measured through the job's store.

Rank r sends a request at t0 (its perf_counter), rank 0 answers with its own perf_counter, r reads the answer at
t1. Rank 0's reading happened somewhere between t0 and t1, so taking the midpoint errs by at most half the round
trip: of a few round trips the fastest one is kept, and its half round trip is the residual error stated in the
trace. On one machine every process reads the same monotonic clock, so the offsets come out near zero there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

# Round trips per rank; the fastest is kept. Five cost a few milliseconds per rank at start and have always held
# one undisturbed trip on a loaded 2-core machine in our tests.
ROUND_TRIPS = 5


def best_offset(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(offset, error) in seconds from (t0, remote, t1) round trips: remote - (t0 + t1) / 2 of the fastest trip,
    and half its round trip. Add the offset to a local time to get rank 0's."""
    if not samples:
        raise ValueError("no round trips to measure a clock offset from")
    t0, remote, t1 = min(samples, key=lambda s: s[2] - s[0])
    return remote - (t0 + t1) / 2, (t1 - t0) / 2


def measure_offset(store: Any, rank: int, world_size: int, prefix: str,
                   trips: int = ROUND_TRIPS) -> tuple[float, float]:
    """This rank's (offset, error) to rank 0, every rank calling it at once; rank 0 answers each rank in turn
    and gets (0, 0). The store's blocking get waits for each request and answer."""
    if world_size == 1:
        return 0.0, 0.0
    if rank == 0:
        for other in range(1, world_size):
            for k in range(trips):
                store.get(f"{prefix}request/{other}/{k}")
                store.set(f"{prefix}answer/{other}/{k}", repr(time.perf_counter()))
        return 0.0, 0.0
    samples = []
    for k in range(trips):
        t0 = time.perf_counter()
        store.set(f"{prefix}request/{rank}/{k}", "1")
        remote = float(store.get(f"{prefix}answer/{rank}/{k}"))
        samples.append((t0, remote, time.perf_counter()))
    return best_offset(samples)
