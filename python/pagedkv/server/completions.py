"""``POST /v1/completions``: one or several prompts, each with ``n`` choices, whole or streamed.

Choice ``index`` counts across prompts (prompt ``p``, completion ``i``: ``p * n + i``), as in
OpenAI's API. A stream sends one chunk per choice whose text or tokens advanced, its
``finish_reason`` on the chunk that ends it, an optional usage chunk, then ``data: [DONE]``.

``echo`` puts the prompt before each choice's text (in a stream, in the choice's first chunk).
With ``logprobs`` too, the legacy logprobs cover the prompt's tokens first — the first one has
no logprob (``None``), each other one its logprob given the tokens before it, from the engine's
``prompt_logprobs`` — then the generated ones (lm-eval's loglikelihood requests read these).
``max_tokens: 0`` with ``echo`` answers the prompt alone: the engine needs one token to run, so
it generates one that is dropped (``completion_tokens`` 0, ``finish_reason`` "length").
``text_offset`` counts characters of the returned text, the echoed prompt included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from pagedkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.sampling_params import SamplingParams
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
    finite_logprob,
    new_request_id,
    prompt_logprobs_body,
    sse_stream,
    top_logprobs,
    usage,
)

__all__ = ["create_completion"]


async def create_completion(serving: OpenAIServing, request: CompletionRequest, raw: Request) -> Response:
    serving.check_request(request)
    prompts = _prompts(serving, request)  # counted and sized before any is tokenized
    # echo with max_tokens 0: one token is generated (the engine's minimum) and dropped.
    max_tokens = 1 if request.echo_only else request.max_tokens
    shared = None
    if not request.use_beam_search:
        # One SamplingParams for every prompt (max_tokens None: each prompt's room, which the
        # engine computes as check_length does): its lists are checked, and the engine's mask
        # and tokenized bad words built, once per API request, not once per prompt.
        shared = await serving.build_sampling_params(
            request, max_tokens, request.logprobs, request.engine_prompt_logprobs
        )
    engine_requests = [await _engine_request(serving, request, p, max_tokens, shared) for p in prompts]
    request_id = new_request_id("cmpl")
    # Under the disconnect watch: a client that leaves while its grammar waits to compile
    # takes that compile with it (dropped if nobody else waits for it).
    running = await cancel_on_disconnect(raw, serving.start(request_id, engine_requests, request))
    if running is None:  # the client is gone: nothing of the request is left
        return Response(status_code=499)
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
        for c in out.outputs:
            text, logprobs = _piece(serving, request, engine_requests[p], out, c, c.text, 0, first=True, offset=0)
            finish_reason, stop_reason = _finish(request, c)
            choices.append(
                CompletionChoice(
                    index=p * request.n + c.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs)
                    if request.prompt_logprobs is not None
                    else None,
                )
            )
    body = CompletionResponse(
        id=request_id,
        model=serving.model_name,
        choices=choices,
        usage=usage(outputs, generated=not request.echo_only),
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


async def _engine_request(
    serving: OpenAIServing,
    request: CompletionRequest,
    prompt: str | list[int],
    max_tokens: int | None,
    shared: SamplingParams | BeamSearchParams | None,
) -> EngineRequest:
    """One prompt's engine request: tokenized, its length checked; ``shared``: the request's
    SamplingParams (None: a beam search, whose params need the prompt's room)."""
    if isinstance(prompt, str):
        ids = serving.check_not_empty(await serving.tokenize(prompt))
        text: str | None = prompt
    else:
        ids = serving.check_prompt_ids(prompt)
        text = None
    room = serving.check_length(len(ids), max_tokens)
    if shared is None:
        shared = serving.sampling_params(request, room, request.logprobs, request.engine_prompt_logprobs)
    elif request.min_tokens > room:  # SamplingParams checks it only against a given max_tokens
        raise APIError(
            400,
            f"min_tokens = {request.min_tokens} is more than the {room} tokens this prompt leaves room for",
            param="min_tokens",
        )
    return EngineRequest({"prompt": text, "prompt_token_ids": ids}, shared)


def _echo_text(serving: OpenAIServing, r: EngineRequest) -> str:
    text = r.prompt["prompt"]
    return text if text is not None else serving.tokenizer.decode(r.prompt["prompt_token_ids"])


def _finish(request: CompletionRequest, c: CompletionOutput) -> tuple[str | None, int | str | None]:
    """``(finish_reason, stop_reason)`` of a choice: with ``echo`` and ``max_tokens: 0`` the
    answer ends at the prompt, at the length asked for, whatever ended the dropped token."""
    if request.echo_only and c.finish_reason is not None:
        return "length", None
    return c.finish_reason, c.stop_reason


# One position of the legacy logprobs: its token id and the engine's logprobs there (None for
# the prompt's first token, which has nothing before it).
Position = tuple[int, dict[int, Logprob] | None]


def _piece(
    serving: OpenAIServing,
    request: CompletionRequest,
    r: EngineRequest,
    out: RequestOutput,
    c: CompletionOutput,
    text: str,
    first_token: int,
    *,
    first: bool,
    offset: int,
) -> tuple[str, CompletionLogprobs | None]:
    """The text and logprobs of choice ``c`` to send: its new ``text`` and tokens from
    ``first_token`` on, the echoed prompt before them in the choice's ``first`` piece.
    ``offset`` is the text offset of the piece's first token."""
    if request.echo_only:  # the one generated token is not returned
        text, first_token = "", len(c.token_ids)
    positions: list[Position] = []
    if first and request.echo:
        text = _echo_text(serving, r) + text
        if request.logprobs is not None:
            positions = _prompt_positions(out)
    if request.logprobs is None:
        return text, None
    if c.logprobs is not None:
        positions += zip(c.token_ids[first_token:], c.logprobs[first_token:])
    return text, _legacy_logprobs(serving, positions, request.logprobs, offset)


def _prompt_positions(out: RequestOutput) -> list[Position]:
    """The prompt's tokens with their logprobs (vLLM's layout: the first entry None)."""
    ids, entries = out.prompt_token_ids, out.prompt_logprobs
    if entries is None or len(entries) != len(ids):
        raise APIError(500, "the engine returned no prompt logprobs for an echo request with logprobs")
    return list(zip(ids, entries))


def _legacy_logprobs(serving: OpenAIServing, positions: list[Position], k: int, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs of ``positions``: each token's text and logprob, the ``k`` most
    likely tokens there, and its offset in the text (counting from ``offset``)."""
    out = CompletionLogprobs()
    for token_id, entries in positions:
        chosen = None if entries is None else entries[token_id]
        text = chosen.decoded_token if chosen is not None else None
        if text is None:
            text = serving.tokenizer.decode([token_id])
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entries is None or chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(finite_logprob(chosen.logprob))
            out.top_logprobs.append(
                {e.decoded_token or "": finite_logprob(e.logprob) for e in top_logprobs(entries, k)}
            )
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
            text, logprobs = _piece(
                serving,
                request,
                engine_requests[p],
                out,
                c,
                delta.text,
                delta.first_token,
                first=delta.first,
                offset=offsets.get(index, 0),
            )
            if logprobs is not None and logprobs.text_offset:
                offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            finish_reason, stop_reason = _finish(request, c)
            chunk = {
                **base,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": None if logprobs is None else logprobs.model_dump(),
                        "finish_reason": finish_reason,
                        "stop_reason": stop_reason,
                    }
                ],
            }
            if options is not None and options.continuous_usage_stats:
                chunk["usage"] = usage(list(last.values()), generated=not request.echo_only).model_dump()
            yield chunk
    if options is not None and options.include_usage:
        yield {**base, "choices": [], "usage": usage(list(last.values()), generated=not request.echo_only).model_dump()}
