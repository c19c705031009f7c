"""``StructuredOutputsParams``: what a request's output must match (vLLM's names).

Exactly one constraint per request:

- ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value valid under it;
- ``json_object``: ``True``: any JSON object (OpenAI's ``response_format: json_object``);
- ``regex``: the output matches the regular expression whole (Rust ``regex`` syntax);
- ``choice``: the output is exactly one of these strings;
- ``grammar``: a context-free grammar in Lark syntax or llama.cpp's GBNF (EBNF), as llguidance
  reads them.

``disable_any_whitespace``: JSON without optional whitespace (by default any JSON whitespace is
allowed between tokens, as in vLLM).

The checks here are cheap and made when the params are built (a :class:`~pagedkv.errors.ConfigError`
naming the field): types, exactly one constraint, sizes. Whether the schema or grammar can be
compiled is decided by the engine's :class:`~pagedkv.structured.compiler.GrammarCompiler`, off the
engine thread (:class:`~pagedkv.errors.StructuredOutputError`).
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import ConfigError, StructuredOutputError
from pagedkv.structured.limits import MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_SCHEMA_DEPTH

__all__ = ["MAX_CONSTRAINT_CHARS", "MAX_CHOICES", "StructuredOutputsParams"]

# Bounds checked here, before any compile work (a request must not make the server do unbounded
# work): the constraint's text and the number of choices (pagedkv.structured.limits, with the
# limits on its complexity that the compile threads check before compiling).

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """One structured-output constraint (vLLM's ``StructuredOutputsParams``); see the module docs."""

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if self.json is False:  # the schema `false` (nothing valid) is a value, not "unset"
            given.insert(0, "json")
        if len(given) != 1:
            raise ConfigError(
                f"structured outputs need exactly one of {', '.join(_KINDS)}; got {', '.join(given) or 'none'}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ConfigError(f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")
        if self.json_object is not None and self.json_object is not True:
            raise ConfigError(f"json_object must be true when given, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"structured outputs: {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                raise ConfigError(f"structured outputs: choice must be a list of strings, got {self.choice!r}")
            if not 0 < len(self.choice) <= MAX_CHOICES:
                raise ConfigError(
                    f"structured outputs: choice must hold 1 .. {MAX_CHOICES} strings, got {len(self.choice)}"
                )
            for item in self.choice:
                if not isinstance(item, str) or not item:
                    raise ConfigError(f"structured outputs: choice entries must be non-empty strings, got {item!r}")
            self.choice = list(self.choice)
        if self.json is not None:
            self.json = _schema(self.json)
        size = len(self.text())
        if size > MAX_CONSTRAINT_CHARS:
            raise ConfigError(
                f"structured outputs: the {self.kind} constraint has {size} characters, "
                f"more than the limit of {MAX_CONSTRAINT_CHARS}"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: ``"json"``, ``"json_object"``, ``"regex"``, ``"choice"`` or ``"grammar"``."""
        if self.json is not None:
            return "json"
        return next(kind for kind in _KINDS[1:] if getattr(self, kind) not in (None, False))

    def text(self) -> str:
        """The constraint as text: the schema's JSON, the regex, the grammar, the choices' JSON."""
        kind = self.kind
        if kind == "json":
            try:
                return json_module.dumps(self.json, separators=(",", ":"), ensure_ascii=False)
            except RecursionError:  # a dict nested past Python's recursion limit
                raise ConfigError("structured outputs: the json schema is nested too deeply") from None
        if kind == "choice":
            return json_module.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return '{"type":"object"}'
        return str(getattr(self, kind))

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal keys compile to the same grammar (the compiler's cache key)."""
        return (self.kind, self.text(), self.disable_any_whitespace)

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON text) for this constraint; cheap, no compile.
        Raises StructuredOutputError when the grammar text cannot be read at all."""
        from llguidance import LLMatcher, grammar_from

        kind = self.kind
        try:
            if kind in ("json", "json_object"):
                options = {"whitespace_flexible": False} if self.disable_any_whitespace else None
                schema = {"type": "object"} if kind == "json_object" else self.json
                return str(LLMatcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]
            if kind == "regex":
                return str(LLMatcher.grammar_from_regex(str(self.regex)))
            if kind == "choice":
                # One lexeme, an alternation of the JSON-quoted choices: the lexer matches it
                # (a trie), so the parser's row holds one item whatever the number of choices
                # (as a rule of n alternatives, n > 1,999 fails at the first token).
                lark = "start: CHOICE\nCHOICE: " + " | ".join(json_module.dumps(c) for c in self.choice or [])
                return str(LLMatcher.grammar_from_lark(lark))
            return str(grammar_from("grammar", str(self.grammar)))
        except ValueError as exc:
            raise StructuredOutputError(f"structured outputs: the {kind} constraint cannot be read: {exc}") from None


def _schema(value: Any) -> dict[str, Any] | bool:
    """A JSON schema given as a dict, a bool (``true``: anything, ``false``: nothing) or JSON text."""
    if isinstance(value, str):
        if len(value) > MAX_CONSTRAINT_CHARS:
            raise ConfigError(
                f"structured outputs: the json schema has {len(value)} characters, "
                f"more than the limit of {MAX_CONSTRAINT_CHARS}"
            )
        try:
            value = json_module.loads(value)
        except ValueError as exc:
            raise ConfigError(f"structured outputs: the json schema is not valid JSON: {exc}") from None
        except RecursionError:  # json recurses on nesting: ~1,000 levels end it (C speed)
            raise ConfigError(
                f"structured outputs: the json schema is nested too deeply (the limit is {MAX_SCHEMA_DEPTH} levels)"
            ) from None
    if isinstance(value, bool) or isinstance(value, dict):
        return value
    raise ConfigError(f"structured outputs: a json schema must be an object or a bool, got {type(value).__name__}")
