"""Every :class:`EngineArgs` field as a command-line flag (``--max-num-seqs 64``), generated
from the dataclass's field declarations, so a new engine argument is a new flag without
touching the CLI, and a flag's default and help are the field's (declared once, in
:mod:`pagedkv.config`).

Types come from the annotations (``int``, ``float``, ``str``, optional or not); a ``bool``
becomes ``--flag`` / ``--no-flag``; a byte count (``BYTE_SIZE_FIELDS``) takes a size
(``512MiB``, ``8GiB``, ``4096``); a structured one (``kv_transfer_config``) takes JSON text.
Values are validated by EngineArgs itself (a ConfigError names the field). The help text is
the field's doc as plain text (Sphinx roles become their name), with its default said once.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pagedkv.config.fields import field_doc
from pagedkv.engine.args import BYTE_SIZE_FIELDS, EngineArgs
from pagedkv.sizes import byte_size_arg

__all__ = ["add_engine_arguments", "engine_args_from", "field_help"]

# Fields the commands give their own way (the positional MODEL of `serve`).
_SKIP = frozenset({"model"})
# :class:`~pagedkv.x.Name` / :meth:`Name.run` / :func:`f` -> Name / Name.run / f (as Sphinx shows them)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _plain(rst: str) -> str:
    """Docstring text as terminal text: roles reduced to the last part of their target
    (``:class:`~a.b.C``` -> ``C``), literals unquoted, whitespace folded."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), rst)
    return " ".join(text.replace("``", "").split())


def field_help() -> dict[str, str]:
    """Field name -> its help: the field's doc as plain text."""
    return {f.name: _plain(field_doc(f)) for f in dataclasses.fields(EngineArgs)}


def _scalar_type(annotation: Any) -> type:
    """``int`` for ``int`` or ``int | None``, etc."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if len(args) != 1:
            raise TypeError(f"cannot make a flag for {annotation}")
        return typing.cast(type, args[0])
    return typing.cast(type, annotation)


class _BoolFlag(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag`` without the "(default: ...)" that Python < 3.13 appends on its
    own (the help below says the default once)."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:  # noqa: A002 (argparse's name)
        super().__init__(*args, **kwargs)
        self.help = help


def _with_default(text: str, default: Any) -> str:
    """``text`` and its default, unless the text already says it."""
    if "default" in text.lower():
        return text
    shown = "none" if default is None else default
    return f"{text} Default: {shown}." if text.endswith(".") else f"{text} (default: {shown})"


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    only: Iterable[str] | None = None,
    *,
    title: str = "engine (EngineArgs)",
    defaults: Mapping[str, Any] | None = None,
    choices: Mapping[str, Iterable[str]] | None = None,
) -> None:
    """Adds a flag per EngineArgs field (``only``: these fields, in this order) to a group
    ``title`` of ``parser`` (or to ``parser`` itself when it is a group). ``defaults``: a
    command's own defaults for some fields (said in their help); ``choices``: fields that
    argparse checks against a list (its own error names the flag)."""
    group = parser.add_argument_group(title) if isinstance(parser, argparse.ArgumentParser) else parser
    hints = typing.get_type_hints(EngineArgs)
    by_name = {f.name: f for f in dataclasses.fields(EngineArgs)}
    names = [n for n in by_name if n not in _SKIP] if only is None else list(only)
    own = dict(defaults or {})
    for name in names:
        f = by_name[name]
        flag = _flag(name)
        default = own.get(name, f.default)
        text = _with_default(_plain(field_doc(f)) or name.replace("_", " "), default).replace("%", "%%")
        extra: dict[str, Any] = {}
        if choices and name in choices:
            extra["choices"] = tuple(choices[name])
        if name in BYTE_SIZE_FIELDS:
            group.add_argument(flag, type=byte_size_arg, default=default, metavar="SIZE", help=text)
            continue
        kind = _scalar_type(hints[name])
        if kind is bool:
            group.add_argument(flag, action=_BoolFlag, default=default, help=text)
        elif kind not in (int, float, str):
            # A structured argument (kv_transfer_config): JSON text, parsed by EngineArgs.
            group.add_argument(flag, type=str, default=default, metavar="JSON", help=text)
        else:
            group.add_argument(flag, type=kind, default=default, help=text, **extra)


def engine_args_from(namespace: argparse.Namespace, model: str | None) -> EngineArgs:
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs) if f.name not in _SKIP}
    return EngineArgs(model=model, **values)
