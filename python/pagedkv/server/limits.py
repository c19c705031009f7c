"""The server's limits on what one client may ask for, and their command-line flags.

Every limit is checked before the work it bounds: the body's size while it is read, the
number of prompts and each prompt's characters before anything is tokenized, ``n`` and
``logprobs`` before any per-sample state is built, a request's chat template before it is
rendered. Past a limit the client gets OpenAI's error body with a 4xx (413 for the body, 400
otherwise) and the server keeps serving. ``n`` is bounded by the engine's ``max_num_seqs``
and ``logprobs`` / ``top_logprobs`` by its ``max_logprobs``: they are engine arguments.

This module has no FastAPI import, so ``pagedkv serve --help`` lists the flags without the
serve extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import ConfigError

__all__ = ["CONNECTION_LIMITS", "ServerLimits", "add_limit_arguments", "limit_flags", "limits_from"]


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-connection limits of ``pagedkv serve`` (each is a flag).

    - ``max_request_body_bytes``: the largest request body; a bigger one is answered 413 as soon
      as its ``Content-Length`` says so, or once that many bytes of a chunked body arrived (it is
      never parsed).
    - ``max_prompt_chars``: the most characters of one text prompt, or of a conversation's
      message contents together, checked before tokenizing. ``None``: ``max_model_len`` times
      the vocabulary's longest token in characters, so only a prompt that can never fit is
      refused before its tokens are counted (tokenizers that drop characters aside).
    - ``max_prompts_per_request``: the most prompts in one ``/v1/completions`` request.
    - ``header_timeout``: seconds a connection may take to send a request's complete headers
      (from its opening, or from the end of its previous response); then it is closed. A body
      that stops arriving for as long gets 408.
    - ``body_timeout``: seconds a request's body may take to arrive whole, from the end of its
      headers; past it, 408 and the connection is closed (a body dripping a byte at a time,
      each within ``header_timeout``, holds a connection no longer). 60 s reads the largest
      body (16 MiB) at 280 KB/s.
    - ``max_connections``: the most open connections; one more is closed as soon as it opens.
    - ``trust_request_chat_template``: accept a request's own ``chat_template`` (vLLM's
      ``--trust-request-chat-template``); off, such a request is a 400. A request template is
      rendered in a bounded sandbox: no string or list over ``max_prompt_chars``, no more than
      ``chat_template_timeout`` seconds, stopped when the client leaves.
    - ``chat_template_timeout``: seconds a request's own chat template may render.
    """

    max_request_body_bytes: int = 16 * 1024 * 1024
    max_prompt_chars: int | None = None
    max_prompts_per_request: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 1000
    trust_request_chat_template: bool = False
    chat_template_timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_prompts_per_request", "max_connections", "max_prompt_chars"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_chars":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        for name in ("header_timeout", "body_timeout", "chat_template_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.trust_request_chat_template, bool):
            raise ConfigError(f"trust_request_chat_template must be a bool, got {self.trust_request_chat_template!r}")


# The flags' help (the field's meaning in a line; the docstring above has the details).
_HELP = {
    "max_request_body_bytes": "largest request body in bytes; a bigger one gets 413 before it is read",
    "max_prompt_chars": "most characters of one prompt (or of a conversation), checked before tokenizing "
    "(default: max_model_len x the longest token's characters)",
    "max_prompts_per_request": "most prompts in one /v1/completions request",
    "header_timeout": "seconds a connection may take to send complete request headers before it is closed",
    "body_timeout": "seconds a request body may take to arrive whole after its headers; then 408, connection closed",
    "max_connections": "most open connections; more are closed at once",
    "trust_request_chat_template": "accept a chat_template sent in a request (rendered in a bounded sandbox); "
    "off: such requests get 400",
    "chat_template_timeout": "seconds a request's own chat template may take to render",
}


# The limits that guard a socket, not an engine's work: `pagedkv router` has them too.
CONNECTION_LIMITS = ("max_request_body_bytes", "header_timeout", "body_timeout", "max_connections")


def add_limit_arguments(
    parser: argparse.ArgumentParser, only: Sequence[str] | None = None, title: str = "request limits"
) -> None:
    """One flag per :class:`ServerLimits` field (``--max-request-body-bytes`` ...), or per
    field named in ``only``."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(ServerLimits):
        if only is not None and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            group.add_argument(flag, action="store_true", default=False, help=_HELP[f.name])
            continue
        kind = float if "float" in str(f.type) else int
        shown = "" if f.default is None else f" (default: {f.default})"
        group.add_argument(flag, type=kind, default=f.default, help=_HELP[f.name] + shown)


def limits_from(namespace: argparse.Namespace) -> ServerLimits:
    """The :class:`ServerLimits` of parsed flags (a ConfigError names a bad one)."""
    return ServerLimits(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(ServerLimits)})


def limit_flags(namespace: argparse.Namespace) -> list[str]:
    """The limit flags of parsed flags that are not at their default (to pass them on to the
    engines ``pagedkv serve --disagg`` starts)."""
    flags: list[str] = []
    for f in dataclasses.fields(ServerLimits):
        value = getattr(namespace, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags
