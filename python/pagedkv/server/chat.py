"""``POST /v1/chat/completions``: the conversation is rendered with the tokenizer's chat
template, then generated like a completion.

A request's own ``chat_template`` is a 400 unless the server trusts request templates
(``--trust-request-chat-template``); then it is rendered in a bounded sandbox
(pagedkv.server.chat_template) that stops when the client leaves. Either way every character
the conversation carries into the template is counted against ``max_prompt_chars`` before
anything is rendered (:func:`conversation_chars`: message contents, tool calls' names and
arguments, tool results, any other field a message carries, and the tools' names,
descriptions and parameter schemas).

A stream sends, per choice, a first chunk with ``delta.role = "assistant"``, content deltas,
and ``finish_reason`` on the chunk that ends it; then an optional usage chunk and
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.prompts import chat_prompt
from pagedkv.errors import InvalidArgumentError
from pagedkv.server.chat_template import render_request_template
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    TokenLogprob,
    TopLogprob,
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
from pagedkv.server.tools import (
    HermesToolParser,
    ToolError,
    ToolRequest,
    render_without_tool_template,
    template_knows_tools,
    tool_request,
)

__all__ = ["conversation_chars", "create_chat_completion", "render_chat"]


async def render_chat(
    serving: OpenAIServing,
    messages: list[ChatMessage],
    raw: Request,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: ToolRequest | None = None,
) -> dict[str, Any] | None:
    """``{"prompt", "prompt_token_ids"}`` of a conversation (in a worker thread: templates and
    tokenizers are CPU work), or None when the client left first. A conversation the template
    refuses (or a content part that is not text) is a 400 naming ``messages``; a request
    template the server does not trust, or messages and tools over ``max_prompt_chars``
    (:func:`conversation_chars`), a 400 before anything is rendered."""
    limit = serving.max_prompt_chars
    dicts = [m.model_dump(exclude_none=True) for m in messages]
    what = "the text of the messages (contents, tool calls and their arguments, tool results, other fields)"
    serving.check_prompt_chars(conversation_chars(dicts, None, limit), "messages", what=what)
    if tools is not None and tools.active:
        num_chars = conversation_chars(dicts, [t.as_openai() for t in tools.tools], limit)
        serving.check_prompt_chars(num_chars, "tools", what=what + " with the tools (names, descriptions, schemas)")
    if chat_template is not None and not serving.limits.trust_request_chat_template:
        raise APIError(
            400,
            "this server does not accept a chat_template in requests (its operator can allow it with "
            "--trust-request-chat-template)",
            param="chat_template",
        )
    dicts = [{**d, "content": d.get("content") if d.get("content") is not None else ""} for d in dicts]
    # Tools: passed to a template that renders them; otherwise written into the conversation in
    # the hermes convention (pagedkv.server.tools), earlier calls and tool results included
    # (in the worker thread: it parses and writes the calls' arguments as JSON).
    template_tools = None
    hermes = not template_knows_tools(chat_template or getattr(serving.tokenizer, "chat_template", None))
    if not hermes:
        template_tools = [t.as_openai() for t in tools.tools] if tools is not None and tools.active else None
    cancel = threading.Event()  # set when the client leaves: a request template stops rendering
    render = None
    if chat_template is not None:
        variables = {**_special_tokens(serving.tokenizer), "add_generation_prompt": add_generation_prompt}
        if template_tools is not None:
            variables["tools"] = template_tools
        render = functools.partial(
            _render_request_template,
            chat_template,
            variables,
            max_size=serving.max_prompt_chars,
            timeout=serving.limits.chat_template_timeout,
            cancel=cancel,
        )

    def prompt() -> dict[str, Any]:
        conversation = render_without_tool_template(dicts, tools) if hermes else dicts
        return chat_prompt(
            serving.tokenizer,
            conversation,
            add_generation_prompt=add_generation_prompt,
            render=render,
            tools=template_tools,
        )

    async def work() -> dict[str, Any]:
        try:
            return await asyncio.to_thread(prompt)
        except InvalidArgumentError as exc:  # a message the template or its checks refuse
            raise APIError(400, str(exc), param="messages", code=type(exc).__name__) from None
        finally:
            cancel.set()  # done, or cancelled: a render still running stops at its next line

    return await cancel_on_disconnect(raw, work())


def _render_request_template(
    source: str, variables: dict[str, Any], messages: list[dict[str, Any]], **limits: Any
) -> str:
    return render_request_template(source, {**variables, "messages": messages}, **limits)


def conversation_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, limit: int) -> int:
    """The characters a conversation brings to its chat template, counted up to just past
    ``limit`` (then the count stops: the request is refused anyway, and a 12 MB body costs no
    more than a 12 KB one to refuse).

    Counted: every string a message carries, at any depth, but its own field names and its
    ``role`` (its content or text parts, ``tool_calls[].function.name`` and ``.arguments``,
    a ``tool`` message's result and ``tool_call_id``, ``name``, any other field, which
    templates may render), the keys of the objects inside it (``arguments`` or a part given as
    an object is rendered as JSON), one character per number, bool or null, and for ``tools``
    every key and string of their entries (names, descriptions, parameter schemas: rendered as
    JSON). Iterative, so nesting depth costs no stack."""
    total = 0
    stack: list[Any] = []
    for message in messages:
        stack.extend(value for key, value in message.items() if key != "role")
    if tools:
        stack.extend(tools)
    while stack and total <= limit:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                total += len(key) if isinstance(key, str) else 1
                stack.append(item)
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        else:
            total += 1
    return total


def _special_tokens(tokenizer: Any) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as transformers passes them to a chat template."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {name: value for name, value in tokens.items() if isinstance(value, str)}


async def create_chat_completion(serving: OpenAIServing, request: ChatCompletionRequest, raw: Request) -> Response:
    serving.check_request(request)
    try:
        tools = tool_request(request.tools, request.tool_choice, request.parallel_tool_calls)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    serving.check_admission(1)
    prompt = await render_chat(
        serving,
        request.messages,
        raw,
        chat_template=request.chat_template,
        add_generation_prompt=request.add_generation_prompt,
        tools=tools,
    )
    if prompt is None:  # the client is gone: nobody reads this
        return Response(status_code=499)
    ids = serving.check_not_empty(prompt["prompt_token_ids"])
    max_tokens = serving.check_length(len(ids), request.output_limit)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    tool_constraint = None if tools is None else tools.constraint()
    engine_request = EngineRequest(
        prompt,
        await serving.build_sampling_params(request, max_tokens, logprobs, request.prompt_logprobs, tool_constraint),
    )
    parse_calls = tools is not None and tools.active
    request_id = new_request_id("chatcmpl")
    # Under the disconnect watch: a client that leaves while its grammar waits to compile
    # takes that compile with it (dropped if nobody else waits for it).
    running = await cancel_on_disconnect(raw, serving.start(request_id, [engine_request], request))
    if running is None:  # the client is gone: nothing of the request is left
        return Response(status_code=499)
    if request.stream:
        return StreamingResponse(
            sse_stream(_chunks(serving, request, request_id, running, tools if parse_calls else None)),
            media_type="text/event-stream",
            background=BackgroundTask(running.close),  # also when the stream never started
        )
    outputs = await cancel_on_disconnect(raw, running.final_outputs())
    if outputs is None:  # the client is gone: nobody reads this
        return Response(status_code=499)
    out = outputs[0]
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=_logprobs(c, 0, logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    if parse_calls:
        assert tools is not None
        for choice in choices:
            content, calls = HermesToolParser(max_calls=tools.max_calls).parse(choice.message.content or "")
            if calls:
                choice.message = AssistantMessage(content=content, tool_calls=[c.as_openai() for c in calls])
                if choice.finish_reason == "stop":
                    choice.finish_reason = "tool_calls"
    body = ChatCompletionResponse(
        id=request_id,
        model=serving.model_name,
        choices=choices,
        usage=usage(outputs),
        prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs) if request.prompt_logprobs is not None else None,
        kv_transfer_params=out.kv_transfer_params,
    )
    return JSONResponse(body.model_dump())


def _logprobs(c: CompletionOutput, start: int, k: int | None) -> ChatLogprobs | None:
    """OpenAI's chat logprobs of ``c``'s tokens from ``start`` on, with the ``k`` most likely
    tokens at each position."""
    if k is None or c.logprobs is None:
        return None
    content = []
    for i in range(start, len(c.logprobs)):
        entries = c.logprobs[i]
        chosen = entries[c.token_ids[i]]
        content.append(
            TokenLogprob(
                token=chosen.decoded_token or "",
                logprob=finite_logprob(chosen.logprob),
                bytes=list((chosen.decoded_token or "").encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=e.decoded_token or "",
                        logprob=finite_logprob(e.logprob),
                        bytes=list((e.decoded_token or "").encode()),
                    )
                    for e in top_logprobs(entries, k)
                ],
            )
        )
    return ChatLogprobs(content=content)


async def _chunks(
    serving: OpenAIServing,
    request: ChatCompletionRequest,
    request_id: str,
    running: RunningRequest,
    tools: ToolRequest | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks. With ``tools`` each choice's text goes through a HermesToolParser:
    content deltas, then per call its header and argument fragments (OpenAI's deltas); a choice
    that made calls ends with ``finish_reason: "tool_calls"``."""
    parsers: dict[int, HermesToolParser] = {}
    options = request.stream_options
    k = (request.top_logprobs or 0) if request.logprobs else None
    choices = StreamedChoices()
    last: RequestOutput | None = None
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(running.arrival),
        "model": serving.model_name,
    }

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {**base, "choices": [choice]}
        if options is not None and options.continuous_usage_stats and last is not None:
            body["usage"] = usage([last]).model_dump()
        return body

    async for _, out in running:
        last = out
        for c in out.outputs:
            delta = choices.advance(c.index, c)
            if delta is None:
                continue
            if delta.first:  # OpenAI's first chunk of a choice carries the role
                yield chunk(
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            logprobs = _logprobs(c, delta.first_token, k)
            if tools is not None:
                parser = parsers.setdefault(c.index, HermesToolParser(max_calls=tools.max_calls))
                pieces = parser.feed(delta.text)
                if c.finish_reason is not None:
                    pieces += parser.finish()
                for piece in pieces:
                    yield chunk({"index": c.index, "delta": piece, "logprobs": None, "finish_reason": None})
                if c.finish_reason is None:
                    continue
                reason = "tool_calls" if parser.calls and c.finish_reason == "stop" else c.finish_reason
                yield chunk(
                    {
                        "index": c.index,
                        "delta": {},
                        "logprobs": None if logprobs is None else logprobs.model_dump(),
                        "finish_reason": reason,
                        "stop_reason": c.stop_reason,
                    }
                )
                continue
            yield chunk(
                {
                    "index": c.index,
                    "delta": {"content": delta.text},
                    "logprobs": None if logprobs is None else logprobs.model_dump(),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    if options is not None and options.include_usage and last is not None:
        yield {**base, "choices": [], "usage": usage([last]).model_dump()}
