"""What a structured-output constraint may cost, checked on its text before anything compiles.

A constraint is an attacker's program for the grammar engine: its compile recurses as deep as
its rules chain, its lexer grows with its counted repetitions, and each step's Earley row with
its alternatives. Every limit here is measured cheaply on the text (counts made by C-speed
string and regex operations, then one pass over the brackets) and refused with a
:class:`~pagedkv.errors.StructuredOutputError` naming the limit, so a server answers 400 before
llguidance does any work. The measurements behind each value are in docs/limits.md.

- :data:`MAX_CONSTRAINT_NODES`: rules, groups and JSON objects/arrays. llguidance compiles a
  chain of rule references (Lark ``a: b``, ``b: c`` ...; JSON ``$ref`` to ``$ref``) by
  recursion, about 3 KB of native stack per link: ~2,600 chained Lark rules overflow a default
  8 MB thread stack and kill the process (no exception can catch a stack overflow). A chain is
  never longer than the number of nodes, and compiles run on threads with
  :data:`COMPILE_STACK_BYTES` of stack, several times what this many nodes need.
- :data:`MAX_GRAMMAR_ALTERNATIVES`: ``|`` in a grammar. An Earley row holds an item per
  alternative it predicts; past llguidance's ``max_items_in_row`` (2,000) the *first token*
  after the alternation fails (mid-generation, which is why it must be refused here).
- :data:`MAX_REPETITION`: counted repetitions expanded (``a{n}``, ``x~n``, ``(..){n}`` nested
  multiply, siblings add). ``a{300000}`` exhausts the lexer at the first token, and a lexer of
  ``(a{10000}b){20}`` spends a visible part of a second on each mask.
- :data:`MAX_SCHEMA_DEPTH`: nesting of a JSON schema's text (Python's ``json`` and llguidance's
  serde parser both recurse on it); :data:`MAX_SCHEMA_PROPERTIES`: properties of one object
  (llguidance compiles optional properties in time quadratic in their number).

What is left to llguidance's own fuel (:func:`parser_limits`: lexer states, Earley items per
step, grammar size) is bounded there, and the compile proves the grammar usable before a
request is admitted (``GrammarCompiler``: the first masks and tokens are computed).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pagedkv.errors import StructuredOutputError

if TYPE_CHECKING:
    from pagedkv.structured.params import StructuredOutputsParams

__all__ = [
    "COMPILE_STACK_BYTES",
    "MAX_CHOICES",
    "MAX_CONSTRAINT_CHARS",
    "MAX_CONSTRAINT_NODES",
    "MAX_GRAMMAR_ALTERNATIVES",
    "MAX_REPETITION",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_PROPERTIES",
    "check_complexity",
    "parser_limits",
    "repetition",
]

# The constraint's text (a schema's JSON, a regex, a grammar, the choices together): real
# schemas and tool lists are a few KB.
MAX_CONSTRAINT_CHARS = 256 * 1024
# Choices are one lexeme (an alternation in the lexer, not the parser): four times as many still
# compile fast; 4,096 leaves a margin.
MAX_CHOICES = 4096
MAX_CONSTRAINT_NODES = 20_000
MAX_GRAMMAR_ALTERNATIVES = 1_500
MAX_REPETITION = 10_000
MAX_SCHEMA_DEPTH = 100
MAX_SCHEMA_PROPERTIES = 1_000
# Native stack of a compile thread: the deepest recursion MAX_CONSTRAINT_NODES allows needs about
# 64 MB (measured: 3.1 KB per chained Lark rule, 2.2-3.4 KB per JSON node); this is 4x that. It is
# address space: pages are committed only as deep as a compile actually goes.
COMPILE_STACK_BYTES = 256 * 1024 * 1024

# llguidance's fuel (LLParserLimits), stated here so that the limits are in one place; the values
# are llguidance 1.x's defaults except verbose_errors (an error quotes the parser state: long,
# and nothing a client needs).
PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2_000,  # Earley items in one row (a row past it fails that token)
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes (~50k per ms)
    "step_lexer_fuel": 200_000,  # lexer work in one mask (~14k per ms)
    "step_max_items": 50_000,  # Earley items in one mask (~20k per ms)
    "max_lexer_states": 250_000,  # lexer DFA states (1-2 KB each)
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
    "verbose_errors": False,
}

# A JSON string (or a Lark / GBNF double-quoted literal).
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
# A rule or token definition in Lark (``name:``, ``?name:``, ``NAME.2:``) or GBNF (``name ::=``).
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_-]*(?:\.-?\d+)?[ \t]*(?::(?!:)|::=)", re.M)
# What the repetition scan reads: escapes, groups, and counted repetitions (regex / GBNF
# ``{n}``, ``{n,}``, ``{n,m}``; Lark ``~ n`` and ``~ n..m``).
_REPEAT_TOKENS = re.compile(r"\\.|[()]|\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?", re.S)


def parser_limits() -> Any:
    """llguidance's ``LLParserLimits`` with :data:`PARSER_LIMITS`."""
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)


def _refuse(kind: str, what: str, value: int, limit: int) -> StructuredOutputError:
    return StructuredOutputError(
        f"structured outputs: the {kind} constraint has {value} {what}, more than the limit of {limit}"
    )


def repetition(text: str) -> int:
    """The counted repetitions of a regex or grammar expanded: each ``{n}`` / ``{n,m}`` /
    ``~n..m`` counts its upper bound, times the bounds of the groups it is in. A cheap
    over-estimate (a literal ``"a{3}"`` counts too); one pass over the groups and counts."""
    # stack[i]: the expanded count inside the open group i (0: the whole text).
    stack = [0]
    last_group = -1  # where the last group closed, and its count
    last_count = 0
    for m in _REPEAT_TOKENS.finditer(text):
        token = m.group(0)
        if token == "(":
            stack.append(0)
            last_group = -1
        elif token == ")":
            if len(stack) > 1:
                last_count = stack.pop()
                stack[-1] += last_count
                last_group = m.end()
        elif token[0] == "\\":
            continue
        else:
            low, high = (m.group(1), m.group(2)) if token[0] == "{" else (m.group(3), m.group(4))
            bound = max(int(low), int(high) if high else 0)
            if text[last_group : m.start()].strip() == "" and last_group >= 0:
                # The count applies to the group just closed: its contents repeat.
                stack[-1] += bound * max(1, last_count) - last_count
            else:
                stack[-1] += bound
            last_group = -1
        if stack[-1] > MAX_REPETITION * 100:  # far past the limit: stop counting
            break
    return sum(stack)


def _check_repetition(kind: str, text: str) -> None:
    count = repetition(text)
    if count > MAX_REPETITION:
        raise _refuse(kind, "counted repetitions (expanded)", count, MAX_REPETITION)


def _json_depth(stripped: str) -> int:
    """The bracket nesting of JSON text whose strings were removed."""
    depth = deepest = 0
    for m in re.finditer(r"[\[{]|[\]}]", stripped):
        if m.group(0) in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _schema_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object of a parsed schema (iteratively: its depth is checked, but not yet here)."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            yield node
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)


def check_schema_text(kind: str, text: str) -> None:
    """The limits of a JSON schema's text: nodes (objects and arrays) and nesting."""
    stripped = _STRING.sub('""', text)
    nodes = stripped.count("{") + stripped.count("[")
    if nodes > MAX_CONSTRAINT_NODES:
        raise _refuse(kind, "objects and arrays", nodes, MAX_CONSTRAINT_NODES)
    depth = _json_depth(stripped)
    if depth > MAX_SCHEMA_DEPTH:
        raise _refuse(kind, "levels of nesting", depth, MAX_SCHEMA_DEPTH)


def _check_schema(kind: str, schema: Any) -> None:
    for node in _schema_nodes(schema):
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > MAX_SCHEMA_PROPERTIES:
            raise _refuse(kind, "properties in one object", len(properties), MAX_SCHEMA_PROPERTIES)
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns.extend(node["patternProperties"])
        for pattern in patterns:
            _check_repetition(kind, pattern)


def _check_grammar(kind: str, text: str) -> None:
    stripped = _STRING.sub('""', text)
    rules = len(_DEFINITION.findall(stripped))
    nodes = rules + sum(stripped.count(c) for c in "([{")
    if nodes > MAX_CONSTRAINT_NODES:
        raise _refuse(kind, "rules, groups and JSON objects", nodes, MAX_CONSTRAINT_NODES)
    alternatives = stripped.count("|")
    if alternatives > MAX_GRAMMAR_ALTERNATIVES:
        raise _refuse(kind, "alternatives ('|')", alternatives, MAX_GRAMMAR_ALTERNATIVES)
    # The raw text: a %json schema's "pattern" is inside a string.
    _check_repetition(kind, text)


def check_complexity(params: StructuredOutputsParams) -> None:
    """Refuses (StructuredOutputError) a constraint past a limit of the module docs; cheap next
    to a compile, and run before it. Sizes and choice counts were checked when the params
    were made."""
    kind = params.kind
    if kind == "json":
        check_schema_text(kind, params.text())
        _check_schema(kind, params.json)
    elif kind == "regex":
        text = str(params.regex)
        if text.count("(") > MAX_CONSTRAINT_NODES:
            raise _refuse(kind, "groups", text.count("("), MAX_CONSTRAINT_NODES)
        _check_repetition(kind, text)
    elif kind == "grammar":
        _check_grammar(kind, str(params.grammar))
