"""``GET /tokenizer_info``: the served tokenizer's configuration, as vLLM's endpoint gives it.

Clients that count tokens or render chats on their side (load generators, eval harnesses)
read it: the tokenizer's class, its special tokens (``bos_token``, ``eos_token``,
``pad_token``, ...), ``model_max_length`` and ``chat_template``, plus the rest of what
``tokenizer_config.json`` holds (the tokenizer's ``init_kwargs``). Paths on the server
(``name_or_path``, ``*_file``, ``*_path``) are left out: they say nothing to a client and
describe the server's disk. ``model_max_length`` is the length this server accepts
(``max_model_len``), not the tokenizer's own bound, which is often a "no limit" sentinel.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tokenizer_info"]

_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_info(tokenizer: Any, *, max_model_len: int) -> dict[str, Any]:
    init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    info = {name: _jsonable(value) for name, value in init_kwargs.items() if not _is_server_path(name)}
    for name in _SPECIAL_TOKENS:
        info[name] = _jsonable(getattr(tokenizer, name, None))
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = max_model_len
    template = getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, (str, dict)) else None
    return info


def _is_server_path(name: str) -> bool:
    return name == "name_or_path" or name.endswith(("_file", "_path"))


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: an AddedToken as its text, containers item by item,
    anything else unknown as its ``str``."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    content = getattr(value, "content", None)  # transformers' AddedToken
    if isinstance(content, str):
        return content
    return str(value)
