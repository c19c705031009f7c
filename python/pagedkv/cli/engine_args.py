"""Every :class:`EngineArgs` field as a command-line flag (``--max-num-seqs 64``), generated
from the dataclass so a new engine argument is a new flag without touching the CLI.

Types come from the annotations (``int``, ``float``, ``str``, optional or not); a ``bool``
becomes ``--flag`` / ``--no-flag``; a byte count (``BYTE_SIZE_FIELDS``) takes a size
(``512MiB``, ``8GiB``, ``4096``); a structured one (``kv_transfer_config``) takes JSON text.
Values are validated by EngineArgs itself (a ConfigError names the field).

The help text is the field's bullet in the EngineArgs docstring, as plain text: Sphinx roles
(``:class:`~a.B```) become their name, a bullet that names several fields is printed under the
first one (the others point to it), and the default is said once (not again when the bullet
already says it).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any

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
    """Field name -> its help: the bullet that names it in the EngineArgs docstring, for the
    first field the bullet names; ``see --first`` for the others, and for a field a bullet
    only mentions (one paragraph, printed once). A one-field bullet loses its ``name:`` head
    (the flag says it)."""
    doc = EngineArgs.__doc__ or ""
    helps: dict[str, str] = {}
    mentions: dict[str, str] = {}
    for bullet in re.split(r"\n\s*- ", doc)[1:]:
        bullet = bullet.split("\n\n")[0]  # the bullet ends at a blank line (the closing paragraphs)
        head, _, body = bullet.partition(":")
        names = [n for n in re.findall(r"``(\w+)``", head) if n not in helps]
        if not names:
            continue
        single = re.fullmatch(r"\s*``\w+``\s*", head) is not None
        helps[names[0]] = _plain(body if single and body else bullet)
        for other in names[1:]:
            helps[other] = f"see {_flag(names[0])}"
        for other in re.findall(r"``(\w+)[`=]", body):
            mentions.setdefault(other, f"see {_flag(names[0])}")
    return {**mentions, **helps}


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
    """``text`` and its default, unless the text already says it (or it is None after a
    "see --other", whose help says what none means)."""
    if "default" in text.lower() or (default is None and text.startswith("see ")):
        return text
    shown = "none" if default is None else default
    return f"{text} Default: {shown}." if text.endswith(".") else f"{text} (default: {shown})"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    helps = field_help()
    for f in dataclasses.fields(EngineArgs):
        if f.name in _SKIP:
            continue
        flag = _flag(f.name)
        default = f.default
        text = _with_default(helps.get(f.name, f.name.replace("_", " ")), default).replace("%", "%%")
        if f.name in BYTE_SIZE_FIELDS:
            group.add_argument(flag, type=byte_size_arg, default=default, metavar="SIZE", help=text)
            continue
        kind = _scalar_type(hints[f.name])
        if kind is bool:
            group.add_argument(flag, action=_BoolFlag, default=default, help=text)
        elif kind not in (int, float, str):
            # A structured argument (kv_transfer_config): JSON text, parsed by EngineArgs.
            group.add_argument(flag, type=str, default=default, metavar="JSON", help=text)
        else:
            group.add_argument(flag, type=kind, default=default, help=text)


def engine_args_from(namespace: argparse.Namespace, model: str | None) -> EngineArgs:
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs) if f.name not in _SKIP}
    return EngineArgs(model=model, **values)
