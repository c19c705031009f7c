"""Checks of one step's arrays before anything is written: a step that fails them changes no
cache block (``InvalidArgumentError`` naming the array and the bad value).

Index arrays become tensors without a copy where they can (``torch.from_numpy``). Shapes are
checked from metadata alone; values only where they are on the host, since reading a device
tensor back costs a sync, and on a GPU an out-of-range index is a device-side assert that kills
the process.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels.kv_quant import byte_view

__all__ = [
    "OpsLike",
    "as_tensor",
    "check_block_ops",
    "check_copy_ops",
    "check_step_shapes",
    "check_token_values",
    "copy_blocks",
    "index_tensor",
]

# An op list as a caller may give it: [K, 2] integers (an array, a tensor or nested lists).
OpsLike = npt.ArrayLike | torch.Tensor


def index_tensor(array: OpsLike, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``array`` as a tensor of integer ``dtype`` (converted from another integer dtype)."""
    tensor = as_tensor(array, name)
    if tensor.dtype != dtype:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise InvalidArgumentError(f"{name} must hold integers, got {tensor.dtype}")
        tensor = tensor.to(dtype)
    return tensor


def as_tensor(array: OpsLike, name: str) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array)  # torch.from_numpy wants a writable array
        return torch.from_numpy(array)
    try:
        return torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(f"{name} must be an array, got {type(array).__name__}") from exc


def check_step_shapes(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    logits_indices: torch.Tensor,
    num_kv_groups: int = 1,
) -> None:
    """Shape consistency of one step (metadata only: no device sync). With ``num_kv_groups``
    KV cache group, ``slot_mapping`` is ``[C * T]`` and ``block_tables`` ``[C * B, W]``."""
    for name, tensor in (
        ("input_ids", input_ids),
        ("positions", positions),
        ("slot_mapping", slot_mapping),
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens", seq_lens),
        ("logits_indices", logits_indices),
    ):
        if tensor.dim() != 1:
            raise InvalidArgumentError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    num_tokens = input_ids.shape[0]
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_kv_groups * num_tokens:
        raise InvalidArgumentError(
            f"input_ids and positions must have one entry per token and slot_mapping one per token and "
            f"KV cache group ({num_kv_groups}), got {num_tokens}, {positions.shape[0]}, {slot_mapping.shape[0]}"
        )
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise InvalidArgumentError(
            f"cu_seqlens_q must have B + 1 = {num_seqs + 1} entries, got {cu_seqlens_q.shape[0]}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_kv_groups * num_seqs:
        raise InvalidArgumentError(
            f"block_tables must be [C * B = {num_kv_groups} x {num_seqs}, max_blocks], got shape "
            f"{tuple(block_tables.shape)}"
        )


def check_token_values(input_ids: torch.Tensor, logits_indices: torch.Tensor, vocab_size: int) -> None:
    """Token ids inside the vocabulary and logits rows inside the step (host tensors only)."""
    if input_ids.device.type != "cpu":
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise InvalidArgumentError(f"input_ids holds token id {low if low < 0 else high}, not in [0, {vocab_size})")
    if logits_indices.device.type == "cpu" and logits_indices.numel():
        num_tokens = input_ids.shape[0]
        low, high = int(logits_indices.min()), int(logits_indices.max())
        if low < 0 or high >= num_tokens:
            raise InvalidArgumentError(
                f"logits_indices holds row {low if low < 0 else high}, not in [0, {num_tokens}) (the step's tokens)"
            )


def check_block_ops(
    ops_in: OpsLike | None, name: str, columns: tuple[str, str], pools: dict[str, int], has_host_tier: bool
) -> torch.Tensor | None:
    """A swap or disk op list (rows: a ``columns[0]`` block, a ``columns[1]`` block) as a
    validated CPU int64 ``[K, 2]`` tensor; None when absent or empty."""
    if ops_in is None:
        return None
    ops = as_tensor(ops_in, name)
    if ops.numel() == 0:
        return None
    if not has_host_tier:
        raise InvalidArgumentError(
            f"{name} holds {ops.shape[0] if ops.dim() else 1} swap(s), but this runner has no host KV tier "
            f"(num_host_blocks = 0): set num_host_blocks / host_kv_cache_memory / swap_space"
        )
    ops = index_tensor(ops, torch.int64, name).cpu()
    if ops.dim() != 2 or ops.shape[1] != 2:
        raise InvalidArgumentError(
            f"{name} must be [K, 2] ({columns[0]} block, {columns[1]} block), got shape {tuple(ops.shape)}"
        )
    for column, pool in enumerate(columns):
        ids = ops[:, column]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= pools[pool]:
            raise InvalidArgumentError(
                f"{name} holds {pool} block id {low if low < 0 else high}, not in [0, {pools[pool]})"
            )
    if len(set(ops[:, 1].tolist())) != ops.shape[0]:
        raise InvalidArgumentError(f"{name} writes the same {columns[1]} block twice")
    return ops


def check_copy_ops(copy_ops: OpsLike, num_blocks: int, device: torch.device) -> torch.Tensor | None:
    """``copy_ops`` as int64 ``[K, 2]`` on ``device``, values checked when they are on the
    host; None when empty."""
    ops = as_tensor(copy_ops, "copy_ops")
    if ops.dim() != 2 or ops.shape[1] != 2:
        raise InvalidArgumentError(f"copy_ops must be [K, 2] (src, dst), got shape {tuple(ops.shape)}")
    if ops.numel() == 0:
        return None
    if ops.device.type == "cpu":  # value checks are free on the host
        low, high = int(ops.min()), int(ops.max())
        if low < 0 or high >= num_blocks:
            bad = low if low < 0 else high
            raise InvalidArgumentError(f"copy_ops holds block id {bad}, not in [0, {num_blocks})")
        if len(set(ops[:, 1].tolist())) != ops.shape[0]:
            raise InvalidArgumentError("copy_ops writes the same destination block twice")
    return ops.to(device, torch.int64, non_blocking=True)


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``cache[:, :, dst] = cache[:, :, src]`` (dim 2 = block id) for ``[L, 2, num_blocks, ...]``.

    index_select copies first, so a block that is both a source and a destination in the same
    step still reads its old content. Float8 has no CPU index_copy_: its bytes move as uint8.
    """
    cache = byte_view(cache)
    cache.index_copy_(2, dst, cache.index_select(2, src))
