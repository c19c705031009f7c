"""What the engine keeps per request between steps: one completion per parallel sample, with
its incremental detokenizer, private random generator and log-probabilities, and the
request's timestamps. It turns that state into the public :class:`RequestOutput`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedkv.engine.beam_tracker import BeamTracker
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SampleLogprobs
from pagedkv.sample.penalties import TokenBuffer
from pagedkv.sample.prepared import PreparedSampling
from pagedkv.sample.sampler import make_generator
from pagedkv.sample.sampling_params import SamplingParams
from pagedkv.structured.compiler import CompiledGrammar

__all__ = ["RequestState", "SampleState"]


@dataclass
class SampleState:
    """One completion (parallel sample) of a request."""

    index: int
    detokenizer: IncrementalDetokenizer
    # The sample's own generator when the request is seeded (seed + index, as vLLM does).
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The output tokens as an array too, for requests with penalties (the sampler's input).
    output_buffer: TokenBuffer | None = None
    # Structured outputs: the sample's llguidance matcher, advanced by each committed token.
    matcher: Any = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            # While the sample runs, a tail that may become a stop string is held back, so the
            # text of successive outputs only grows.
            text=self.detokenizer.visible_text(finished=self.finish_reason is not None),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    """A live request as the engine sees it."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        device: torch.device,
        arrival_time: float | None = None,
        prepared: PreparedSampling | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        # Steps that failed (and were rolled back) while this request was in them.
        self.num_failed_steps = 0
        # Why the engine gave up on this request (finish_reason "error"), if it did.
        self.error: BaseException | None = None
        # KV transfer: hold the KV for a remote reader when it ends (do_remote_decode), and the
        # params that tell the reader where it is (set when it ends).
        self.hold_kv = False
        self.kv_transfer_params: dict[str, Any] | None = None
        # The tenant (prefix-cache namespace, vLLM's cache_salt): every cache the request's
        # tokens reach is keyed by it (the prefix cache, speculation's state, the draft model's).
        self.cache_salt: str | None = None
        # A beam search (LLMEngine.add_request with BeamSearchParams): its beams and result.
        # ``params`` is then the equivalent greedy SamplingParams with n = 1, and ``samples``
        # holds one sample whose finish_reason is the request's.
        self.beam: BeamTracker | None = None
        wants_logprobs = params.logprobs is not None
        self.samples = [
            SampleState(
                index=i,
                detokenizer=IncrementalDetokenizer.from_params(tokenizer, params, prompt_token_ids),
                generator=None if params.seed is None else make_generator(params.seed + i, device),
                logprobs=[] if wants_logprobs else None,
                cumulative_logprob=0.0 if wants_logprobs else None,
            )
            for i in range(params.n)
        ]
        # Penalties: the prompt as an array (the repetition penalty's input), made on first use.
        self._prompt_array: np.ndarray | None = None
        # What sampling needs at every step (allowed-token mask, logit bias, bad words' tokens,
        # min_tokens' bans), built once when the request was added (pagedkv.sample.prepared).
        self.prepared = prepared if prepared is not None else PreparedSampling.empty(params, device)
        # prompt_logprobs: one entry per prompt token (the first None), filled as the prompt's
        # chunks are computed; positions recorded so far (a recomputed chunk is not recorded twice).
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.num_prompt_logprobs = 1 if params.prompt_logprobs is not None else 0
        # Structured outputs: the compiled constraint, once attached (attach_grammar).
        self.grammar: CompiledGrammar | None = None

    def attach_grammar(self, grammar: CompiledGrammar) -> None:
        """Gives every sample (or the beam search's first beam) its own matcher in the
        constraint's initial state; called before the request reaches the scheduler."""
        self.grammar = grammar
        if self.beam is not None:
            self.beam.matchers = [grammar.new_matcher()]
            return
        for sample in self.samples:
            sample.matcher = grammar.new_matcher()

    def matcher(self, index: int) -> Any:
        """The matcher of sample (or live beam) ``index``, None without a constraint."""
        if self.grammar is None:
            return None
        if self.beam is not None:
            matchers = self.beam.matchers
            return matchers[index] if matchers is not None and index < len(matchers) else None
        return self.samples[index].matcher

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def end(self, reason: str) -> None:
        """Ends every sample still running with ``reason`` ("abort" or "error")."""
        for sample in self.samples:
            if sample.finish_reason is None:
                sample.finish_reason = reason
        self.metrics.finished_time = time.time()

    def prompt_array(self) -> np.ndarray:
        """The prompt's token ids as an int64 array (made once)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int64)
        return self._prompt_array

    def output_array(self, index: int) -> np.ndarray:
        """Sample ``index``'s generated token ids as an int64 array: from the first call on, the
        sample keeps them in a :class:`TokenBuffer` too (requests with penalties)."""
        sample = self.samples[index]
        if sample.output_buffer is None:
            sample.output_buffer = TokenBuffer(2 * len(sample.token_ids) + 16)
            for token in sample.token_ids:
                sample.output_buffer.append(token)
        return sample.output_buffer.array()

    def add_logprobs(self, index: int, entries: dict[int, Logprob], chosen: int) -> None:
        sample = self.samples[index]
        if sample.logprobs is None:
            return
        sample.logprobs.append(entries)
        sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + entries[chosen].logprob

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=(
                [s.output() for s in self.samples]
                if self.beam is None
                else self.beam.outputs(None if self.beam.result is not None else self.samples[0].finish_reason)
            ),
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.metrics.num_cached_tokens,
            error=None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            kv_transfer_params=self.kv_transfer_params,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )
