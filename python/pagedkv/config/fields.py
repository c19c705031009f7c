"""How a config field is declared: once, with its default, its doc and (for the scheduler's
settings) the Rust core's range.

A field is ``name: type = setting(default, doc)``, or ``= core_setting(name, doc)`` for a
setting of the Rust scheduler, whose default and range come from the core's table
(``pagedkv._core.config_fields()``, written in rust/scheduler/config.rs) and whose values the core
checks (``check_core``). :class:`pagedkv.EngineArgs` declares its fields with
``engine_arg(ConfigClass, "field")``, which copies that field's default and doc, and the CLI
flags are generated from EngineArgs' fields (:mod:`pagedkv.cli.engine_args`): a default or a
doc is written once, here or in the Rust table.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pagedkv import _core
from pagedkv.errors import ConfigError

__all__ = [
    "CORE_FIELDS",
    "check_core",
    "config_from_any",
    "core_message",
    "core_setting",
    "documented",
    "engine_arg",
    "field_doc",
    "setting",
]

# The Rust scheduler's settings: name -> {"default", "kind", "min", "max", "choices", "expected", ...}.
CORE_FIELDS: dict[str, dict[str, Any]] = _core.config_fields()

_T = TypeVar("_T")


def setting(default: Any, doc: str, **metadata: Any) -> Any:
    """A config field with ``default`` and its one ``doc`` (reStructuredText, one paragraph;
    the CLI shows it as plain text)."""
    return dataclasses.field(default=default, metadata={"doc": doc, **metadata})


def core_setting(core: str, doc: str, *, default: Any = dataclasses.MISSING) -> Any:
    """A config field that is the Rust scheduler's setting ``core``: its default comes from the
    core's table unless ``default`` overrides it (``None``: "the core's default, resolved by the
    core", for a setting that applies to one mode only)."""
    spec = CORE_FIELDS[core]
    if default is dataclasses.MISSING:
        return setting(spec["default"], doc, core=core)
    return setting(default, doc, core=core, core_default=False)


def field_doc(f: dataclasses.Field[Any]) -> str:
    """The doc of a declared field ("" when it has none)."""
    return str(f.metadata.get("doc", ""))


def documented(cls: type[_T]) -> type[_T]:
    """Class decorator (outside ``@dataclass``): appends ``- ``name``: doc`` for each documented field to ``cls.__doc__`` (after
    ``@dataclass``)."""
    bullets = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        doc = field_doc(f)
        if doc:
            bullets.append(f"- ``{f.name}``: {doc}")
    if bullets:
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n" + "\n".join(bullets) + "\n"
    return cls


def engine_arg(cls: type, name: str, doc: str | None = None) -> Any:
    """An :class:`pagedkv.EngineArgs` field that is ``cls``'s field ``name``: the same default
    and doc (``doc`` replaces the doc where EngineArgs says more, e.g. a size string)."""
    f = {g.name: g for g in dataclasses.fields(cls)}[name]
    return setting(f.default, field_doc(f) if doc is None else doc, source=(cls.__name__, name))


def core_message(exc: ConfigError, names: Mapping[str, str] | None = None) -> str:
    """A core ConfigError's message without the core's "invalid configuration: " prefix (the
    class says it), its setting names replaced by the user's (``names``: core -> Python)."""
    message = str(exc).removeprefix("invalid configuration: ")
    for core, name in (names or {}).items():
        message = re.sub(rf"\b{core}\b", name, message)
    return message


def check_core(names: Mapping[str, str] | None = None, /, **fields: Any) -> None:
    """The Rust core's check of scheduler settings (type and range, its table's); a refusal is
    a ConfigError naming the field (``names``: the user's names of core settings)."""
    try:
        _core.check_config_fields(**fields)
    except ConfigError as exc:
        raise ConfigError(core_message(exc, names)) from None


def config_from_any(cls: type[_T], value: Any, name: str) -> _T:
    """A config dataclass from itself, a mapping of its fields, or that mapping's JSON text (a
    CLI flag); ConfigError naming ``name`` for bad JSON, another type or an unknown key."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a dict or JSON object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown {name} key(s) {unknown}; known: {sorted(known)}")
    return cls(**dict(value))


# ---------------------------------------------------------------- checks of what Python owns


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any, *, optional: bool = False, maximum: int | None = None) -> None:
    """ConfigError unless ``value`` is an int >= 1 (and <= ``maximum``; None passes when
    ``optional``)."""
    if value is None and optional:
        return
    if not is_int(value) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be at most {maximum}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """ConfigError unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")


def torch_name(value: Any) -> Any:
    """``torch.float16`` / ``torch.device("cuda:0")`` as their string names (no torch import)."""
    if isinstance(value, str) or value is None:
        return value
    text = str(value)
    if type(value).__module__ == "torch" or text.startswith("torch."):
        return text.removeprefix("torch.")
    return value
