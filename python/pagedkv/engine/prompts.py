"""Prompt inputs: text, token ids, or vLLM-style dicts, turned into validated token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import numpy as np

from pagedkv.errors import InvalidArgumentError, InvalidTokenError, InvalidTypeError

__all__ = ["PromptType", "chat_prompt", "is_single_prompt", "to_token_ids"]

# A text prompt, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]} (with an
# optional "prompt" text kept for the output).
PromptType = Union[str, Sequence[int], dict]


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
        ids = list(tokenizer(prompt).input_ids)
    elif isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            ids = _check_ids(prompt["prompt_token_ids"], vocab_size)
        elif "prompt" in prompt and isinstance(prompt["prompt"], str):
            text = prompt["prompt"]
            ids = list(tokenizer(text).input_ids)
        else:
            raise InvalidArgumentError("a dict prompt needs 'prompt' (str) or 'prompt_token_ids' (list of ints)")
    elif isinstance(prompt, (Sequence, np.ndarray)) and not isinstance(prompt, bytes):
        text = None
        ids = _check_ids(prompt, vocab_size)
    else:
        raise InvalidTypeError(
            f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}"
        )
    if not ids:
        raise InvalidArgumentError("the prompt is empty (no tokens)")
    return text, ids


def _check_ids(ids: Any, vocab_size: int) -> list[int]:
    out = []
    for i, t in enumerate(list(ids)):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise InvalidTypeError(f"prompt token {i} is {type(t).__name__}, not an int")
        if not 0 <= int(t) < vocab_size:
            raise InvalidTokenError(f"prompt token id {int(t)} at index {i} is outside the vocabulary [0, {vocab_size})")
        out.append(int(t))
    return out


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> dict[str, Any]:
    """One conversation rendered with the chat template, as ``{"prompt", "prompt_token_ids"}``.

    The rendered text already holds the template's special tokens, so it is tokenized without
    adding any (no second BOS)."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise InvalidArgumentError("a conversation is a non-empty list of dicts with 'role' and 'content'")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidArgumentError("the tokenizer has no chat template; pass chat_template=...")
    text = tokenizer.apply_chat_template(
        list(messages), chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return {"prompt": text, "prompt_token_ids": list(tokenizer(text, add_special_tokens=False).input_ids)}
