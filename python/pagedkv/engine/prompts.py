"""Prompt inputs: text, token ids, or vLLM-style dicts, turned into validated token ids."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError, InvalidTokenError, InvalidTypeError

__all__ = ["PromptType", "chat_prompt", "check_text", "check_token_ids", "is_single_prompt", "to_token_ids", "tokenize"]

# A text prompt, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]} (with an
# optional "prompt" text kept for the output).
PromptType = str | Sequence[int] | dict[str, Any]


def is_single_prompt(prompts: Any) -> bool:
    """True for one prompt (text, dict, or a flat list of ints), False for a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if isinstance(prompts, Sequence) and len(prompts) > 0:
        return all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts)
    return False


def to_token_ids(prompt: PromptType, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt; ids checked against ``vocab_size``."""
    text: str | None
    if isinstance(prompt, str):
        text = prompt
        ids = tokenize(tokenizer, prompt)
    elif isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InvalidTypeError(f"a dict prompt's 'prompt' must be a str, got {type(text).__name__}")
            ids = check_token_ids(prompt["prompt_token_ids"], vocab_size)
        elif "prompt" in prompt and isinstance(prompt["prompt"], str):
            text = prompt["prompt"]
            ids = tokenize(tokenizer, text)
        else:
            raise InvalidArgumentError("a dict prompt needs 'prompt' (str) or 'prompt_token_ids' (list of ints)")
    elif isinstance(prompt, (Sequence, np.ndarray)) and not isinstance(prompt, bytes):
        text = None
        ids = check_token_ids(prompt, vocab_size)
    else:
        raise InvalidTypeError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
    if not ids:
        raise InvalidArgumentError("the prompt is empty (no tokens)")
    return text, ids


def check_text(text: str, what: str = "the prompt") -> str:
    """``text`` if it is valid Unicode that UTF-8 can encode; else InvalidArgumentError.

    JSON allows lone surrogates (``"\\ud800"``) that Python keeps in a ``str`` but no tokenizer
    (nor any UTF-8 encoder) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{what} is not valid Unicode: {exc.reason} at character {exc.start} ({text[exc.start : exc.end]!r})"
        ) from None
    return text


def tokenize(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` (checked to be valid Unicode first: :func:`check_text`)."""
    return list(tokenizer(check_text(text), add_special_tokens=add_special_tokens).input_ids)


def check_token_ids(ids: Any, vocab_size: int, what: str = "prompt token") -> list[int]:
    """``ids`` as a list of ints, each in ``[0, vocab_size)``; InvalidTypeError for a non-int,
    InvalidTokenError for an id outside the vocabulary (``what`` names them in the message)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise InvalidTypeError(f"{what} ids must be a list of ints, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(list(ids)):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise InvalidTypeError(f"{what} {i} is {type(t).__name__}, not an int")
        if not 0 <= int(t) < vocab_size:
            raise InvalidTokenError(f"{what} id {int(t)} at index {i} is outside the vocabulary [0, {vocab_size})")
        out.append(int(t))
    return out


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    render: Callable[[list[dict[str, Any]]], str] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One conversation rendered with the chat template, as ``{"prompt", "prompt_token_ids"}``.

    The rendered text already holds the template's special tokens, so it is tokenized without
    adding any (no second BOS). A message's ``content`` is a str or, as in OpenAI's API, a list
    of ``{"type": "text", "text": ...}`` parts (joined with newlines). ``render``, when given,
    renders the normalized messages instead of the tokenizer (a server renders a client's
    template in a bounded sandbox this way). ``tools``: OpenAI-style function definitions for a
    template that renders them (transformers' ``apply_chat_template(tools=...)``)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidArgumentError("a conversation is a non-empty list of dicts with 'role' and 'content'")
    normalized = [_normalize_message(i, m) for i, m in enumerate(messages)]
    if render is not None:
        text = render(normalized)
        return {"prompt": text, "prompt_token_ids": tokenize(tokenizer, text, add_special_tokens=False)}
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidArgumentError("the tokenizer has no chat template; pass chat_template=...")
    try:
        extra = {} if tools is None else {"tools": tools}
        text = tokenizer.apply_chat_template(
            normalized,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **extra,
        )
    except Exception as exc:  # the template's own checks (role order, ...) or a Jinja error
        raise InvalidArgumentError(f"the chat template cannot render this conversation: {exc}") from exc
    return {"prompt": text, "prompt_token_ids": tokenize(tokenizer, text, add_special_tokens=False)}


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise InvalidArgumentError(f"message {index} must be a dict with 'role' and 'content', got {message!r}")
    role, content = message["role"], message["content"]
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""  # OpenAI's assistant turn that only calls tools
    if not isinstance(role, str):
        raise InvalidTypeError(f"message {index}: 'role' must be a str, got {type(role).__name__}")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidArgumentError(
                    f"message {index}: content parts must be {{'type': 'text', 'text': str}}, got {part!r}"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise InvalidTypeError(
            f"message {index}: 'content' must be a str or a list of text parts, got {type(content).__name__}"
        )
    return {**message, "content": check_text(content, f"message {index}'s content")}
