"""Rendering a chat template sent by a client, with bounded memory and time.

A request's ``chat_template`` is client code. It is refused unless the operator trusts request
templates (``--trust-request-chat-template``); when trusted it runs here, not through
transformers, in :class:`BoundedTemplateEnvironment`: Jinja's immutable sandbox (no attribute
escapes, no mutation of the request's data) that also refuses, before the value is built,

- a string, list or tuple over ``max_size`` items from ``*``, ``+``, ``~``, ``%``, a filter or a
  method call (repetition, concatenation, ``replace``, ``join``, padding widths and ``%`` /
  ``format`` field widths are checked from their operands' sizes; any other result is checked
  once built, so no single step more than doubles what an earlier check let through),
- an integer above ``max_size`` passed to a filter or a call (``center(10**9)``) and integer
  arithmetic beyond 4096 bits (``x ** 10**9``),
- output beyond ``max_size`` characters (counted as the template yields it),

and a tracer on the rendering thread stops the template's own code at its next line once
``timeout`` seconds have passed or the caller sets ``cancel`` (the client left): loops that
build nothing are stopped too. Every refusal is an :class:`InvalidArgumentError` (a 400).
The globals match transformers' (``raise_exception``, ``strftime_now``, ``namespace``,
``tojson``, loop controls), so Hub templates render the same.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from types import FrameType
from typing import Any

from jinja2 import Environment, TemplateError
from jinja2.ext import loopcontrols
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from pagedkv.errors import InvalidArgumentError

__all__ = ["BoundedTemplateEnvironment", "TemplateLimitError", "render_request_template"]

# Compiled templates' code objects carry this file name (jinja's default for from_string).
_TEMPLATE_FILE = "<template>"
_MAX_INT_BITS = 4096
_WIDTH = re.compile(r"\d+")


class TemplateLimitError(InvalidArgumentError):
    """A request's chat template went past a limit (size, time) or its client left."""


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


class BoundedTemplateEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with size limits (see the module docs). One per render: the
    deadline and the cancel event are the render's."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, max_size: int, **options: Any) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], **options)
        self.max_size = max_size
        self.filters = {name: self._guarded(f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._guarded(_tojson)
        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=lambda fmt: datetime.now().strftime(fmt),
            namespace=_Namespace,
        )
        self.concat = self._join  # type: ignore[method-assign]  # {% set %} blocks, macros, caller()

    # ---------------------------------------------------------------- size checks

    def _refuse(self, what: str) -> TemplateLimitError:
        return TemplateLimitError(f"the chat template {what} (limit: {self.max_size})")

    def _check_result(self, value: Any) -> Any:
        if _sized(value) and len(value) > self.max_size:
            raise self._refuse(f"built a value of {len(value)} items")
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise self._refuse(f"built an integer of {value.bit_length()} bits")
        return value

    def _check_args(self, args: Iterable[Any]) -> None:
        for arg in args:
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > self.max_size:
                raise self._refuse(f"passed the number {arg} to a function")

    def _check_widths(self, fmt: Any) -> None:
        """``%``-style and ``format`` field widths (``'%999999999s'``) are sizes too."""
        if isinstance(fmt, str) and any(int(w) > self.max_size for w in _WIDTH.findall(fmt)):
            raise self._refuse("asked for a field wider than the limit")

    def _join(self, items: Iterable[Any], sep: str = "") -> str:
        parts, size = [], 0
        for item in items:
            part = str(item)
            size += len(part) + len(sep)
            if size > self.max_size:
                raise self._refuse("joined more characters than the limit")
            parts.append(part)
        return sep.join(parts)

    def _check_replace(self, s: Any, old: Any, new: Any, count: Any = -1) -> None:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            n = s.count(old) if old else len(s) + 1
            if isinstance(count, int) and count >= 0:
                n = min(n, count)
            if len(s) + n * (len(new) - len(old)) > self.max_size:
                raise self._refuse("replaced its way past the limit")

    def _precheck(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """The checks a call of ``name`` needs before it runs (its size comes from its
        arguments, not its result)."""
        self._check_args(args)
        self._check_args(kwargs.values())
        if name == "replace" and len(args) >= 3:
            self._check_replace(*args[:4])
        elif name == "join" and args and isinstance(args[0], str) and len(args) >= 2:
            self._join(args[1], args[0])  # str.join(sep, items): size it first
        elif name == "format" and args:
            self._check_widths(args[0])

    def _guarded(self, f: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(f, "__name__", "").removeprefix("do_")

        def guarded(*args: Any, **kwargs: Any) -> Any:
            values = list(args)
            # Past jinja's own first argument (environment / context) where the filter takes one.
            first = next((i for i, a in enumerate(values) if not _is_jinja_internal(a)), len(values))
            if name == "join" and first < len(values):
                if not _sized(values[first]):
                    values[first] = list(values[first])  # a generator is read once: keep its items
                sep = values[first + 1] if first + 1 < len(values) else kwargs.get("d", "")
                self._join(values[first], sep if isinstance(sep, str) else "")
            self._precheck(name, values[first:], kwargs)
            return self._check_result(f(*values, **kwargs))

        # Keep jinja's pass_context / pass_eval_context / pass_environment marker.
        if hasattr(f, "jinja_pass_arg"):
            guarded.jinja_pass_arg = f.jinja_pass_arg  # type: ignore[attr-defined]
        return guarded

    # ---------------------------------------------------------------- sandbox hooks

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _sized(seq) and isinstance(times, int) and len(seq) * times > self.max_size:
                    raise self._refuse(f"repeated a value {times} times")
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                    raise self._refuse("multiplied integers past 4096 bits")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if right * math.log2(abs(left)) > _MAX_INT_BITS:
                    raise self._refuse("raised an integer past 4096 bits")
            elif isinstance(left, float) or isinstance(right, float):
                pass  # floats overflow to an error, they do not grow
        elif operator == "+" and _sized(left) and _sized(right):
            if len(left) + len(right) > self.max_size:
                raise self._refuse("concatenated past the limit")
        elif operator == "%":
            self._check_widths(left)
        return self._check_result(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        name = getattr(__obj, "__name__", "")
        bound_to = getattr(__obj, "__self__", None)
        if isinstance(bound_to, str) and name == "join" and len(args) == 1 and not kwargs:
            return __self._join(args[0], bound_to)  # sized as it is built
        if isinstance(bound_to, str):  # a str method: the string is its first argument
            __self._precheck(name, [bound_to, *args], kwargs)
        else:
            __self._check_args(args)
            __self._check_args(kwargs.values())
        return __self._check_result(ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``'{:>999999999}'.format`` is refused when the method is looked up."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            self._check_widths(value.__self__)
        return wrapped


def _is_jinja_internal(value: Any) -> bool:
    """Jinja's environment, context or eval context (what pass_* filters get first)."""
    return isinstance(value, (Environment, Context, EvalContext))


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(Namespace):
    """``namespace(...)`` as in transformers: no underscore names (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise TemplateError(f"a namespace cannot hold underscore names ({name!r})")


def render_request_template(
    source: str,
    variables: dict[str, Any],
    *,
    max_size: int,
    timeout: float,
    cancel: threading.Event,
) -> str:
    """``source`` rendered with ``variables`` within the limits (module docs); runs on the
    calling thread (call it in a worker thread). Refusals and template errors are
    :class:`InvalidArgumentError`."""
    env = BoundedTemplateEnvironment(max_size)
    try:
        template = env.from_string(source)
    except TemplateError as exc:
        raise InvalidArgumentError(f"the request's chat_template does not compile: {exc}") from None
    # `a ~ b` compiles to str_join / markup_join from the template's module globals.
    module_globals = template.root_render_func.__globals__
    module_globals["str_join"] = env._join
    module_globals["markup_join"] = env._join
    deadline = time.monotonic() + timeout

    def check(frame: FrameType, event: str, arg: Any) -> Any:
        if cancel.is_set():
            raise TemplateLimitError("the client left while its chat template rendered")
        if time.monotonic() > deadline:
            raise TemplateLimitError(f"the chat template took more than {timeout} s to render")
        return check

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return check if frame.f_code.co_filename == _TEMPLATE_FILE else None

    pieces, size = [], 0
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > max_size:
                raise env._refuse(f"rendered more than {max_size} characters")
            pieces.append(piece)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # noqa: BLE001 - the template is the client's: any failure is a 400
        raise InvalidArgumentError(f"the chat template cannot render this conversation: {exc}") from None
    finally:
        sys.settrace(previous)
    return "".join(pieces)
