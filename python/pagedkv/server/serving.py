"""What the completions and chat handlers share: the engine, request checks and admission, the
queue limit, metrics per request, and running one or several engine requests to the end or as
a stream.

Lifecycle of a request (both endpoints):

1. :meth:`OpenAIServing.check_request`: 404 or 400 before any work: unsupported fields, ``n``
   over the engine's ``max_num_seqs``, ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs``
   over its ``max_logprobs``, lists over their bounds (:meth:`~OpenAIServing.check_sizes`:
   stop strings, stop token ids, bad words, allowed token ids, logit bias), a stop string or
   bad word that is not valid Unicode. Then,
   still before tokenizing, :meth:`~OpenAIServing.check_admission` (503 when the prompts
   would not fit under ``max_queued_requests``), the number of prompts
   (``max_prompts_per_request``) and each prompt's characters (``max_prompt_chars``), 400.
2. The prompt is tokenized here, off the event loop, so ``prompt + max_tokens`` can be checked
   against ``max_model_len`` (400, as vLLM does) and the engine does not tokenize it again.
   The request's ``SamplingParams`` are built off the event loop too, once per API request
   (its prompts share them, and with them one allowed-token mask), and the engine's per-step
   structures are built from them in a worker thread when they are added
   (``AsyncLLM.add_request``, pagedkv.sample.prepared).
3. ``start``: admission again (the queue moved while tokenizing), then
   :meth:`AsyncLLM.add_request` (bad parameters: 400, raised before anything streams).
4. The outputs are read by :meth:`run` (merged across the request's prompts). Leaving it early
   — the client disconnected (the streaming response is cancelled; a non-streaming handler is
   cancelled by :func:`cancel_on_disconnect`), the server shuts down — closes every engine
   stream, which aborts its request and frees its blocks at once. Past the shutdown timeout
   :meth:`OpenAIServing.end_all` fails every running request with a 503: a stream then ends with
   an in-band error event and ``data: [DONE]``, not cut mid-body.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from starlette.requests import Request

from pagedkv.engine.async_llm import AsyncLLM, RequestStream
from pagedkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedkv.engine.prompts import check_text, check_token_ids, tokenize
from pagedkv.errors import InvalidArgumentError, PagedKVError, RequestFailedError, StructuredOutputError
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.limits import (
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    check_count,
)
from pagedkv.sample.sampling_params import SamplingParams
from pagedkv.server.errors import APIError, error_body, from_exception, request_error
from pagedkv.server.limits import ServerLimits
from pagedkv.server.metrics import RequestTracker, ServerMetrics
from pagedkv.server.protocol import (
    ConstraintError,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
    _SamplingFields,
)
from pagedkv.structured.params import StructuredOutputsParams

__all__ = [
    "EngineRequest",
    "OpenAIServing",
    "RunningRequest",
    "cancel_on_disconnect",
    "finite_logprob",
    "new_request_id",
    "prompt_logprobs_body",
    "sse",
    "sse_stream",
    "StreamedChoices",
    "top_logprobs",
    "usage",
]

T = TypeVar("T")


@dataclass
class EngineRequest:
    """One prompt of an API request, as the engine will see it."""

    prompt: dict[str, Any]  # {"prompt": text or None, "prompt_token_ids": [...]}
    params: SamplingParams | BeamSearchParams

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt["prompt_token_ids"])


class OpenAIServing:
    """The state the endpoints share (one per server)."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: Sequence[str],
        metrics: ServerMetrics,
        *,
        max_queued_requests: int | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.limits = limits or ServerLimits()
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len: int = engine.engine.max_model_len
        self.vocab_size: int = engine.engine.runner.vocab_size
        config = engine.engine.config
        self.max_num_seqs: int = config.scheduling.max_num_seqs
        self.max_logprobs: int = config.model.max_logprobs
        self.max_prompt_chars: int = self.limits.max_prompt_chars or self.max_model_len * longest_token_chars(
            self.tokenizer
        )
        # Requests admitted that have not produced a token yet (waiting or in prefill): what
        # max_queued_requests bounds. Only the event loop changes it.
        self.num_queued = 0
        # Every API request between admission and its end (end_all fails them at shutdown).
        self.running: set[RunningRequest] = set()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    # ------------------------------------------------------------------ checks

    def check_request(self, request: _SamplingFields) -> None:
        """404 for a model this server does not serve, 400 for unsupported fields."""
        if request.model is not None and request.model not in self.served_model_names:
            raise APIError(404, f"The model `{request.model}` does not exist.", param="model", code="model_not_found")
        problem = request.unsupported()
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0])
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_decode") and request.stream:
            raise APIError(
                400,
                "do_remote_decode needs stream=false: the answer carries the kv_transfer_params",
                param="kv_transfer_params",
            )
        if request.n > self.max_num_seqs:
            raise APIError(
                400,
                f"n = {request.n} exceeds max_num_seqs = {self.max_num_seqs}: its samples could never run together",
                param="n",
            )
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(request, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.max_logprobs:
                raise APIError(400, f"{name} = {value} exceeds max_logprobs = {self.max_logprobs}", param=name)
        self.check_sizes(request)
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        for stop in stops:
            self.check_text(stop, "stop")
        for word in request.bad_words or []:
            self.check_text(word, "bad_words")

    def check_sizes(self, request: _SamplingFields) -> None:
        """A 400 naming the field for a list a step would pay for that is over its bound, before
        any entry is read (pagedkv.sample.limits; ``allowed_token_ids`` and ``logit_bias``: the
        vocabulary's size, since distinct ids cannot outnumber it). SamplingParams and the
        engine check the same bounds again, for callers that do not come through here."""
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        vocab = " (the vocabulary's size)"
        counts = (
            ("stop", len(stops), MAX_STOP_STRINGS, "strings", ""),
            ("stop_token_ids", len(request.stop_token_ids or ()), MAX_STOP_TOKEN_IDS, "ids", ""),
            ("bad_words", len(request.bad_words or ()), MAX_BAD_WORDS, "words", ""),
            ("allowed_token_ids", len(request.allowed_token_ids or ()), self.vocab_size, "ids", vocab),
            ("logit_bias", len(request.logit_bias or ()), self.vocab_size, "entries", vocab),
        )
        for name, count, limit, what, why in counts:
            problem = check_count(name, count, limit, what)
            if problem is not None:
                raise APIError(400, problem + why, param=name)
        for name, texts, limit in (
            ("stop", stops, MAX_STOP_CHARS),
            ("bad_words", request.bad_words or (), MAX_BAD_WORDS_CHARS),
        ):
            num_chars = sum(len(t) for t in texts)
            if num_chars > limit:
                raise APIError(
                    400, f"{name} has {num_chars} characters together, more than the limit of {limit}", param=name
                )

    @staticmethod
    def check_text(text: str, param: str) -> str:
        """A 400 for text that is not valid Unicode (a lone surrogate, which JSON allows)."""
        try:
            return check_text(text, f"the {param} string")
        except InvalidArgumentError as exc:
            raise APIError(400, str(exc), param=param, code=type(exc).__name__) from None

    def check_prompt_chars(self, num_chars: int, param: str = "prompt", *, what: str | None = None) -> None:
        """A 400 for a prompt longer than ``max_prompt_chars``, before it is tokenized.
        ``what``: the text counted, when the count stopped past the limit (a conversation)."""
        if num_chars > self.max_prompt_chars:
            counted = f"the {param} has {num_chars} characters, more" if what is None else f"{what} has more characters"
            raise APIError(
                400,
                f"{counted} than max_prompt_chars = {self.max_prompt_chars}",
                param=param,
                code="context_length_exceeded",
            )

    def check_admission(self, num_requests: int) -> None:
        """503 when ``num_requests`` more would pass ``max_queued_requests`` (checked before
        any work, and again when they are added)."""
        if self.max_queued_requests is not None and self.num_queued + num_requests > self.max_queued_requests:
            raise APIError(
                503,
                f"the server has {self.num_queued} requests waiting for their first token and this one "
                f"adds {num_requests} (max_queued_requests={self.max_queued_requests}); retry later",
                code="server_overloaded",
            )

    def sampling_params(
        self,
        request: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams | BeamSearchParams:
        """The engine's SamplingParams for ``request``, or BeamSearchParams with
        ``use_beam_search`` (vLLM's mapping: the width is ``n``); a ConfigError on a bad value is
        a 400 naming the field."""
        try:
            found = request.constraint()
        except ConstraintError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        constraint = None if found is None else found[0]
        if tool_constraint is not None:  # tool_choice "required" or a named function
            if found is not None:
                raise APIError(
                    400,
                    f"tool_choice {getattr(request, 'tool_choice', None)!r} cannot be combined with {found[1]}",
                    param=found[1],
                )
            constraint = tool_constraint
        if request.use_beam_search:
            if logprobs is not None:
                raise APIError(400, "logprobs are not supported with use_beam_search", param="logprobs")
            try:
                return BeamSearchParams(
                    beam_width=request.n,
                    max_tokens=max_tokens if max_tokens is not None else self.max_model_len,
                    ignore_eos=request.ignore_eos,
                    temperature=request.temperature or 0.0,
                    length_penalty=request.length_penalty,
                    include_stop_str_in_output=request.include_stop_str_in_output,
                    structured_outputs=constraint,
                )
            except PagedKVError as exc:
                raise request_error(exc, type(request).model_fields) from exc
        try:
            logit_bias = request.logit_bias_ids()
        except ValueError as exc:
            raise APIError(400, str(exc), param="logit_bias") from None
        kwargs: dict[str, Any] = {
            "n": request.n,
            "max_tokens": max_tokens,
            "min_tokens": request.min_tokens,
            "seed": request.seed,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "ignore_eos": request.ignore_eos,
            "logprobs": logprobs,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "skip_special_tokens": request.skip_special_tokens,
            "retention_priority": request.retention_priority,
            "retention_duration": request.retention_duration,
            "retention_tokens": request.retention_tokens,
            "structured_outputs": constraint,
        }
        # OpenAI's defaults (temperature 1, top_p 1) are SamplingParams' defaults too.
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(request, name)
            if value is not None:
                kwargs[name] = value
        # Penalties, biases and prompt logprobs: passed when set (their defaults are neutral).
        for name, value, neutral in (
            ("presence_penalty", request.presence_penalty, 0.0),
            ("frequency_penalty", request.frequency_penalty, 0.0),
            ("repetition_penalty", request.repetition_penalty, 1.0),
            ("logit_bias", logit_bias, None),
            ("allowed_token_ids", request.allowed_token_ids, None),
            ("bad_words", request.bad_words or None, None),
            ("prompt_logprobs", prompt_logprobs, None),
        ):
            if value != neutral:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except PagedKVError as exc:
            raise request_error(exc, type(request).model_fields) from exc

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The number of tokens to generate at most; 400 when the prompt and ``max_tokens`` do
        not fit in ``max_model_len`` (vLLM's rule: the request is refused, not truncated)."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = "" if max_tokens is None else f" + {max_tokens} (max_tokens)"
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{num_prompt_tokens} prompt tokens{asked}. Shorten the prompt or lower max_tokens.",
                param="max_tokens" if room >= 1 else "prompt",
                code="context_length_exceeded",
            )
        return room if max_tokens is None else max_tokens

    async def build_sampling_params(
        self,
        request: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams | BeamSearchParams:
        """:meth:`sampling_params` in a worker thread: checking a list of up to a vocabulary's
        worth of ids is CPU work the event loop should not wait on."""
        return await asyncio.to_thread(
            self.sampling_params, request, max_tokens, logprobs, prompt_logprobs, tool_constraint
        )

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as the engine would make them (in a worker thread: a long prompt
        does not stall the event loop)."""
        return await asyncio.to_thread(tokenize, self.tokenizer, text, add_special_tokens=add_special_tokens)

    async def detokenize(self, ids: list[int]) -> str:
        """``/detokenize``: the text of ``ids``. At most ``max_model_len`` ids (no sequence the
        engine reads or writes is longer: a 400 naming ``tokens`` before any is read), each in
        the vocabulary; checked and decoded in a worker thread."""
        if len(ids) > self.max_model_len:
            raise APIError(
                400, f"tokens has {len(ids)} ids, more than max_model_len = {self.max_model_len}", param="tokens"
            )
        self.check_not_empty(ids, "tokens")

        def decode() -> str:
            try:
                checked = check_token_ids(ids, self.vocab_size, "token")
            except InvalidArgumentError as exc:
                raise APIError(400, str(exc), param="tokens", code=type(exc).__name__) from None
            return str(self.tokenizer.decode(checked))

        return await asyncio.to_thread(decode)

    @staticmethod
    def check_not_empty(ids: list[int], what: str = "prompt") -> list[int]:
        """A 400 for no tokens. (A prompt's ids outside the vocabulary are refused by the
        engine's own check when the request is added: a typed error, also a 400.)"""
        if not ids:
            raise APIError(400, f"the {what} is empty (no tokens)", param=what)
        return ids

    def check_prompt_ids(self, ids: list[int]) -> list[int]:
        """A prompt given as token ids, checked here so that a bad one is a 400 naming
        ``prompt``: not empty, every id in the vocabulary."""
        try:
            return self.check_not_empty(check_token_ids(ids, self.vocab_size), "prompt")
        except InvalidArgumentError as exc:
            raise APIError(400, str(exc), param="prompt", code=type(exc).__name__) from None

    # ------------------------------------------------------------------ running requests

    async def start(
        self, request_id: str, requests: Sequence[EngineRequest], request: _SamplingFields
    ) -> RunningRequest:
        """Admit and add the engine requests, all or none: 503 over ``max_queued_requests``, a
        typed error (400) for what the engine refuses. Iterate the result for the outputs;
        :meth:`RunningRequest.close` aborts what has not finished."""
        self.check_admission(len(requests))
        if request.kv_transfer_params is not None and len(requests) > 1:
            raise APIError(400, "kv_transfer_params take a single prompt", param="kv_transfer_params")
        running = RunningRequest(self, len(requests))
        try:
            for i, r in enumerate(requests):
                rid = request_id if len(requests) == 1 else f"{request_id}-{i}"
                running.queue(i)
                running.streams.append(
                    await self.engine.add_request(
                        r.prompt,
                        r.params,
                        rid,
                        priority=request.priority,
                        cache_salt=request.cache_salt,
                        kv_transfer_params=request.kv_transfer_params,
                    )
                )
                running.trackers.append(self.metrics.start_request(rid, running.arrival))
        except BaseException as exc:
            running.close()
            if isinstance(exc, StructuredOutputError):  # its schema or grammar: name that field
                found = request.constraint()
                raise APIError(
                    400, str(exc), param=None if found is None else found[1], code=type(exc).__name__
                ) from exc
            if isinstance(exc, PagedKVError):  # refused by the engine: a 400 naming the field
                raise request_error(exc, type(request).model_fields) from exc
            raise
        return running

    def end_all(self, reason: str) -> int:
        """Fail every running API request with a 503 saying ``reason`` (the server shuts down
        and will not wait longer): its engine requests are aborted, a stream ends with an
        in-band error event and ``data: [DONE]``, a whole answer is the 503. Returns how many."""
        running = list(self.running)
        for r in running:
            r.fail(APIError(503, reason, code="server_shutting_down"))
        return len(running)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary entry:
    a byte-level entry has one character per byte, so this bounds the decoded text too)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


class RunningRequest:
    """The engine requests of one API request, from admission to the end: yields
    ``(prompt index, cumulative output)`` as they progress; records metrics; keeps
    ``OpenAIServing.num_queued``. :meth:`close` (idempotent) aborts whatever has not finished
    (blocks freed at once); every handler calls it, whatever happens to the client."""

    def __init__(self, serving: OpenAIServing, num_requests: int) -> None:
        self.serving = serving
        self.arrival = time.time()
        self.streams: list[RequestStream] = []
        self.trackers: list[RequestTracker] = []
        # queued[i]: request i counts in num_queued (from before its add until its first token).
        self.queued = [False] * num_requests
        self.closed = False
        self._unfinished_reason = "abort"
        # Set by fail(): raised to the reader instead of the outputs that follow.
        self._error: APIError | None = None
        serving.running.add(self)

    def queue(self, index: int) -> None:
        self.queued[index] = True
        self.serving.num_queued += 1

    def _dequeue(self, index: int) -> None:
        if self.queued[index]:
            self.queued[index] = False
            self.serving.num_queued -= 1

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            async for index, out in _merge(self.streams):
                if self._error is not None:
                    raise self._error
                now = time.time()
                if any(c.token_ids for c in out.outputs) or out.finished:
                    self._dequeue(index)
                self.trackers[index].on_output(out, now)
                if out.finished:
                    self.trackers[index].finish(out, now, _request_finish_reason(out))
                yield index, out
            if self._error is not None:
                raise self._error
        except RequestFailedError:
            self._unfinished_reason = "error"
            raise
        finally:
            self.close()

    def fail(self, error: APIError) -> None:
        """End the request now with ``error`` for its reader (its engine requests aborted)."""
        if not self.closed:
            self._error = error
            for stream in self.streams:
                stream.fail(error)  # wakes a reader waiting for the next output
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.serving.running.discard(self)
        for stream in self.streams:
            stream.close()  # aborts the request unless it has finished
        now = time.time()
        for tracker in self.trackers:
            tracker.finish(None, now, self._unfinished_reason)  # a no-op for finished ones
        for index in range(len(self.queued)):
            self._dequeue(index)

    async def final_outputs(self) -> list[RequestOutput]:
        """The last output of each engine request (non-streaming responses)."""
        final: dict[int, RequestOutput] = {}
        async for index, out in self:
            final[index] = out
        return [final[i] for i in sorted(final)]


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: Sequence[RequestOutput], *, generated: bool = True) -> UsageInfo:
    """Usage of a whole API request: its prompts counted once each (not once per choice).
    ``generated=False``: the generated tokens are not returned (``echo`` with ``max_tokens: 0``)
    and not counted."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _request_finish_reason(out: RequestOutput) -> str:
    """The request's outcome for ``vllm:request_success``: "error", "abort", or the first
    completion's reason (vLLM labels a request by its reason, "stop" or "length")."""
    reasons = [c.finish_reason for c in out.outputs]
    for special in ("error", "abort"):
        if special in reasons:
            return special
    return reasons[0] or "abort"


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams as their outputs come; one stream needs no tasks."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work`` unless the client disconnects first; then cancel it (aborting its engine
    requests) and return None. For non-streaming handlers: a streaming response is cancelled
    by Starlette itself when its client goes away. The request body must have been read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the request is gone; its error has no reader
                pass
        watcher.cancel()
    if task.cancelled():
        return None
    return task.result()


# JSON has no -inf: a logprob below this (a token masked out) is sent as this, as vLLM does.
MIN_LOGPROB = -9999.0


def finite_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def prompt_logprobs_body(prompt_logprobs: Sequence[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """The engine's prompt logprobs as vLLM's response field (per prompt token, the first None:
    token id -> logprob, rank, text)."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entries is None
        else {
            token_id: PromptLogprob(logprob=finite_logprob(e.logprob), rank=e.rank, decoded_token=e.decoded_token)
            for token_id, e in entries.items()
        }
        for entries in prompt_logprobs
    ]


def top_logprobs(entries: dict[int, Logprob], k: int) -> list[Logprob]:
    """The ``k`` most likely tokens at one position, best first (``entries``: one position's
    logprobs from the engine, the chosen token's among them whatever its rank)."""
    return sorted((e for e in entries.values() if e.rank is not None and e.rank <= k), key=lambda e: e.rank or 0)


class Delta(NamedTuple):
    """What a choice gained since its last chunk."""

    text: str
    first_token: int  # index in token_ids of its first new token
    first: bool  # the choice's first chunk


class StreamedChoices:
    """What each choice of a streamed request has sent, so that a chunk carries only the new
    part of the engine's cumulative output, and a choice ends with one chunk."""

    def __init__(self) -> None:
        self._text: dict[int, int] = {}  # characters of text sent, per choice
        self._tokens: dict[int, int] = {}  # tokens sent, per choice
        self._ended: set[int] = set()

    def advance(self, index: int, c: CompletionOutput) -> Delta | None:
        """The new part of choice ``index`` (now recorded as sent), or None when nothing is new
        or its end was sent already."""
        if index in self._ended:
            return None
        first = index not in self._text
        text_from, tokens_from = self._text.get(index, 0), self._tokens.get(index, 0)
        delta = c.text[text_from:]
        if not delta and len(c.token_ids) == tokens_from and c.finish_reason is None:
            return None
        self._text[index], self._tokens[index] = len(c.text), len(c.token_ids)
        if c.finish_reason is not None:
            self._ended.add(index)
        return Delta(delta, tokens_from, first)


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """``chunks`` as server-sent events, then ``data: [DONE]``. Once a stream has started its
    status is sent, so an error is reported in-band (``data: {"error": ...}``) before the end."""
    try:
        async for chunk in chunks:
            yield sse(json.dumps(chunk))
    except Exception as exc:
        err = from_exception(exc)
        yield sse(error_body(err.status, err.message, param=err.param, code=err.code).model_dump_json())
    yield sse("[DONE]")


def sse(data: str) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n"
