"""The engine's side of a beam search: the live beams' tokens between steps, the step's
candidates from the logits, and the outputs.

The Rust scheduler makes every decision (which beams survive, which fork, which finish, when
the search ends; see ``rust/scheduler/beam.rs``). The engine only

- turns the logits of the step's beam rows into candidates: the ``k`` most likely next tokens
  of each beam with their log-probabilities (:func:`beam_candidates`), and
- mirrors the live beams' generated tokens from the step's updates (each names the beam it
  continues), so that a server can stream the current best beam, and
- builds the final outputs from the result the scheduler hands out when the search ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedkv._core import RequestUpdate
from pagedkv.engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from pagedkv.errors import StructuredOutputError
from pagedkv.sample.beam_search_params import BeamSearchParams

__all__ = ["BeamTracker", "beam_candidates", "to_beam_search_output"]

# A finished hypothesis as Scheduler.take_beam_results gives it:
# (generated token ids, cumulative logprob, length-penalised score, finish reason).
Hypothesis = tuple[list[int], float, float, str]


def beam_candidates(
    logits: torch.Tensor, beam_rows: Sequence[int], k: int
) -> tuple[list[list[int]], list[list[float]]]:
    """The ``k`` most likely next tokens of each beam row and their log-probabilities.

    ``logits``: float[S, V], the step's sampled rows; ``beam_rows``: indices into its first
    dimension (``SchedulerOutput.beam_rows``). Returns two ``[R, k]`` lists (token ids,
    logprobs), best first, for ``Scheduler.update``. The log-softmax is taken in float32, as
    transformers' beam search does.
    """
    rows = torch.as_tensor(beam_rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    values, ids = torch.topk(logprobs, k=min(k, logprobs.shape[-1]), dim=-1)
    return ids.cpu().tolist(), values.cpu().tolist()


class BeamTracker:
    """One beam search as the engine follows it."""

    def __init__(self, params: BeamSearchParams, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        # Live beams, best first: their generated token ids and cumulative logprobs. Before the
        # first decision there is one beam, the prompt.
        self.beams: list[list[int]] = [[]]
        self.cumulative_logprobs: list[float] = [0.0]
        # The result, best first, once the search ended.
        self.result: list[Hypothesis] | None = None
        # Structured outputs: one llguidance matcher per live beam (same order as ``beams``);
        # a beam's matcher forks with it (a deep copy of its parent's, then its new tokens).
        self.matchers: list[Any] | None = None

    def advance(self, updates: Sequence[RequestUpdate]) -> None:
        """The live beams after a step: one update per beam, ``index`` its new rank and
        ``parent`` the rank (before the step) of the beam it continues."""
        beams: list[list[int]] = [[] for _ in updates]
        cums = [0.0] * len(updates)
        matchers: list[Any] = [None] * len(updates)
        for u in updates:
            parent = u.parent if u.parent is not None else 0
            beams[u.index] = self.beams[parent] + u.new_token_ids
            cums[u.index] = float(u.cumulative_logprob or 0.0)
            if self.matchers is not None:
                matcher = self.matchers[parent].deep_copy()
                # A matcher in error consumes eos "successfully": checked too (see step_masks).
                if matcher.is_error() or not matcher.consume_tokens(u.new_token_ids) or matcher.is_error():
                    raise StructuredOutputError(
                        f"beam token(s) {u.new_token_ids} break the request's structured-output constraint: "
                        f"{matcher.get_error()}"
                    )
                matchers[u.index] = matcher
        self.beams, self.cumulative_logprobs = beams, cums
        if self.matchers is not None:
            self.matchers = matchers

    def finish(self, hypotheses: list[Hypothesis]) -> None:
        self.result = hypotheses

    def text(self, tokens: list[int], reason: str | None) -> str:
        """The generated text: the eos (or stop) token that ended a sequence is left out unless
        ``include_stop_str_in_output``."""
        if reason == "stop" and tokens and not self.params.include_stop_str_in_output:
            tokens = tokens[:-1]
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False))

    def outputs(self, ended: str | None) -> list[CompletionOutput]:
        """While the search runs, the current best beam (``ended`` is None); when it ended, its
        sequences best first; when it was aborted or failed (``ended``), its live beams."""
        sequences: list[tuple[list[int], float, str | None]]
        if self.result is not None:
            sequences = [(tokens, cum, reason) for tokens, cum, _score, reason in self.result]
        else:
            beams = self.beams if ended is not None else self.beams[:1]
            sequences = [(tokens, cum, ended) for tokens, cum in zip(beams, self.cumulative_logprobs)]
        return [
            CompletionOutput(
                index=i,
                text=self.text(tokens, reason if self.result is not None else None),
                token_ids=list(tokens),
                cumulative_logprob=cum,
                finish_reason=reason,
            )
            for i, (tokens, cum, reason) in enumerate(sequences)
        ]


def to_beam_search_output(output: RequestOutput, params: BeamSearchParams) -> BeamSearchOutput:
    """``LLM.beam_search``'s shape of a finished beam request's output."""
    n = len(output.prompt_token_ids)
    sequences = []
    for c in output.outputs:
        cum = c.cumulative_logprob or 0.0
        length = max(1, len(c.token_ids))
        sequences.append(
            BeamSearchSequence(
                tokens=list(output.prompt_token_ids) + list(c.token_ids),
                cum_logprob=cum,
                text=c.text,
                finish_reason=c.finish_reason,
                score=cum / length**params.length_penalty,
                num_prompt_tokens=n,
            )
        )
    return BeamSearchOutput(sequences=sequences)
