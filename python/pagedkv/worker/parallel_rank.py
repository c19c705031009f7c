"""What the model runner asks of tensor parallelism, as a protocol that :mod:`pagedkv.parallel`
implements (``pagedkv.parallel.rank.TPRank``).

The runner never imports ``pagedkv.parallel``: the parallel package builds runners (its worker
ranks) and so imports the worker; the worker only names the four moments where a rank differs
from a single process — joining the group before the weights load, sharding the loaded model,
agreeing with the other ranks on the pool sizes, and running each step (rank 0 first hands it
to the other ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from pagedkv.config import CacheConfig
from pagedkv.worker.step_input import DiskBlockInfos, Step

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["ParallelRank", "RunStep"]

# The runner's own step: (step, disk_block_info) -> logits.
RunStep = Callable[[Step, "DiskBlockInfos | None"], torch.Tensor]


class ParallelRank(Protocol):
    """One rank of a tensor-parallel group, as ``ModelRunner(..., tp=rank)`` uses it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def join(self, text_config: PretrainedConfig, device: torch.device, cache_config: CacheConfig) -> torch.device:
        """Check that the model and this machine allow the group's size, then join it (before
        the weights load: a refused engine joins nothing); returns the device this rank uses."""
        ...

    def shard(self, model: nn.Module) -> None:
        """Split the loaded model's layers across the ranks, in place."""
        ...

    def agree(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank's pool has the same block ids)."""
        ...

    def execute(self, step: Step, disk_block_info: DiskBlockInfos | None, run: RunStep) -> torch.Tensor:
        """``run(step, disk_block_info)`` on this rank; rank 0 first sends the step to the others."""
        ...
