"""OpenAI's request and response schemas (pydantic), with vLLM's extra sampling fields.

Requests are lenient where vLLM is and strict where it matters:

- An unknown field is accepted and ignored, as vLLM does (clients send their own extras; a 400
  on a harmless field would be an outage for them); each unknown name is logged once.
- ``null`` for a field that has a non-null default means the default (OpenAI's clients send
  ``"seed": null``, ``"n": null`` for "not set").
- Known fields keep strict types: a value of the wrong type is a 400 naming it, and values are
  not coerced (``"5"`` is not an int, ``1`` is not a bool; an int is a float).
- Known fields set to something pagedkv does not implement (``suffix``, ``best_of != n``,
  ``tools``, ...) are a 400 naming the field, so a client never gets output that ignored what
  it asked for.

Responses follow OpenAI's shapes (every one names its ``object``), plus vLLM's additions
clients already read: ``stop_reason`` on a choice, ``prompt_tokens_details.cached_tokens``
(prefix-cache hits) in ``usage``, ``prompt_logprobs`` (vLLM's layout) when asked for.
"""

from __future__ import annotations

import functools
import logging
import re
import time
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedkv.errors import ConfigError
from pagedkv.sample.sampling_params import check_structured_outputs
from pagedkv.structured.params import StructuredOutputsParams

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "ErrorResponse",
    "StreamOptions",
    "TokenizeRequest",
    "UsageInfo",
]


logger = logging.getLogger(__name__)

# A logit_bias key: a token id in decimal (the engine checks it is in the vocabulary).
_TOKEN_ID = re.compile(r"-?[0-9]{1,19}")

# Unknown request field names already logged (each once). Bounded: a client inventing a new
# name per request must not grow the server's memory; past the bound they are not logged.
_LOGGED_UNKNOWN_FIELDS: set[str] = set()
_MAX_LOGGED_UNKNOWN_FIELDS = 256


def _log_unknown_field(model: str, name: str) -> None:
    name = name[:100]
    if name in _LOGGED_UNKNOWN_FIELDS or len(_LOGGED_UNKNOWN_FIELDS) >= _MAX_LOGGED_UNKNOWN_FIELDS:
        return
    _LOGGED_UNKNOWN_FIELDS.add(name)
    logger.warning("ignoring the unknown request field %r (in %s; logged once per name)", name, model)


def _nullable(annotation: Any) -> bool:
    """Whether a field's type admits None (``X | None``, ``Optional[X]``, ``Any``)."""
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)


@functools.cache
def _not_nullable_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` whose type does not admit None (``null`` means their default)."""
    return frozenset(name for name, f in model.model_fields.items() if not _nullable(f.annotation))


class _Strict(BaseModel):
    """A request body: unknown fields ignored (logged once per name), ``null`` for a
    non-nullable field taken as "not given", known fields' values not coerced (``"5"`` is not
    an int, ``1`` is not a bool; an int is a float): see the module docs."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # the model's own validation names the error
        fields, not_nullable = cls.model_fields, _not_nullable_fields(cls)
        kept = {}
        for name, value in data.items():
            if name not in fields:
                _log_unknown_field(cls.__name__, str(name))
            elif not (value is None and name in not_nullable):
                kept[name] = value
        return kept


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
    # Penalties and biases (vLLM's semantics; the engine checks their ranges: ConfigError, 400).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # JSON keys are strings: each must be a token id (an int); the engine checks the
    # vocabulary and clamps the values to [-100, 100].
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
    repetition_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's prompt logprobs: the top-k at each prompt position (not with stream=true).
    prompt_logprobs: int | None = Field(default=None, ge=0)
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
    # Structured outputs: OpenAI's response_format ({"type": "json_object"} or "json_schema"),
    # vLLM's structured_outputs ({json, regex, choice, grammar, json_object,
    # disable_any_whitespace}), or vLLM's older guided_* fields; at most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """The request's structured-output constraint and the field that set it (None when
        unconstrained); a ValueError naming the problem for a malformed one (the handler's 400
        names that field)."""
        given: list[tuple[str, dict[str, Any]]] = []
        response_format = self.response_format
        if response_format is not None:
            kind = response_format.get("type")
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = response_format.get("json_schema")
                if not isinstance(spec, dict) or "schema" not in spec:
                    raise ConstraintError(
                        "response_format",
                        "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                    )
                given.append(("response_format", {"json": spec["schema"]}))
            elif kind != "text":
                raise ConstraintError(
                    "response_format",
                    f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                )
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                given.append((name, {key: value}))
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise ConstraintError(given[1][0], f"give one structured-output constraint, not several ({names})")
        name, fields = given[0]
        try:
            return check_structured_outputs(fields), name  # type: ignore[return-value]
        except ConfigError as exc:
            raise ConstraintError(name, str(exc)) from None

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` of the first field set to something pagedkv does not implement."""
        if self.use_beam_search:
            for name, value, default in (
                ("stream", self.stream, False),
                ("stop", self.stop or None, None),
                ("min_tokens", self.min_tokens, 0),
                ("kv_transfer_params", self.kv_transfer_params, None),
                ("presence_penalty", self.presence_penalty, 0.0),
                ("frequency_penalty", self.frequency_penalty, 0.0),
                ("repetition_penalty", self.repetition_penalty, 1.0),
                ("logit_bias", self.logit_bias or None, None),
                ("allowed_token_ids", self.allowed_token_ids, None),
                ("bad_words", self.bad_words or None, None),
                ("prompt_logprobs", self.prompt_logprobs, None),
            ):
                if value != default:
                    return name, f"{name} is not supported with use_beam_search (beam search answers once, whole)"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs are not available with stream=true (as in vLLM)"
        return None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with its JSON keys parsed as token ids; a key that is not an integer
        is a ValueError naming it (the handler's 400 names ``logit_bias``)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids (integers), got {key[:40]!r}")
            out[int(key)] = value
        return out


class ConstraintError(ValueError):
    """A malformed structured-output constraint; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids,
    or a list of lists of token ids (one choice set per prompt, ``index`` counting across)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo (the prompt alone, as vLLM answers lm-eval's loglikelihood requests).
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    # The prompt before each completion; with logprobs, the prompt tokens' logprobs too.
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (only best_of = n)"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens must be at least 1 (0 only with echo: the prompt alone)"
        if self.use_beam_search and self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs is not supported with use_beam_search"
        return super().unsupported()

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt alone (the engine runs one
        token, which is dropped)."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The engine's ``prompt_logprobs``: ``prompt_logprobs``, and with ``echo`` the
        ``logprobs`` of the echoed prompt tokens (the larger of the two when both are set)."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None


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
    # vLLM's chat extras.
    chat_template: str | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> tuple[str, str] | None:
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


class PromptLogprob(_Response):
    """vLLM's Logprob in ``prompt_logprobs``: one token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs layout: per prompt token (the first None), token id -> its Logprob.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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
    # OpenAI's [{"id", "type": "function", "function": {"name", "arguments"}}] (tool calling).
    tool_calls: list[dict[str, Any]] | None = None


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
    prompt_logprobs: PromptLogprobs | None = None
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
