"""Rank 0 hands each step to the other ranks: every array the runner reads, packed into one
int64 buffer after a 32-int64 header (the command, the payload's length, each array's shape),
broadcast once in a fixed-size frame (see ``FRAME``), over the group's gloo control group
(host tensors: no device copy).

The arrays are the step contract's (:class:`~pagedkv.worker.step_input.StepArrays`):
``input_ids``, ``positions``, ``slot_mapping``, ``logits_indices`` (int64), ``cu_seqlens_q``,
``seq_lens`` (int32), ``block_tables`` (int32 ``[B, W]``), and the block copies ``copy_ops``,
``swap_out``, ``swap_in``, ``disk_store``, ``disk_load`` (int32 ``[K, 2]``); a worker receives
them as a :class:`~pagedkv.worker.step_input.StepInput`. Every rank then runs the same
``ModelRunner.execute`` on identical arrays, so the ranks' caches stay block for block the same.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.parallel.group import TPGroup
from pagedkv.worker.step_input import IndexArray, StepArrays, StepInput

__all__ = ["CMD_SHUTDOWN", "CMD_STEP", "empty_step", "recv_step", "send_shutdown", "send_step"]

CMD_STEP = 1
CMD_SHUTDOWN = 2
_HEADER = 32
# Every step travels in one broadcast of FRAME int64s (64 KiB): the header, then the packed
# arrays. A step with more (a long prefill's block tables, many swap ops) sends the rest in a
# second broadcast; a fixed size lets the receivers post their buffer before knowing the step.
FRAME = 8192
# (name, dtype, ndim) in packing order.
_FIELDS: tuple[tuple[str, type[np.int64] | type[np.int32], int], ...] = (
    ("input_ids", np.int64, 1),
    ("positions", np.int64, 1),
    ("slot_mapping", np.int64, 1),
    ("logits_indices", np.int64, 1),
    ("cu_seqlens_q", np.int32, 1),
    ("seq_lens", np.int32, 1),
    ("block_tables", np.int32, 2),
    ("copy_ops", np.int32, 2),
    ("swap_out", np.int32, 2),
    ("swap_in", np.int32, 2),
    ("disk_store", np.int32, 2),
    ("disk_load", np.int32, 2),
)
assert 2 + 2 * len(_FIELDS) <= _HEADER


def _fields(step: StepArrays) -> tuple[IndexArray, ...]:
    """The step's arrays in ``_FIELDS`` order."""
    return (
        step.input_ids,
        step.positions,
        step.slot_mapping,
        step.logits_indices,
        step.cu_seqlens_q,
        step.seq_lens,
        step.block_tables,
        step.copy_ops,
        step.swap_out,
        step.swap_in,
        step.disk_store,
        step.disk_load,
    )


def _step_of(arrays: list[IndexArray]) -> StepInput:
    """The step of ``arrays`` in ``_FIELDS`` order."""
    (input_ids, positions, slot_mapping, logits_indices, cu_seqlens_q, seq_lens, block_tables) = arrays[:7]
    copy_ops, swap_out, swap_in, disk_store, disk_load = arrays[7:]
    return StepInput(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_tables=block_tables,
        copy_ops=copy_ops,
        swap_out=swap_out,
        swap_in=swap_in,
        disk_store=disk_store,
        disk_load=disk_load,
    )


def empty_step() -> StepInput:
    """A step with no tokens and no copies (every array empty): what the broadcast costs alone."""
    arrays: list[IndexArray] = [np.zeros((0, 2) if ndim == 2 else 0, dtype=dtype) for _, dtype, ndim in _FIELDS]
    arrays[4] = np.zeros(1, dtype=np.int32)  # cu_seqlens_q: B + 1 offsets for B = 0 rows
    return _step_of(arrays)


def _as_array(value: IndexArray, dtype: type[np.int64] | type[np.int32], ndim: int) -> npt.NDArray[np.int64]:
    """``value`` as a C-contiguous array of ``dtype`` (a copy list always ``[K, 2]``)."""
    array = np.asarray(value, dtype=dtype)
    if ndim == 2 and array.ndim != 2:
        array = array.reshape(-1, 2)
    return np.ascontiguousarray(array)


def send_step(group: TPGroup, step: StepArrays) -> None:
    """Broadcasts ``step`` from rank 0: one ``FRAME``-sized buffer (header + packed arrays),
    and the rest of the arrays in a second broadcast only when they do not fit."""
    arrays = [_as_array(value, dtype, ndim) for value, (_, dtype, ndim) in zip(_fields(step), _FIELDS)]
    total = sum(a.size for a in arrays)
    frame = np.zeros(FRAME, dtype=np.int64)
    frame[0] = CMD_STEP
    frame[1] = total
    for i, a in enumerate(arrays):
        frame[2 + 2 * i] = a.shape[0]
        frame[3 + 2 * i] = a.shape[1] if a.ndim == 2 else 0
    payload = np.concatenate([a.astype(np.int64, copy=False).ravel() for a in arrays]) if total else frame[:0]
    inline = min(total, FRAME - _HEADER)
    frame[_HEADER : _HEADER + inline] = payload[:inline]
    group.broadcast(torch.from_numpy(frame))
    if total > inline:
        group.broadcast(torch.from_numpy(np.ascontiguousarray(payload[inline:])))


def send_shutdown(group: TPGroup) -> None:
    frame = np.zeros(FRAME, dtype=np.int64)
    frame[0] = CMD_SHUTDOWN
    group.broadcast(torch.from_numpy(frame))


def recv_step(group: TPGroup) -> StepInput | None:
    """A worker's side of :func:`send_step`: the next step, or None for shutdown."""
    # No deadline: an engine with no requests sends no step (rank 0 gone still ends it: its
    # sockets close).
    frame = group.broadcast(torch.zeros(FRAME, dtype=torch.int64), wait_forever=True).numpy()
    if int(frame[0]) == CMD_SHUTDOWN:
        return None
    total = int(frame[1])
    inline = min(total, FRAME - _HEADER)
    payload = frame[_HEADER : _HEADER + inline]
    if total > inline:
        rest = group.broadcast(torch.zeros(total - inline, dtype=torch.int64)).numpy()
        payload = np.concatenate([payload, rest])
    arrays: list[IndexArray] = []
    offset = 0
    for i, (_, dtype, ndim) in enumerate(_FIELDS):
        rows, cols = int(frame[2 + 2 * i]), int(frame[3 + 2 * i])
        size = rows * cols if ndim == 2 else rows
        raw = payload[offset : offset + size]
        chunk: npt.NDArray[np.int64 | np.int32] = raw.astype(np.int32) if dtype is np.int32 else raw.astype(np.int64)
        arrays.append(chunk.reshape(rows, cols) if ndim == 2 else chunk)
        offset += size
    return _step_of(arrays)
