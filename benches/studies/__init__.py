"""Capacity and memory studies with plots, on the real scheduler (``benches/run_studies.py`` runs them).

One module per study; each function replays workloads through :mod:`pagedkv.sim.replay` and
returns a :class:`~studies.report.StudyResult` (numbers as JSON, a Markdown write-up,
PNG figures written into the given folder):

* ``breakdown``          memory breakdown, paging vs the reservation baselines (stacked bars)
* ``block_size``         utilization, hit rate, table bytes, steps and preemptions vs block size
* ``parallel_sampling``  blocks saved by forking n samples vs n independent requests
* ``prefix_cache``       prefix-cache hit rate and prefill tokens saved vs cache (pool) size
* ``memory_map``         the pool's physical blocks over time, coloured by owning request
* ``speed``              how long a large replay takes, and where the time goes

Plots need matplotlib (``pip install 'pagedkv[sim]'``); they are drawn on the Agg canvas
without ``pyplot``, so nothing global changes.
"""

from __future__ import annotations

from studies.block_size import block_size_study
from studies.breakdown import breakdown_study
from studies.memory_map import memory_map_study
from studies.parallel_sampling import parallel_sampling_study
from studies.prefix_cache import prefix_cache_study
from studies.report import StudyResult
from studies.speed import speed_study

__all__ = [
    "StudyResult",
    "block_size_study",
    "breakdown_study",
    "memory_map_study",
    "parallel_sampling_study",
    "prefix_cache_study",
    "speed_study",
]
