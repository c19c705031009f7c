"""Every :class:`EngineArgs` field as a command-line flag (``--max-num-seqs 64``), generated
from the dataclass so a new engine argument is a new flag without touching the CLI.

Types come from the annotations (``int``, ``float``, ``str``, optional or not); a ``bool``
becomes ``--flag`` / ``--no-flag``; a structured one (``kv_transfer_config``) takes JSON text. The help text is the field's bullet in the EngineArgs
docstring. Values are validated by EngineArgs itself (a ConfigError names the field).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any

from pagedkv.engine.args import EngineArgs

__all__ = ["add_engine_arguments", "engine_args_from"]

# Fields the commands give their own way (the positional MODEL of `serve`).
_SKIP = frozenset({"model"})


def _field_help() -> dict[str, str]:
    """Field name -> its bullet text in the EngineArgs docstring (a bullet may name several)."""
    doc = EngineArgs.__doc__ or ""
    helps: dict[str, str] = {}
    for bullet in re.split(r"\n\s*- ", doc)[1:]:
        text = " ".join(bullet.split())
        for name in re.findall(r"``(\w+)``", text.split(":")[0]):
            helps.setdefault(name, text.replace("``", ""))
    return helps


def _scalar_type(annotation: Any) -> type:
    """``int`` for ``int`` or ``int | None``, etc."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if len(args) != 1:
            raise TypeError(f"cannot make a flag for {annotation}")
        return typing.cast(type, args[0])
    return typing.cast(type, annotation)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    helps = _field_help()
    for f in dataclasses.fields(EngineArgs):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _scalar_type(hints[f.name])
        help_text = helps.get(f.name, f.name).replace("%", "%%")
        default = f.default
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif kind not in (int, float, str):
            # A structured argument (kv_transfer_config): JSON text, parsed by EngineArgs.
            group.add_argument(flag, type=str, default=default, metavar="JSON", help=f"{help_text} (JSON)")
        else:
            group.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {default})")


def engine_args_from(namespace: argparse.Namespace, model: str | None) -> EngineArgs:
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs) if f.name not in _SKIP}
    return EngineArgs(model=model, **values)
