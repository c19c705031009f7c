"""``LLM``: offline batched generation with vLLM's interface.

llm = pagedkv.LLM()                       # the embedded SmolLM2-135M-Instruct
outs = llm.generate(["Hello", "The capital of France is"],
                    pagedkv.SamplingParams(max_tokens=32, temperature=0))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.beam_tracker import to_beam_search_output
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import BeamSearchOutput, RequestOutput
from pagedkv.engine.prompts import PromptType, chat_prompt, is_single_prompt
from pagedkv.errors import InvalidArgumentError, InvalidTypeError
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.sampling_params import SamplingParams

__all__ = ["LLM"]

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]


class LLM:
    """A model on a paged KV cache for offline batched generation.

    ``LLM(model=None, **engine_args)``; ``model=None`` serves the embedded SmolLM2. Engine
    arguments: see :class:`pagedkv.EngineArgs` (``dtype``, ``device``, ``block_size``,
    ``kv_cache_memory``, ``num_blocks``, ``kv_cache_dtype``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_stats(self) -> dict[str, Any]:
        """The engine's statistics, as :meth:`LLMEngine.get_stats` gives them: KV usage and
        utilization, prefix-cache queries and hits (device and host tiers), preemptions, the
        KV cache's size and dtype, and counters of steps and tokens."""
        return self.llm_engine.get_stats()

    def shutdown(self) -> None:
        """Flush the KV cache to the disk tier (``kv_cache_dir``), if there is one, so that the
        next engine on the same model starts with its prefixes cached."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order.

        ``prompts``: a string, a list of token ids, a dict (``{"prompt": ...}`` or
        ``{"prompt_token_ids": ...}``), or a list of those. ``sampling_params``: one for all
        prompts or one per prompt (default: ``SamplingParams()``).
        """
        prompt_list = _prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidArgumentError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        else:
            raise InvalidTypeError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        if priority is not None and len(priority) != len(prompt_list):
            raise InvalidArgumentError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        return self._submit(prompt_list, params_list, priority, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``): one
        :class:`BeamSearchOutput` per prompt, in input order, holding its ``beam_width`` best
        sequences (prompt + generated ``tokens``, generated ``text``, ``cum_logprob``), best
        first. The scheduler runs the beams natively: they share the prompt's KV blocks and
        their common history, and fork and die at block granularity (copy-on-write).
        """
        if not isinstance(params, BeamSearchParams):
            raise InvalidTypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompt_list = _prompt_list(prompts)
        outputs = self._submit(prompt_list, [params] * len(prompt_list), None, use_tqdm)
        return [to_beam_search_output(o, params) for o in outputs]

    def _submit(
        self,
        prompt_list: Sequence[PromptType],
        params_list: Sequence[SamplingParams | BeamSearchParams],
        priority: Sequence[int] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Adds one request per prompt (all or none) and runs them to the end."""
        engine = self.llm_engine
        # Every constraint compiled first (in parallel, off the engine): a bad schema raises
        # here, before any request of this call is queued.
        engine.compile_grammars(p.structured_outputs for p in params_list)
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, params, priority=0 if priority is None else priority[i])
                ids.append(rid)
        except BaseException:
            # Leave the engine as it was: nothing of this call stays queued.
            if ids:
                engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        start = time.perf_counter()
        prompt_tokens = generated = 0
        try:
            while len(done) < len(ids) and engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception:
                    # The engine rolled the step back and retries it; a request that keeps
                    # failing comes back with finish_reason "error" (LLMEngine.step).
                    logger.warning("a step failed; retrying it", exc_info=True)
                    continue
                for out in outputs:
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        prompt_tokens += len(out.prompt_token_ids)
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            elapsed = time.perf_counter() - start
                            bar.update(1)
                            bar.set_postfix_str(
                                f"input {prompt_tokens / elapsed:.0f} tok/s, output {generated / elapsed:.0f} tok/s"
                            )
        except BaseException:
            # Ctrl-C (or any other interrupt): this call's requests leave the engine, which
            # stays usable for the next call.
            left = [i for i in ids if i not in done and i in engine.requests]
            if left:
                engine.abort_request(left)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or
        to a list of conversations, rendered with the tokenizer's chat template."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
            raise InvalidTypeError("messages must be a conversation or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if not all(isinstance(conv, Sequence) and not isinstance(conv, (str, bytes)) for conv in conversations):
            raise InvalidTypeError("messages must be a conversation (list of dicts) or a list of conversations")
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = [
            chat_prompt(
                tokenizer,
                cast("Conversation", conv),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or a list of prompts, as a list."""
    if is_single_prompt(prompts):
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        return list(cast("Sequence[PromptType]", prompts))
    raise InvalidTypeError(
        f"prompts must be a str, a list of token ids, a dict, or a list of those; got {type(prompts).__name__}"
    )


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
