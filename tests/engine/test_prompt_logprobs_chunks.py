"""Prompt logprobs from the prompt rows' hidden states (``worker/head_rows.py``): the runner's
head split, and ``prompt_logprobs.compute`` running the LM head a chunk of rows at a time,
against the whole ``[E, V]`` logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from pagedkv.engine import prompt_logprobs
from pagedkv.engine.prompt_logprobs import PromptRows, compute
from pagedkv.worker.head_rows import HeadSplit, HiddenRows
from pagedkv.worker.step_input import StepInput

HIDDEN, VOCAB = 16, 1000


def exact_head_and_hidden(num_rows: int, seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    """A head and hidden states whose logits are exact in float32, in any summation order, and
    all distinct within a row (no ties for ranks or top-k): small integers in every column but
    the last, where hidden is 1 and the weight ``token / 1024`` (an exact fraction below 1)."""
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    weight = torch.randint(-3, 4, (VOCAB, HIDDEN), generator=generator).float()
    weight[:, -1] = torch.arange(VOCAB, dtype=torch.float32) / 1024
    head.weight.data = weight
    hidden = torch.randint(-3, 4, (num_rows, HIDDEN), generator=generator).float()
    hidden[:, -1] = 1.0
    return head, hidden


def rows_for(num_rows: int, max_k: int, seed: int = 1) -> PromptRows:
    rng = np.random.default_rng(seed)
    # Two requests' spans, as plan() lays them out (only their count matters to compute()).
    first = num_rows // 3
    spans = [("a", 1, first), ("b", 5, num_rows - first)]
    return PromptRows(spans, np.arange(num_rows, dtype=np.int64), rng.integers(0, VOCAB, num_rows), max_k)


@dataclass
class Output:
    logits: torch.Tensor  # [1, N, V]


class ToyLM(nn.Module):
    """The shape of a transformers causal LM's head: ``logits_to_keep`` rows of the final
    hidden states through ``get_output_embeddings()``, then an optional post-processing."""

    def __init__(self, head: nn.Linear, post: str | None = None) -> None:
        super().__init__()
        self.lm_head = head
        self.post = post

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, hidden_states: torch.Tensor, logits_to_keep: torch.Tensor) -> Output:
        logits = self.lm_head(hidden_states[:, logits_to_keep, :])
        if self.post == "soft_cap":  # Gemma 2's final logit soft-capping: a new tensor
            logits = torch.tanh(logits / 30.0) * 30.0
        elif self.post == "in_place":  # Chameleon's masking: the head's own tensor, changed
            logits[:, :, :10] = torch.finfo(logits.dtype).min
        return Output(logits)


@pytest.mark.parametrize("max_k", [0, 1, 3])
@pytest.mark.parametrize("chunk_rows", [1, 3, 32, 45, 512])
def test_chunked_head_equals_the_whole_logits_across_chunk_boundaries(chunk_rows: int, max_k: int) -> None:
    # 70 rows: chunks of 3 and 45 end inside compute()'s 32-row statistics blocks and across them.
    num_rows = 70
    head, hidden = exact_head_and_hidden(num_rows)
    rows = rows_for(num_rows, max_k)
    split = HeadSplit(ToyLM(head))
    with torch.inference_mode():
        logits = head(hidden)  # [E, V]: what the runner returns without the split
        whole = compute(rows, logits)
        chunked = compute(rows, hidden, split.head, chunk_rows=chunk_rows)
    assert torch.equal(chunked.target_ranks, whole.target_ranks)
    assert torch.equal(chunked.top_ids, whole.top_ids)
    torch.testing.assert_close(chunked.target_logprobs, whole.target_logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked.top_logprobs, whole.top_logprobs, rtol=0, atol=1e-6)
    # And both are the log-softmax, its ranks (tokens strictly more likely) and its top-k.
    reference = torch.log_softmax(logits.double(), dim=-1)
    targets = torch.from_numpy(rows.targets).unsqueeze(1)
    target = reference.gather(1, targets)
    torch.testing.assert_close(chunked.target_logprobs.double(), target.squeeze(1), rtol=0, atol=1e-5)
    assert torch.equal(chunked.target_ranks, (reference > target).sum(dim=-1) + 1)
    assert torch.equal(chunked.top_ids, reference.topk(max_k, dim=-1).indices)


def test_the_head_reuses_its_buffer_and_computes_what_the_module_does() -> None:
    head, hidden = exact_head_and_hidden(8)
    split = HeadSplit(ToyLM(head))
    assert split.head.rows_per_call == (256 << 20) // (4 * VOCAB)
    with torch.inference_mode():
        first = split.head(hidden)
        assert torch.equal(first, head(hidden))
        again = split.head(hidden[:5])  # fewer rows: the same buffer
        assert again.data_ptr() == first.data_ptr() and torch.equal(again, head(hidden[:5]))
        head.bias = nn.Parameter(torch.arange(VOCAB, dtype=torch.float32))
        assert torch.equal(split.head(hidden), head(hidden))


def test_a_plain_head_is_watched_once_then_split() -> None:
    head, hidden = exact_head_and_hidden(12)
    model = ToyLM(head)
    split = HeadSplit(model)
    states = hidden.unsqueeze(0)  # [1, T, H]
    keep = torch.tensor([11, 4, 0, 1, 2, 3])  # S = 2 sampled rows, then E = 4 prompt rows
    with torch.inference_mode():
        with split.split(None, len(keep)):  # no request: nothing to decide yet
            model(states, keep)
        assert split.plain is None
        watched = HiddenRows(4)
        with split.split(watched, len(keep)):
            every_row = model(states, keep).logits[0]
        assert split.plain is True and watched.hidden is None  # the first step: all rows' logits
        assert every_row.shape == (6, VOCAB)
        request = HiddenRows(4)
        with split.split(request, len(keep)):
            sampled = model(states, keep).logits[0]
        assert torch.equal(sampled, every_row[:2])
        assert request.hidden is not None and request.head is not None
        assert torch.equal(request.hidden, hidden[keep[2:]])
        assert torch.equal(request.head(request.hidden), every_row[2:])
        # The hooks are gone: the next plain forward computes every row.
        assert model(states, keep).logits.shape == (1, 6, VOCAB)


@pytest.mark.parametrize("post", ["soft_cap", "in_place"])
def test_a_post_processed_head_is_never_split(post: str) -> None:
    head, hidden = exact_head_and_hidden(12)
    model = ToyLM(head, post)
    split = HeadSplit(model)
    keep = torch.tensor([11, 0, 1, 2])
    with torch.inference_mode():
        for _ in range(2):
            request = HiddenRows(3)
            with split.split(request, len(keep)):
                logits = model(hidden.unsqueeze(0), keep).logits[0]
            assert split.plain is False
            assert request.hidden is None and logits.shape == (4, VOCAB)


def test_compute_step_takes_the_rows_from_whichever_the_runner_answered() -> None:
    head, hidden = exact_head_and_hidden(5)
    rows = PromptRows([("a", 1, 3)], np.array([0, 1, 2]), np.array([7, 8, 9]), 2)

    def step(logits_indices: np.ndarray) -> StepInput:  # only the sampled rows matter here
        empty = np.zeros(0, dtype=np.int64)
        return StepInput(
            input_ids=empty,
            positions=empty,
            slot_mapping=empty,
            cu_seqlens_q=empty,
            seq_lens=empty,
            block_tables=np.zeros((0, 0), dtype=np.int32),
            logits_indices=logits_indices,
        )

    with torch.inference_mode():
        logits = head(hidden)  # rows 3, 4 sampled; rows 0, 1, 2 the prompt's
        expected = compute(rows, logits[:3])
        unanswered = prompt_logprobs.StepWithPromptRows(step(np.array([3, 4])), rows)
        assert unanswered.num_sampled == 2 and unanswered.logits_indices.tolist() == [3, 4, 0, 1, 2]
        sampled, found = prompt_logprobs.compute_step(unanswered, torch.cat([logits[3:], logits[:3]]))
        assert torch.equal(sampled, logits[3:])
        answered = prompt_logprobs.StepWithPromptRows(step(np.array([3, 4])), rows)
        answered.hidden_rows.hidden = hidden[:3]
        answered.hidden_rows.head = HeadSplit(ToyLM(head)).head
        sampled_too, found_too = prompt_logprobs.compute_step(answered, logits[3:])
        assert torch.equal(sampled_too, logits[3:])
    for got in (found, found_too):
        assert torch.equal(got.target_ranks, expected.target_ranks)
        assert torch.equal(got.top_ids, expected.top_ids)
        torch.testing.assert_close(got.target_logprobs, expected.target_logprobs, rtol=0, atol=1e-6)
