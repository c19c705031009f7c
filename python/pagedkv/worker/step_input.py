"""The step contract between the engine and the worker: what :meth:`ModelRunner.execute` reads.

The Rust scheduler's ``SchedulerOutput`` holds a step as flat arrays; the runner reads twelve of
them by name (:class:`StepArrays`), and the scheduler's own class satisfies that protocol as it
is: no copy, no Python work per token. A step that also asks for prompt rows' hidden states
(:mod:`pagedkv.engine.prompt_logprobs`) is a :class:`ModelStep`: the same arrays and
``hidden_rows``. :class:`StepInput` is the concrete step built by hand: the warm-up step, a step
received from the tensor-parallel broadcast, tests and benchmarks.

Every field is always there: a step without copies has empty ``[0, 2]`` op lists, one without
prompt rows ``hidden_rows = None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from pagedkv._core import SchedulerOutput
from pagedkv.worker.head_rows import HiddenRows

__all__ = [
    "DiskBlockInfo",
    "DiskBlockInfos",
    "IndexArray",
    "ModelStep",
    "Step",
    "StepArrays",
    "StepInput",
    "hidden_rows_of",
    "no_ops",
]

# An index array as the scheduler hands it over (numpy) or a caller built it (torch).
IndexArray: TypeAlias = "npt.NDArray[np.int64 | np.int32] | torch.Tensor"
# A disk slot's identity, written into its file (``Scheduler.disk_block_info``): block hash,
# parent hash, token ids, cache salt, KV cache group.
DiskBlockInfo: TypeAlias = "tuple[bytes, bytes | None, list[int], str | None, int]"
DiskBlockInfos: TypeAlias = "Sequence[DiskBlockInfo | None]"


class StepArrays(Protocol):
    """One step's arrays, with ``SchedulerOutput``'s names and dtypes: ``T`` tokens, ``B``
    rows, ``C`` KV cache groups, ``S`` sampled rows, ``K`` rows per op list."""

    @property
    def input_ids(self) -> IndexArray: ...  # int64 [T]
    @property
    def positions(self) -> IndexArray: ...  # int64 [T]
    @property
    def slot_mapping(self) -> IndexArray: ...  # int64 [C * T]
    @property
    def cu_seqlens_q(self) -> IndexArray: ...  # int32 [B + 1]
    @property
    def seq_lens(self) -> IndexArray: ...  # int32 [B]
    @property
    def block_tables(self) -> IndexArray: ...  # int32 [C * B, W]; -1: padding
    @property
    def logits_indices(self) -> IndexArray: ...  # int64 [S]
    @property
    def copy_ops(self) -> IndexArray: ...  # int32 [K, 2]: (src, dst) device blocks
    @property
    def swap_out(self) -> IndexArray: ...  # int32 [K, 2]: (device block, host block)
    @property
    def swap_in(self) -> IndexArray: ...  # int32 [K, 2]: (host block, device block)
    @property
    def disk_store(self) -> IndexArray: ...  # int32 [K, 2]: (host block, disk slot)
    @property
    def disk_load(self) -> IndexArray: ...  # int32 [K, 2]: (disk slot, host block)


class ModelStep(StepArrays, Protocol):
    """A step's arrays and its request for prompt rows' hidden states (None: every row's logits)."""

    @property
    def hidden_rows(self) -> HiddenRows | None: ...


# What ``ModelRunner.execute`` takes: the scheduler's output as it is, or a full ModelStep.
Step: TypeAlias = "SchedulerOutput | ModelStep"


def no_ops() -> npt.NDArray[np.int32]:
    """An empty op list: ``[0, 2]`` int32."""
    return np.zeros((0, 2), dtype=np.int32)


@dataclass(slots=True, kw_only=True)
class StepInput:
    """A :class:`ModelStep` built by hand (fields as in :class:`StepArrays`); no copies and no
    prompt rows unless given."""

    input_ids: IndexArray
    positions: IndexArray
    slot_mapping: IndexArray
    cu_seqlens_q: IndexArray
    seq_lens: IndexArray
    block_tables: IndexArray
    logits_indices: IndexArray
    copy_ops: IndexArray = field(default_factory=no_ops)
    swap_out: IndexArray = field(default_factory=no_ops)
    swap_in: IndexArray = field(default_factory=no_ops)
    disk_store: IndexArray = field(default_factory=no_ops)
    disk_load: IndexArray = field(default_factory=no_ops)
    hidden_rows: HiddenRows | None = None


def hidden_rows_of(step: Step) -> HiddenRows | None:
    """The step's prompt-row request: the scheduler's own output never has one."""
    return None if isinstance(step, SchedulerOutput) else step.hidden_rows
