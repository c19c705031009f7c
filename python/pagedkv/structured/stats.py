"""A cumulative histogram of durations, shared between threads, that ``/metrics`` exposes as is.

The engine's statistics are cumulative snapshots (``LLMEngine.get_stats()``); a histogram here is
too: bucket counts only grow, so the server's collector renders them without keeping state.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

__all__ = ["SECONDS_BUCKETS", "SecondsHistogram"]

# Upper bounds (seconds): from 10 us (a cached mask) to 10 s (a compile near its limit).
SECONDS_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class SecondsHistogram:
    """Observations of a duration: counts per bucket (not cumulative; +Inf last), sum, count."""

    def __init__(self, buckets: tuple[float, ...] = SECONDS_BUCKETS) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self._counts[index] += 1
            self._sum += seconds

    @property
    def count(self) -> int:
        return sum(self._counts)

    def snapshot(self) -> dict[str, Any]:
        """``{"buckets": upper bounds, "counts": per bucket (+Inf last), "sum", "count"}``."""
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        return {"buckets": list(self.buckets), "counts": counts, "sum": total, "count": sum(counts)}
