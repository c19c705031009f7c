"""A tensor-parallel rank as the model runner uses it: :class:`TPRank` implements the worker's
:class:`~pagedkv.worker.parallel_rank.ParallelRank` protocol.

The runner (``ModelRunner(..., tp=TPRank(spec))``) calls it at the four points where a rank
differs from a single process: :meth:`TPRank.join` before the weights load (checks the sizes,
then joins the group), :meth:`TPRank.shard` on the loaded model, :meth:`TPRank.agree` on the
pool sizes, and :meth:`TPRank.execute` around every step, where rank 0 first broadcasts the step
(:mod:`~pagedkv.parallel.step_broadcast`). The dependency points one way: this package imports
the worker, the worker only knows the protocol.

Rank 0's failure rule: an exception after a step was broadcast leaves the ranks possibly out of
step, so the group is broken for good: ``EngineDeadError`` now (an interrupt is re-raised as
is) and on every later step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedkv.config import CacheConfig
from pagedkv.errors import ConfigError, EngineDeadError
from pagedkv.parallel.group import TPGroup
from pagedkv.parallel.sharding import check_tensor_parallel_size, shard_model
from pagedkv.parallel.spec import TPSpec
from pagedkv.parallel.step_broadcast import send_step
from pagedkv.worker.parallel_rank import RunStep
from pagedkv.worker.step_input import DiskBlockInfos, Step

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["TPRank"]


class TPRank:
    """Rank ``spec.rank`` of ``spec.world_size``: joined by :meth:`join`, then :attr:`group`."""

    def __init__(self, spec: TPSpec) -> None:
        self.spec = spec
        self._group: TPGroup | None = None
        # Rank 0: set once a step failed after its broadcast; every later step raises it.
        self.failed: BaseException | None = None

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def group(self) -> TPGroup:
        """The group, once joined."""
        if self._group is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} has not joined its group")
        return self._group

    def join(self, text_config: PretrainedConfig, device: torch.device, cache_config: CacheConfig) -> torch.device:
        """Checks that the model and this machine allow ``world_size`` ranks (before joining,
        so a refused engine joins nothing), then joins the group; on CUDA rank r uses device
        ``spec.device_index``. Returns the device."""
        spec = self.spec
        check_tensor_parallel_size(text_config, spec.world_size)
        if device.type == "cuda":
            available = torch.cuda.device_count()
            if spec.device_index >= available:
                raise ConfigError(
                    f"tensor_parallel_size={spec.world_size} needs a CUDA device per rank; rank {spec.rank} "
                    f"would use device {spec.device_index} of the {available} visible"
                )
            device = torch.device("cuda", spec.device_index)
        # On the CPU a rank is a process: any N runs (sharing the cores), which is what tests use.
        if cache_config.kv_cache_dir is not None:
            raise ConfigError("the disk KV tier (kv_cache_dir) is not supported with tensor_parallel_size > 1")
        self._group = TPGroup.create(
            spec.rank, spec.world_size, spec.init_method, device, spec.timeout, spec.store, spec.peer_failures
        )
        return device

    def shard(self, model: nn.Module) -> None:
        shard_model(model, self.group)

    def agree(self, value: int) -> int:
        return self.group.min_int(value)

    def execute(self, step: Step, disk_block_info: DiskBlockInfos | None, run: RunStep) -> torch.Tensor:
        """``run(step, disk_block_info)``; rank 0 broadcasts the step first (see the module
        docstring for what a failure does)."""
        if self.rank != 0:
            return run(step, disk_block_info)
        if self.failed is not None:
            raise EngineDeadError(f"the tensor-parallel group is broken: {self.failed}") from self.failed
        try:
            send_step(self.group, step)
            return run(step, disk_block_info)
        except Exception as exc:
            self.failed = exc
            raise EngineDeadError(
                f"a tensor-parallel step failed ({type(exc).__name__}: {exc}); the ranks may disagree, "
                "so the engine stops"
            ) from exc
        except BaseException as exc:  # KeyboardInterrupt: re-raised, the next step reports the break
            self.failed = exc
            raise

    def close(self) -> None:
        """Leaves the group now (not in the interpreter's teardown: ``TPGroup.close``)."""
        if self._group is not None:
            self._group.close()
