"""``LLMEngine``: the embedding API for servers — add requests, step, read outputs.

One ``step()``:

1. ``Scheduler.schedule()`` (Rust) picks the batch and returns it as flat arrays;
2. ``ModelRunner.execute`` runs its copy-on-write ops and one packed forward over all
   scheduled tokens on the paged KV cache, and returns the logits rows to sample;
3. the :class:`Sampler` draws one token per row (greedy / temperature / top-k / top-p / min-p,
   per-sample seeds; eos and stop ids banned below ``min_tokens``);
4. ``Scheduler.update`` (Rust) appends the tokens and applies the token-based stops (eos, stop
   ids, max_tokens, max_model_len), freeing finished sequences' blocks;
5. each new token is detokenized incrementally; a stop string ends its sample
   (``Scheduler.finish_sample``) and cuts the text;
6. a :class:`RequestOutput` is returned for every request that progressed.

Bad input (unknown ids, invalid parameters, empty or too long prompts, token ids outside the
vocabulary) raises a typed :mod:`pagedkv.errors` exception in ``add_request`` /
``abort_request`` before anything changes, so the engine keeps serving its other requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from pagedkv._core import Scheduler, SchedulerConfig, SchedulerOutput
from pagedkv.engine.args import EngineArgs
from pagedkv.errors import (
    ConfigError,
    InvalidTypeError,
    ModelLoadError,
    UnknownRequestError,
)
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.engine.outputs import Logprob, RequestOutput
from pagedkv.engine.prompts import PromptType, to_token_ids
from pagedkv.engine.request_state import RequestState
from pagedkv.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from pagedkv.sample.sampling_params import SamplingParams

__all__ = ["LLMEngine"]


class LLMEngine:
    """A model on a paged KV cache, driven one step at a time.

    ``LLMEngine(EngineArgs(...))``, ``LLMEngine(model=..., **engine_args)`` or
    ``LLMEngine.from_engine_args(args)``.
    """

    def __init__(self, engine_args: EngineArgs | None = None, **kwargs: Any) -> None:
        if engine_args is None:
            engine_args = EngineArgs.from_kwargs(**kwargs)
        elif kwargs:
            raise ConfigError("pass either an EngineArgs or keyword arguments, not both")
        self.args = args = engine_args
        torch.manual_seed(args.seed)
        self.runner = ModelRunner(
            args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            attention_backend=args.attention_backend,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            trust_remote_code=args.trust_remote_code,
        )
        self.tokenizer = _load_tokenizer(args.tokenizer or self.runner.model_path, args.trust_remote_code)
        self.max_model_len = self.runner.max_model_len
        capacity = self.runner.num_blocks * self.runner.block_size
        if capacity < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {capacity} tokens ({self.runner.num_blocks} blocks of "
                f"{self.runner.block_size}, {self.runner.kv_cache_bytes} bytes), fewer than one "
                f"request of max_model_len = {self.max_model_len} tokens: raise kv_cache_memory / "
                f"num_blocks / gpu_memory_utilization, or lower max_model_len"
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=self.runner.block_size,
                max_model_len=self.max_model_len,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching,
                policy=args.scheduling_policy,
            )
        )
        self.sampler = Sampler()
        self.eos_token_ids = self.runner.eos_token_ids
        self.requests: dict[str, RequestState] = {}
        self._counters = {"steps": 0, "tokens_computed": 0, "generation_tokens": 0, "model_time_s": 0.0}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args)

    # ------------------------------------------------------------------ requests

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. Raises (changing nothing) on a duplicate id, invalid parameters, an
        empty prompt, a prompt longer than ``max_model_len`` or token ids outside the vocabulary."""
        if not isinstance(request_id, str):
            raise InvalidTypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidTypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, prompt_ids = to_token_ids(prompt, self.tokenizer, self.runner.vocab_size)
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, self.max_model_len - len(prompt_ids))
        self.scheduler.add_request(
            request_id,
            prompt_ids,
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=[] if params.ignore_eos else self.eos_token_ids,
            stop_token_ids=params.stop_token_ids or [],
            ignore_eos=params.ignore_eos,
            priority=priority,
            n=params.n,
        )
        self.requests[request_id] = RequestState(
            request_id, text, prompt_ids, params, self.tokenizer, self.runner.device, arrival_time
        )

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """End requests now; their blocks are freed at once. Returns their final outputs
        (unfinished samples get ``finish_reason="abort"``). Unknown ids raise
        UnknownRequestError (the known ones in the same call are still aborted)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        unknown, outputs = [], []
        for rid in ids:
            state = self.requests.pop(rid, None)
            if state is None:
                unknown.append(rid)
                continue
            self.scheduler.abort_request(rid)
            for sample in state.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
            state.metrics.finished_time = time.time()
            outputs.append(state.output())
        if unknown:
            raise UnknownRequestError(f"unknown request id(s) {unknown}: never added, finished, or aborted")
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the outputs of the requests that progressed."""
        out = self.scheduler.schedule()
        now = time.time()
        for rid in dict.fromkeys(out.req_ids):
            state = self.requests.get(rid)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
        if out.num_tokens == 0 and len(out.copy_ops) == 0:
            self.scheduler.update(out, [])
            return []
        t0 = time.perf_counter()
        logits = self.runner.execute(out)
        sampled = self._sample(out, logits)
        self._counters["model_time_s"] += time.perf_counter() - t0
        updates = self.scheduler.update(out, sampled.sampled_token_ids.cpu().numpy())
        self._counters["steps"] += 1
        self._counters["tokens_computed"] += out.num_tokens
        self._counters["generation_tokens"] += len(updates)
        return self._apply_updates(out, updates, sampled)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> SamplerOutput:
        params, generators, banned = [], [], {}
        for row, (rid, index) in enumerate(zip(out.sampled_req_ids, out.sample_indices.tolist())):
            state = self.requests[rid]
            p = state.params
            params.append(p)
            sample = state.samples[index]
            generators.append(sample.generator)
            if len(sample.token_ids) < p.min_tokens:
                ban = (p.stop_token_ids or []) + ([] if p.ignore_eos else self.eos_token_ids)
                if ban:
                    banned[row] = ban
        metadata = SamplingMetadata.build(
            params,
            vocab_size=self.runner.vocab_size,
            device=logits.device,
            generators=generators,
            banned_token_ids=banned or None,
        )
        return self.sampler(logits, metadata)

    def _apply_updates(self, out: SchedulerOutput, updates: list, sampled: SamplerOutput) -> list[RequestOutput]:
        now = time.time()
        # Logits row of each (request, sample), needed only to read logprobs.
        rows = (
            {key: row for row, key in enumerate(zip(out.sampled_req_ids, out.sample_indices.tolist()))}
            if sampled.logprobs is not None
            else {}
        )
        touched: dict[str, RequestState] = {}
        for u in updates:
            state = self.requests.get(u.request_id)
            if state is None:
                continue
            sample = state.samples[u.index]
            token = u.new_token_ids[0]
            sample.token_ids.append(token)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                state.metrics.num_cached_tokens = u.num_cached_tokens
            if sampled.logprobs is not None and state.params.logprobs is not None:
                self._record_logprobs(state, u.index, rows[(u.request_id, u.index)], sampled, token)
            reason = u.finish_reason
            stop_str = sample.detokenizer.update([token], stop_terminated=reason == "stop")
            if reason is not None:
                sample.finish_reason = reason
                if reason == "stop" and token in (state.params.stop_token_ids or []):
                    sample.stop_reason = token
            elif stop_str is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop_str
                self.scheduler.finish_sample(u.request_id, u.index)
            touched[u.request_id] = state
        outputs = []
        for rid, state in touched.items():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[rid]
            outputs.append(state.output())
        return outputs

    def _record_logprobs(self, state: RequestState, index: int, row: int, sampled: SamplerOutput, token: int) -> None:
        lp = sampled.logprobs
        assert lp is not None
        k = state.params.logprobs or 0
        ids = lp.token_ids[row, : 1 + k].tolist()
        values = lp.logprobs[row, : 1 + k].tolist()
        entries = {ids[0]: Logprob(values[0], int(lp.ranks[row]), self.tokenizer.decode([ids[0]]))}
        for rank, (tid, value) in enumerate(zip(ids[1:], values[1:]), start=1):
            entries.setdefault(tid, Logprob(value, rank, self.tokenizer.decode([tid])))
        state.add_logprobs(index, entries, token)

    # ------------------------------------------------------------------ stats

    def get_stats(self) -> dict[str, Any]:
        """Scheduler statistics (KV usage and utilization, prefix cache, preemptions, queue
        lengths) and engine counters (steps, tokens computed, tokens generated, model time)."""
        stats = self.scheduler.stats().as_dict()
        stats.update(self._counters)
        stats["num_unfinished_requests"] = len(self.requests)
        stats["kv_cache_bytes"] = self.runner.kv_cache_bytes
        return stats


def _load_tokenizer(name: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load a tokenizer from {name!r}: {exc}") from exc
