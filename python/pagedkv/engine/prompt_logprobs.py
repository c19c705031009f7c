"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the log-probability the model gave each
prompt token, computed from the logits of the position before it while the prompt is prefilled.

A step normally computes the LM head only on its sampled rows (``logits_indices``). For the
requests that want prompt logprobs, :func:`plan` adds the rows of their prompt positions in
the step (every chunk of a chunked prefill, in order) and :class:`StepWithPromptRows` hands the
runner the longer ``logits_indices``; the first ``S`` logits rows are sampled as usual, the rest
go to :func:`compute` and, once the step went through, :func:`record`.

Position ``p`` of a prompt of ``L`` tokens predicts token ``p + 1``: entry ``p + 1`` of the
request's list (entry 0 is ``None``: nothing predicts the first token). The last position
``L - 1`` predicts the first generated token, which is a sampled row, not a prompt entry.
Such requests never start on prefix-cache hits (the scheduler's ``skip_prefix_cache``: cached
blocks have no logits), so their chunks cover the prompt from position 0 without a gap; a
chunk recomputed after a recompute preemption finds its entries already recorded and adds
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv.engine.outputs import Logprob
from pagedkv.engine.request_state import RequestState
from pagedkv.sample.ops import topk

__all__ = ["PromptRows", "PromptLogprobs", "StepWithPromptRows", "compute", "plan", "record"]


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
    """A ``SchedulerOutput`` whose ``logits_indices`` also hold the prompt rows (everything
    else is the step's own: the runner and the tensor-parallel broadcast read fields by name)."""

    def __init__(self, step: Any, rows: PromptRows) -> None:
        self._step = step
        self.logits_indices = np.concatenate([np.asarray(step.logits_indices, dtype=np.int64), rows.token_indices])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)


def plan(step: Any, requests: Mapping[str, RequestState]) -> PromptRows | None:
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


# Rows per pass of compute(): a block of [32, V] float32 (6 MB at 49k tokens) stays in the
# cache between its passes (max, exp-sum, rank); whole [E, V] passes ran ~3x slower.
_BLOCK_ROWS = 32


def compute(rows: PromptRows, logits: torch.Tensor) -> PromptLogprobs:
    """``logits``: [E, V] float32, the prompt rows' logits in ``rows`` order (raw logprobs, as
    for generated tokens: ``log_softmax`` of the model's logits)."""
    targets = torch.from_numpy(rows.targets).to(logits.device)
    target_logits = logits.gather(1, targets.unsqueeze(1))  # [E, 1]
    num_rows, vocab = logits.shape
    normalizer = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    ranks = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    scratch = torch.empty(min(num_rows, _BLOCK_ROWS), vocab, dtype=torch.float32, device=logits.device)
    for start in range(0, num_rows, _BLOCK_ROWS):
        block = logits[start : start + _BLOCK_ROWS]
        work = scratch[: block.shape[0]]
        peak = block.amax(dim=-1, keepdim=True)
        torch.sub(block, peak, out=work).exp_()
        normalizer[start : start + block.shape[0]] = work.sum(dim=-1).log_() + peak.squeeze(1)
        # Tokens strictly more likely than the target: (x - t)+ > 0; sign() counts them in float
        # arithmetic (a bool compare and sum is several times slower on the CPU).
        torch.sub(block, target_logits[start : start + block.shape[0]], out=work).relu_().sign_()
        ranks[start : start + block.shape[0]] = work.sum(dim=-1).to(torch.int64) + 1
    if rows.max_k > 0:
        top_values, top_ids = topk(logits, rows.max_k)
        top_logprobs = top_values - normalizer.unsqueeze(1)
    else:
        top_ids = torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
        top_logprobs = torch.empty(logits.shape[0], 0, dtype=torch.float32, device=logits.device)
    return PromptLogprobs(target_logits.squeeze(1) - normalizer, ranks, top_ids, top_logprobs)


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
