"""Where a tensor-parallel rank joins its group: :class:`TPSpec`, the one piece that the engine's
side (``executor``, ``ray_executor``) and the rank's side (``worker``, ``rank``) both use.

It lives in this leaf module (no pagedkv imports): it is pickled to every worker process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TPSpec"]


@dataclass(frozen=True)
class TPSpec:
    """Where a rank joins the tensor-parallel group (``TPRank(spec)``, then ``ModelRunner(..., tp=rank)``)."""

    rank: int
    world_size: int
    init_method: str  # tcp://host:port of rank 0's store
    timeout: float
    # The CUDA device this rank uses among those visible to its process: the rank for local
    # processes, 0 for a Ray actor (Ray gives each actor its own CUDA_VISIBLE_DEVICES).
    device_index: int = 0
    # Rank 0 only: the store it hosts, already listening at ``init_method``
    # (``pagedkv.parallel.group.host_store``); never sent to another process.
    store: Any = field(default=None, compare=False, repr=False)
    # Rank 0 only: how each worker that stopped ended (the executor's ``failures``), so that
    # waiting for the workers to load ends when one dies.
    peer_failures: Callable[[], list[str]] | None = field(default=None, compare=False, repr=False)
