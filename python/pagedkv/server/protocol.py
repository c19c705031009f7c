"""OpenAI's request and response schemas (pydantic), with vLLM's extra sampling fields.

Requests are strict: a field of the wrong type or an unknown field is a 400 naming it (a typo
such as ``max_token`` never silently falls back to a default). Fields OpenAI defines that
pagedkv does not implement are accepted only at their neutral value (``presence_penalty=0``,
no ``tools``, ...) and refused otherwise, so a client never gets output that ignored what it
asked for.

Responses follow OpenAI's shapes, plus vLLM's additions clients already read: ``stop_reason``
on a choice, ``prompt_tokens_details.cached_tokens`` (prefix-cache hits) in ``usage``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "ErrorResponse",
    "StreamOptions",
    "TokenizeRequest",
    "UsageInfo",
]


class _Strict(BaseModel):
    """Unknown request fields are errors, and values are not coerced (``"5"`` is not an int,
    ``1`` is not a bool; an int is a float): see the module docs."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----------------------------------------------------------------------------- errors


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # always a string here (see pagedkv.server.errors)


class ErrorResponse(_Response):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ----------------------------------------------------------------------------- requests


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension: usage on every chunk, not only in a final one.
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters (the openai client sends them through extra_body).
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    # pagedkv's retention hints for the prompt's cached blocks (see SamplingParams).
    retention_priority: int | None = None
    retention_duration: float | None = None
    retention_tokens: int | None = None
    # Disaggregated prefill / decode (vLLM's field): {"do_remote_decode": true} on a KV
    # producer, or a producer's answer on a consumer (checked by the engine).
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's beam search: `n` is the beam width, every choice a beam, best first.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` of the first field set to something pagedkv does not implement."""
        if self.use_beam_search:
            for name, value, default in (
                ("stream", self.stream, False),
                ("stop", self.stop or None, None),
                ("min_tokens", self.min_tokens, 0),
                ("kv_transfer_params", self.kv_transfer_params, None),
            ):
                if value != default:
                    return name, f"{name} is not supported with use_beam_search (beam search answers once, whole)"
        if self.presence_penalty != 0.0:
            return "presence_penalty", "presence_penalty is not supported (only 0)"
        if self.frequency_penalty != 0.0:
            return "frequency_penalty", "frequency_penalty is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids,
    or a list of lists of token ids (one choice set per prompt, ``index`` counting across)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (only best_of = n)"
        if self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs (prompt logprobs) is not supported"
        return super().unsupported()


class ChatMessage(BaseModel):
    """One message. Content is a string or OpenAI's list of ``{"type": "text", "text"}`` parts;
    other fields (``name``, ...) are passed to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's chat extras.
    chat_template: str | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool_choice is not supported"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", "only response_format {'type': 'text'} is supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        return super().unsupported()

    @property
    def output_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) or else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (rendered with the template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """The legacy completions logprobs layout: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # Where a do_remote_decode request's KV is held (a KV producer's answer), else None.
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
