"""What a request returns: ``RequestOutput`` holding one ``CompletionOutput`` per sample (vLLM's names).

``LLM.generate`` returns finished ``RequestOutput``s; ``LLMEngine.step`` and ``AsyncLLM`` stream
them while they run (``finished=False``). Reprs abbreviate long token lists so that printing a
batch of outputs stays readable; the fields themselves always hold everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BeamSearchOutput",
    "BeamSearchSequence",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
]

# Reprs show at most this many token ids of a list, then "..." and the length.
_REPR_MAX_IDS = 16


@dataclass
class Logprob:
    """Log-probability of one token, its 1-based rank in the vocabulary, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the chosen token plus the top ones).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated completion of a request.

    ``finish_reason`` is ``None`` while it runs, then ``"stop"`` (eos, a stop token id or a stop
    string), ``"length"`` (``max_tokens`` or the context length), ``"abort"``, or ``"error"``
    (the engine gave up on the request; ``RequestOutput.error`` says why).
    ``text`` only grows from one output to the next: while a stop string may still match, its
    possible beginning is held back.
    ``stop_reason`` is the stop string or stop token id that ended it (``None`` for eos, length
    or abort).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={_short_ids(self.token_ids)}, "
            f"cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={_short_logprobs(self.logprobs)}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) of one request's life, and its prefix-cache hits."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # Speculative decoding: tokens drafted for this request and, of those, accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (None when nothing was drafted)."""
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``n`` completions so far.

    ``error`` is set (``"ExceptionType: message"``) when the engine failed the request — a step
    that raised while it was in the batch, too often, or a failure in its own output
    processing; its unfinished completions then have ``finish_reason="error"``.

    ``kv_transfer_params`` is set on the final output of a ``do_remote_decode`` request on a KV
    producer: where a decode engine pulls its KV from (forward it as that request's
    ``kv_transfer_params``).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = field(default=0)
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing
    # predicts it), each the prompt token's Logprob plus the top ones (vLLM's layout). Filled as
    # the prompt is computed: complete from the first output with a generated token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={_short_ids(self.prompt_token_ids)}, "
            f"outputs={self.outputs!r}, finished={self.finished}, "
            f"num_cached_tokens={self.num_cached_tokens}, metrics={self.metrics!r}"
            + (f", error={self.error!r})" if self.error is not None else ")")
        )


@dataclass
class BeamSearchSequence:
    """One sequence a beam search returns (vLLM's names).

    ``tokens`` holds the prompt's token ids followed by the generated ones (as vLLM does);
    ``text`` is the generated text (without the eos token's, unless
    ``include_stop_str_in_output``). ``cum_logprob`` is the sum of the generated tokens'
    log-probabilities and ``score`` the length-penalised value sequences are ranked by.
    ``finish_reason`` is ``"stop"`` (eos / a stop token) or ``"length"`` (``max_tokens``).
    """

    tokens: list[int]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    score: float | None = None
    num_prompt_tokens: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids (``tokens`` without the prompt)."""
        return self.tokens[self.num_prompt_tokens :]

    def __repr__(self) -> str:
        return (
            f"BeamSearchSequence(tokens={_short_ids(self.tokens)}, cum_logprob={self.cum_logprob}, "
            f"score={self.score}, text={self.text!r}, finish_reason={self.finish_reason})"
        )


@dataclass
class BeamSearchOutput:
    """What ``LLM.beam_search`` returns per prompt: its best sequences, best first."""

    sequences: list[BeamSearchSequence]


def _short_ids(ids: list[int]) -> str:
    if len(ids) <= _REPR_MAX_IDS:
        return repr(list(ids))
    head = ", ".join(str(token_id) for token_id in ids[: _REPR_MAX_IDS - 1])
    return f"[{head}, ..., {ids[-1]}] (len={len(ids)})"


def _short_logprobs(logprobs: SampleLogprobs | None) -> str:
    if logprobs is None:
        return "None"
    return f"<{len(logprobs)} positions>"
