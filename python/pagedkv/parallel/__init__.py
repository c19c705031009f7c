"""Tensor parallelism: one engine's model split over N ranks (``tensor_parallel_size``).

- ``group`` — :class:`TPGroup`, the ranks' private torch.distributed group (gloo on the CPU,
  NCCL on CUDA) with timeouts on every collective.
- ``sharding`` — the Megatron split of each decoder layer (column-parallel Q/K/V and gate/up,
  row-parallel O and down with one all-reduce each; embedding and LM head replicated), from
  the model's tensor-parallel plan or pagedkv's Llama plan.
- ``step_broadcast`` — rank 0 sends each step's arrays to the other ranks in one packed buffer.
- ``spec`` — :class:`TPSpec`, where a rank joins (shared by the executors and the ranks).
- ``rank`` — :class:`TPRank`, a rank as the model runner uses it (the worker's ``ParallelRank``
  protocol): join, shard, agree on the pool sizes, run each step (rank 0 broadcasts it first).
  The worker never imports this package; this package builds runners.
- ``preflight`` — the checks before anything starts (the model's sizes divide, the devices or
  Ray resources exist).
- ``executor`` — the worker ranks as local processes (``"mp"``) and their life cycle;
  ``ray_executor`` — as Ray actors.
- ``worker`` — a worker rank's life (``python -m pagedkv.parallel.worker`` for ``"mp"``).

One Rust scheduler, on rank 0, decides; every rank's KV cache has the same blocks, each with
``num_kv_heads / N`` heads, so the block tables it produces are valid on every rank.
"""

from __future__ import annotations

from pagedkv.parallel.executor import MultiprocExecutor
from pagedkv.parallel.group import TPGroup
from pagedkv.parallel.rank import TPRank
from pagedkv.parallel.sharding import check_tensor_parallel_size, shard_model
from pagedkv.parallel.spec import TPSpec

__all__ = ["MultiprocExecutor", "TPGroup", "TPRank", "TPSpec", "check_tensor_parallel_size", "shard_model"]
