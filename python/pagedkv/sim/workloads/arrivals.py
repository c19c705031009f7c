"""Arrival processes: when each request of a workload reaches the server.

Inter-arrival gaps are i.i.d. gamma with mean ``1 / rate`` and coefficient of variation ``cv``
(standard deviation / mean). ``cv = 1`` is a Poisson process (exponential gaps); ``cv > 1`` is
burstier, ``cv < 1`` smoother. vLLM's benchmark calls the gamma shape ``burstiness``; it is
``1 / cv**2``. ``rate = inf`` sends every request at t = 0 (an offline batch).

The first request arrives at t = 0 and request ``i`` after the sum of the first ``i`` gaps, so
a trace always starts at 0 and times are non-decreasing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.sim.workloads.request import TraceRequest

__all__ = ["ArrivalProcess", "assign_arrivals"]


@dataclass(frozen=True)
class ArrivalProcess:
    """Requests per second ``rate`` (> 0, ``math.inf`` = all at once) and gap variability ``cv``."""

    rate: float = math.inf
    cv: float = 1.0

    def __post_init__(self) -> None:
        if not (self.rate > 0):  # also rejects NaN
            raise ConfigError(f"arrival rate must be > 0 requests/s (or inf), got {self.rate}")
        if not (math.isfinite(self.cv) and self.cv > 0):
            raise ConfigError(f"arrival cv must be finite and > 0, got {self.cv}")

    @classmethod
    def poisson(cls, rate: float) -> ArrivalProcess:
        return cls(rate=rate, cv=1.0)

    @classmethod
    def simultaneous(cls) -> ArrivalProcess:
        return cls(rate=math.inf)

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        """Arrival times in seconds: float64 [num_requests], starting at 0, non-decreasing."""
        if num_requests < 0:
            raise ConfigError(f"num_requests must be >= 0, got {num_requests}")
        if num_requests == 0:
            return np.zeros(0, dtype=np.float64)
        if math.isinf(self.rate):
            return np.zeros(num_requests, dtype=np.float64)
        shape = 1.0 / (self.cv * self.cv)
        gaps = rng.gamma(shape, scale=1.0 / (self.rate * shape), size=num_requests - 1)
        return np.concatenate([[0.0], np.cumsum(gaps)])


def assign_arrivals(requests: Sequence[TraceRequest], process: ArrivalProcess, *, seed: int = 0) -> list[TraceRequest]:
    """Copies of ``requests`` (kept in order) with arrival times drawn from ``process``."""
    times = process.sample(len(requests), np.random.default_rng(seed))
    return [dataclasses.replace(request, arrival_time=float(time)) for request, time in zip(requests, times)]
