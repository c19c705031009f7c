"""``POST /v1/completions``: one or several prompts, each with ``n`` choices, whole or streamed.

Choice ``index`` counts across prompts (prompt ``p``, completion ``i``: ``p * n + i``), as in
OpenAI's API. A stream sends one chunk per choice whose text or tokens advanced, its
``finish_reason`` on the chunk that ends it, an optional usage chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedkv.server.serving import (
    EngineRequest,
    OpenAIServing,
    RunningRequest,
    StreamedChoices,
    cancel_on_disconnect,
    new_request_id,
    sse_stream,
    top_logprobs,
    usage,
)

__all__ = ["create_completion"]


async def create_completion(serving: OpenAIServing, request: CompletionRequest, raw: Request) -> Response:
    serving.check_request(request)
    prompts = _prompts(serving, request)  # counted and sized before any is tokenized
    engine_requests = [await _engine_request(serving, request, p) for p in prompts]
    request_id = new_request_id("cmpl")
    running = await serving.start(request_id, engine_requests, request)
    if request.stream:
        return StreamingResponse(
            sse_stream(_chunks(serving, request, request_id, engine_requests, running)),
            media_type="text/event-stream",
            background=BackgroundTask(running.close),  # also when the stream never started
        )
    outputs = await cancel_on_disconnect(raw, running.final_outputs())
    if outputs is None:  # the client is gone: nobody reads this
        return Response(status_code=499)
    choices = []
    for p, out in enumerate(outputs):
        echo = _echo_text(serving, request, engine_requests[p])
        for c in out.outputs:
            choices.append(
                CompletionChoice(
                    index=p * request.n + c.index,
                    text=echo + c.text,
                    logprobs=_logprobs(c, 0, request.logprobs),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    body = CompletionResponse(
        id=request_id,
        model=serving.model_name,
        choices=choices,
        usage=usage(outputs),
        kv_transfer_params=outputs[0].kv_transfer_params,
    )
    return JSONResponse(body.model_dump())


def _prompts(serving: OpenAIServing, request: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts (one text, texts, one token list, or token lists), checked before
    any work: their number (``max_prompts_per_request``, then room under
    ``max_queued_requests``) and each text's characters (``max_prompt_chars``)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    limit = serving.limits.max_prompts_per_request
    if len(prompts) > limit:
        raise APIError(
            400, f"the request has {len(prompts)} prompts, more than max_prompts_per_request = {limit}", param="prompt"
        )
    serving.check_admission(len(prompts))
    for p in prompts:
        if isinstance(p, str):
            serving.check_prompt_chars(len(p))
    return prompts


async def _engine_request(serving: OpenAIServing, request: CompletionRequest, prompt: str | list[int]) -> EngineRequest:
    if isinstance(prompt, str):
        ids = serving.check_not_empty(await serving.tokenize(prompt))
        text: str | None = prompt
    else:
        ids = serving.check_not_empty(list(prompt))
        text = None
    max_tokens = serving.check_length(len(ids), request.max_tokens)
    params = serving.sampling_params(request, max_tokens, request.logprobs)
    return EngineRequest({"prompt": text, "prompt_token_ids": ids}, params)


def _echo_text(serving: OpenAIServing, request: CompletionRequest, r: EngineRequest) -> str:
    if not request.echo:
        return ""
    text = r.prompt["prompt"]
    return text if text is not None else serving.tokenizer.decode(r.prompt["prompt_token_ids"])


def _logprobs(c: CompletionOutput, start: int, k: int | None, offset: int = 0) -> CompletionLogprobs | None:
    """OpenAI's legacy logprobs for ``c``'s tokens from ``start`` on: the chosen token's
    logprob and the ``k`` most likely tokens at each position. Text offsets count from the
    start of the completion's text; ``offset`` is that of token ``start``."""
    if k is None or c.logprobs is None:
        return None
    out = CompletionLogprobs()
    for i in range(start, len(c.logprobs)):
        entries = c.logprobs[i]
        chosen = entries[c.token_ids[i]]
        text = chosen.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob)
        out.text_offset.append(offset)
        offset += len(text)
        out.top_logprobs.append({e.decoded_token or "": e.logprob for e in top_logprobs(entries, k)})
    return out


async def _chunks(
    serving: OpenAIServing,
    request: CompletionRequest,
    request_id: str,
    engine_requests: list[EngineRequest],
    running: RunningRequest,
) -> AsyncIterator[dict[str, Any]]:
    options = request.stream_options
    choices = StreamedChoices()
    # Per choice: the text offset of its next token's logprobs (so each chunk's offsets
    # continue the previous chunk's without re-reading the tokens already sent).
    offsets: dict[int, int] = {}
    last: dict[int, RequestOutput] = {}
    base = {"id": request_id, "object": "text_completion", "created": int(running.arrival), "model": serving.model_name}
    async for p, out in running:
        last[p] = out
        for c in out.outputs:
            index = p * request.n + c.index
            delta = choices.advance(index, c)
            if delta is None:
                continue
            text = delta.text
            if delta.first:
                text = _echo_text(serving, request, engine_requests[p]) + text
            logprobs = _logprobs(c, delta.first_token, request.logprobs, offsets.get(index, 0))
            if logprobs is not None and logprobs.text_offset:
                offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            chunk = {
                **base,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": None if logprobs is None else logprobs.model_dump(),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                ],
            }
            if options is not None and options.continuous_usage_stats:
                chunk["usage"] = usage(list(last.values())).model_dump()
            yield chunk
    if options is not None and options.include_usage:
        yield {**base, "choices": [], "usage": usage(list(last.values())).model_dump()}
