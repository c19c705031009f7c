"""JSON from a peer, parsed within bounds: a size and a nesting depth, with one typed error.

``json.loads`` of untrusted bytes can raise more than ``ValueError``: ``RecursionError`` for
nesting past the interpreter's recursion limit (``[[[[...`` a few thousand deep), and the
value it returns can be nested deeply enough that the code which walks it (``repr``, a
comparison, ``json.dumps`` of a reply) raises ``RecursionError`` later, far from the parse. A
thread that serves peers must never see either: :func:`loads_bounded` turns every way a
message can be unacceptable into :class:`~pagedkv.errors.InvalidArgumentError`, and a value it
returns is at most ``max_depth`` containers deep, so anything that walks it stays far from the
recursion limit.

:func:`json_depth` measures a value already parsed (iteratively: it cannot itself overflow),
and :func:`describe` gives a bounded one-line description of a value for an error message
(never a ``repr`` of a nested or huge value).
"""

from __future__ import annotations

import json
from typing import Any

from pagedkv.errors import InvalidArgumentError

__all__ = ["describe", "json_depth", "loads_bounded"]

# The most characters of a value quoted in an error message.
_DESCRIBE_CHARS = 80


def json_depth(value: Any, limit: int | None = None) -> int:
    """How many containers (dicts, lists, tuples) deep ``value`` is: 0 for a scalar, 1 for
    ``[1, 2]``, 2 for ``{"a": [1]}``. Iterative. With ``limit``, stops at the first container
    deeper than ``limit`` and returns ``limit + 1`` (so a huge value costs only its first
    too-deep path)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if limit is not None and depth > limit:
                return depth
        stack.extend((child, depth) for child in children)
    return deepest


def loads_bounded(data: bytes | str, *, max_bytes: int, max_depth: int, what: str = "the message") -> Any:
    """``json.loads(data)``, refused (:class:`InvalidArgumentError` naming ``what``) when
    ``data`` is larger than ``max_bytes``, is not UTF-8 JSON, or nests containers more than
    ``max_depth`` deep. Never raises anything else for any ``bytes`` or ``str``."""
    if not isinstance(data, (bytes, str)):
        raise InvalidArgumentError(f"{what} must be bytes or str, got {type(data).__name__}")
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidArgumentError(f"{what} is {size} bytes, more than the limit of {max_bytes}")
    try:
        value = json.loads(data)
    except RecursionError:  # nested past the parser's own depth: far past max_depth
        raise InvalidArgumentError(f"{what} nests more than {max_depth} levels deep") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidArgumentError(f"{what} is not JSON: {describe(str(exc))}") from None
    if json_depth(value, max_depth) > max_depth:
        raise InvalidArgumentError(f"{what} nests more than {max_depth} levels deep")
    return value


def describe(value: Any) -> str:
    """A short description of ``value`` for an error message: the ``repr`` of a scalar (cut at
    80 characters), the type and size of a container. Never raises, never recurses."""
    if isinstance(value, (dict, list, tuple, set)):
        return f"a {type(value).__name__} of {len(value)}"
    try:
        text = repr(value) if isinstance(value, (str, int, float, bool, bytes)) or value is None else None
    except Exception:  # noqa: BLE001 - e.g. an int too large to print (sys.set_int_max_str_digits)
        text = None
    if text is None:
        return f"a {type(value).__name__}"
    return text if len(text) <= _DESCRIBE_CHARS else text[:_DESCRIBE_CHARS] + "..."
