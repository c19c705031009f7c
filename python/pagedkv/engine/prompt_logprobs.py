"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the log-probability the model gave each
prompt token, computed from the logits of the position before it while the prompt is prefilled.

A step normally computes the LM head only on its sampled rows (``logits_indices``). For the
requests that want prompt logprobs, :func:`plan` adds the rows of their prompt positions in
the step (every chunk of a chunked prefill, in order) and :class:`StepWithPromptRows` hands the
runner the longer ``logits_indices``; the first ``S`` rows are sampled as usual, the rest go to
:func:`compute` and, once the step went through, :func:`record`. The step also asks the runner
for the prompt rows' final hidden states instead of their logits (``HiddenRows``,
:mod:`pagedkv.worker.head_rows`): :func:`compute` then runs the LM head itself, a chunk of rows
at a time into one buffer the head keeps, so the logits held at once are bounded (256 MB) and
their pages are not faulted in anew every step (the runner answers with all ``S + E`` rows'
logits when the model post-processes its head's output; both give the same numbers).

Position ``p`` of a prompt of ``L`` tokens predicts token ``p + 1``: entry ``p + 1`` of the
request's list (entry 0 is ``None``: nothing predicts the first token). The last position
``L - 1`` predicts the first generated token, which is a sampled row, not a prompt entry.
Such requests never start on prefix-cache hits (the scheduler's ``skip_prefix_cache``: cached
blocks have no logits), so their chunks cover the prompt from position 0 without a gap; a
chunk recomputed after a recompute preemption finds its entries already recorded and adds
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv._core import SchedulerOutput
from pagedkv.engine.outputs import Logprob
from pagedkv.engine.request_state import RequestState
from pagedkv.sample.ops import topk
from pagedkv.worker.head_rows import Head, HiddenRows
from pagedkv.worker.step_input import IndexArray, ModelStep, StepArrays

__all__ = [
    "Found",
    "PromptLogprobs",
    "PromptRows",
    "StepWithPromptRows",
    "compute",
    "compute_step",
    "plan",
    "record",
    "run_step",
]


@dataclass
class PromptRows:
    """The step's extra logits rows: per request, its first new entry and how many follow."""

    # (request id, index of the first entry these rows fill, number of rows), in row order.
    spans: list[tuple[str, int, int]]
    # [E] int64: the rows' token indices in the step (appended to logits_indices).
    token_indices: np.ndarray
    # [E] int64: the prompt token each row's logits predict.
    targets: np.ndarray
    # Largest prompt_logprobs among the spans' requests (top-k width).
    max_k: int


@dataclass
class PromptLogprobs:
    """What :func:`compute` found for the rows of a :class:`PromptRows`."""

    # [E] float32 logprob and [E] int64 1-based rank of each target token.
    target_logprobs: torch.Tensor
    target_ranks: torch.Tensor
    # [E, K] top-k token ids and logprobs (K = PromptRows.max_k; may be 0).
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


class StepWithPromptRows:
    """A ``SchedulerOutput`` whose ``logits_indices`` also hold the prompt rows, as the
    worker's ``ModelStep`` (worker/step_input.py): every other array is the step's own."""

    def __init__(self, step: StepArrays, rows: PromptRows) -> None:
        self.rows = rows
        self.num_sampled = len(step.logits_indices)
        self.logits_indices: IndexArray = np.concatenate(
            [np.asarray(step.logits_indices, dtype=np.int64), rows.token_indices]
        )
        # The prompt rows' hidden states instead of their logits, if the runner can.
        self.hidden_rows = HiddenRows(len(rows.token_indices))
        self.input_ids: IndexArray = step.input_ids
        self.positions: IndexArray = step.positions
        self.slot_mapping: IndexArray = step.slot_mapping
        self.cu_seqlens_q: IndexArray = step.cu_seqlens_q
        self.seq_lens: IndexArray = step.seq_lens
        self.block_tables: IndexArray = step.block_tables
        self.copy_ops: IndexArray = step.copy_ops
        self.swap_out: IndexArray = step.swap_out
        self.swap_in: IndexArray = step.swap_in
        self.disk_store: IndexArray = step.disk_store
        self.disk_load: IndexArray = step.disk_load


def plan(step: SchedulerOutput, requests: Mapping[str, RequestState]) -> PromptRows | None:
    """The prompt rows ``step`` must compute for the requests that want prompt logprobs."""
    spans: list[tuple[str, int, int]] = []
    indices: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    max_k = 0
    cu = None
    for i, rid in enumerate(step.req_ids):
        state = requests.get(rid)
        if state is None or state.prompt_logprobs is None:
            continue
        prompt_len = len(state.prompt_token_ids)
        if state.num_prompt_logprobs >= prompt_len:
            continue
        if cu is None:
            cu = np.asarray(step.cu_seqlens_q, dtype=np.int64)
        start, stop = int(cu[i]), int(cu[i + 1])
        first_position = int(step.positions[start])
        # Entries first_position + 1 .. ; only those not recorded yet, up to the last prompt token.
        first_entry = max(first_position + 1, state.num_prompt_logprobs)
        last_entry = min(first_position + (stop - start), prompt_len - 1)
        if first_entry > state.num_prompt_logprobs or first_entry > last_entry:
            continue  # nothing new (a recomputed chunk), or not contiguous (cannot happen: no hits)
        count = last_entry - first_entry + 1
        offset = start + (first_entry - 1 - first_position)
        spans.append((rid, first_entry, count))
        indices.append(np.arange(offset, offset + count, dtype=np.int64))
        targets.append(np.asarray(state.prompt_token_ids[first_entry : last_entry + 1], dtype=np.int64))
        max_k = max(max_k, state.params.prompt_logprobs or 0)
    if not spans:
        return None
    return PromptRows(spans, np.concatenate(indices), np.concatenate(targets), max_k)


# Rows per pass of the statistics: a block of [32, V] float32 (6 MB at 49k tokens) stays in
# the cache between its passes (max, exp-sum, rank, top-k); whole [E, V] passes would not.
_BLOCK_ROWS = 32


def compute(
    rows: PromptRows, values: torch.Tensor, head: Head | None = None, *, chunk_rows: int | None = None
) -> PromptLogprobs:
    """The prompt rows' target logprobs, ranks and top-k (raw logprobs, as for generated
    tokens: ``log_softmax`` of the model's logits), in ``rows`` order.

    ``values``: without ``head``, [E, V] float32, the rows' logits; with ``head``, [E, H], the
    rows' final hidden states (the LM head's input), turned into logits ``chunk_rows`` rows at a
    time (default ``head.rows_per_call``: 256 MB of logits, a 1k-token prompt of a 49k
    vocabulary in one call), each chunk's statistics taken before the next one overwrites it.
    Every statistic of a row comes from that row's logits alone, so chunks change no number, as
    long as the head gives a row the same logits in any chunk (a GEMM's sums per row do not
    depend on the other rows with the BLAS measured; tests/engine/test_prompt_logprobs_chunks.py
    checks the chunking itself on exact products)."""
    num_rows = values.shape[0]
    device = values.device
    targets = torch.from_numpy(rows.targets).to(device).unsqueeze(1)  # [E, 1] int64
    target_logits = torch.empty(num_rows, 1, dtype=torch.float32, device=device)
    normalizer = torch.empty(num_rows, dtype=torch.float32, device=device)
    ranks = torch.empty(num_rows, dtype=torch.int64, device=device)
    top_values = torch.empty(num_rows, rows.max_k, dtype=torch.float32, device=device)
    top_ids = torch.empty(num_rows, rows.max_k, dtype=torch.int64, device=device)
    step = num_rows if head is None else max(1, chunk_rows or head.rows_per_call)
    scratch: torch.Tensor | None = None  # [<= _BLOCK_ROWS, V] float32
    for chunk_start in range(0, num_rows, step):
        chunk_stop = min(chunk_start + step, num_rows)
        if head is None:
            logits = values[chunk_start:chunk_stop]
        else:
            logits = head(values[chunk_start:chunk_stop])  # [n, V], valid until the next call
        if scratch is None:
            scratch = torch.empty(min(num_rows, _BLOCK_ROWS), logits.shape[1], dtype=torch.float32, device=device)
        for start in range(chunk_start, chunk_stop, _BLOCK_ROWS):
            stop = min(start + _BLOCK_ROWS, chunk_stop)
            block = logits[start - chunk_start : stop - chunk_start]  # [b, V]
            work = scratch[: stop - start]
            target = torch.gather(block, 1, targets[start:stop], out=target_logits[start:stop])  # [b, 1]
            if rows.max_k > 0:  # the top logit is the peak: no pass of its own
                top_values[start:stop], top_ids[start:stop] = topk(block, rows.max_k)
                peak = top_values[start:stop, :1]
            else:
                peak = block.amax(dim=-1, keepdim=True)
            torch.sub(block, peak, out=work).exp_()
            normalizer[start:stop] = work.sum(dim=-1).log_() + peak.squeeze(1)
            # Tokens strictly more likely than the target: the compare written as 1.0 / 0.0
            # into the float scratch, then summed (exact counts; summing a bool tensor is
            # several times slower on the CPU).
            torch.gt(block, target, out=work)
            ranks[start:stop] = work.sum(dim=-1).to(torch.int64) + 1
    return PromptLogprobs(target_logits.squeeze(1) - normalizer, ranks, top_ids, top_values - normalizer.unsqueeze(1))


def compute_step(step: StepWithPromptRows, logits: torch.Tensor) -> tuple[torch.Tensor, PromptLogprobs]:
    """The runner's ``logits`` for ``step`` (float32, [S, V] when it answered
    ``step.hidden_rows``, else [S + E, V]) -> the sampled rows' logits [S, V] and what
    :func:`compute` found for the prompt rows."""
    reply = step.hidden_rows
    if reply.hidden is not None and reply.head is not None:
        return logits, compute(step.rows, reply.hidden, reply.head)
    return logits[: step.num_sampled], compute(step.rows, logits[step.num_sampled :])


# A step's prompt logprobs: the rows it computed and what they found.
Found = tuple[PromptRows, PromptLogprobs]


def run_step(
    step: SchedulerOutput,
    requests: Mapping[str, RequestState],
    forward: Callable[[SchedulerOutput | ModelStep], torch.Tensor],
) -> tuple[torch.Tensor, Found | None]:
    """``forward(step)`` (the runner's execute), with the prompt rows the step's requests want
    added (:func:`plan`): the sampled rows' logits [S, V], and the prompt rows' logprobs if any."""
    rows = plan(step, requests)
    if rows is None:
        return forward(step), None
    with_rows = StepWithPromptRows(step, rows)
    logits, found = compute_step(with_rows, forward(with_rows))
    return logits, (rows, found)


def record(rows: PromptRows, found: PromptLogprobs, requests: Mapping[str, RequestState], tokenizer: Any) -> None:
    """Append the entries to their requests (after the step went through)."""
    target_logprobs = found.target_logprobs.tolist()
    target_ranks = found.target_ranks.tolist()
    top_ids = found.top_ids.tolist()
    top_logprobs = found.top_logprobs.tolist()
    vocabulary = sorted(set(rows.targets.tolist()).union(t for ids in top_ids for t in ids))
    texts = dict(zip(vocabulary, tokenizer.batch_decode([[t] for t in vocabulary])))
    row = 0
    for rid, first_entry, count in rows.spans:
        state = requests.get(rid)
        if state is None or state.prompt_logprobs is None or state.num_prompt_logprobs != first_entry:
            row += count
            continue
        k = state.params.prompt_logprobs or 0
        for j in range(row, row + count):
            target = int(rows.targets[j])
            entry = {target: Logprob(target_logprobs[j], target_ranks[j], texts[target])}
            for rank, (tid, value) in enumerate(zip(top_ids[j][:k], top_logprobs[j][:k]), start=1):
                entry.setdefault(tid, Logprob(value, rank, texts[tid]))
            state.prompt_logprobs.append(entry)
        state.num_prompt_logprobs += count
        row += count
