"""The limits on a structured-output constraint and the compile pool, without a model (the
embedded SmolLM2's tokenizer only): what each limit refuses, that a rule chain that once
overflowed the compile thread's stack compiles, that a grammar is proven usable before it is
cached, that the queue is bounded and drops a compile nobody waits for, and that a failure is
cached as a failure, never as a valid grammar.

The same attacks against a real server: tests/adversarial/test_grammars.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("llguidance")

from pagedkv.errors import ConfigError, OverloadedError, StructuredOutputError  # noqa: E402
from pagedkv.structured.compiler import GrammarCompiler  # noqa: E402
from pagedkv.structured.limits import (  # noqa: E402
    MAX_CHOICES,
    MAX_CONSTRAINT_NODES,
    MAX_GRAMMAR_ALTERNATIVES,
    MAX_REPETITION,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_PROPERTIES,
    check_complexity,
    repetition,
)
from pagedkv.structured.params import StructuredOutputsParams as P  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from pagedkv.worker.model_files import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture
def compiler(tokenizer: Any) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], workers=1, max_queued=1)
    yield c
    c.shutdown()


def lark_chain(n: int) -> str:
    """``start`` -> r0 -> r1 -> ... -> rn -> "a": compiled by recursion, one frame per link."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def prop_chain(n: int, tag: str = "") -> dict[str, Any]:
    """A schema of ``n`` objects, each the one property of the one before ($ref to $ref)."""
    defs = {f"d{i}": {"properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]} for i in range(n)}
    defs[f"d{n}"] = {"const": tag or 1}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def refused(params: P, match: str) -> None:
    with pytest.raises(StructuredOutputError, match=match):
        check_complexity(params)


def test_repetition_counts_nested_and_sibling_bounds() -> None:
    assert repetition("a{1000000}") == 1_000_000
    assert repetition("(a{300}){1000}") == 300_000  # nested: multiplied
    assert repetition("(a{10}b)" * 20) == 200  # siblings: added
    assert repetition('("ab" | "cd")~5000') == 5000 and repetition("x~10..20") == 20
    assert repetition(r"a\{5}") == 0 and repetition("((a){2}){3}") == 6 and repetition("(x)a{3}") == 3


def test_each_limit_refuses_by_name() -> None:
    refused(P(regex=f"a{{{MAX_REPETITION + 1}}}"), "counted repetitions")
    refused(P(grammar=f'start: "a"~{MAX_REPETITION + 1}'), "counted repetitions")
    refused(P(grammar='root ::= "a"{100000}'), "counted repetitions")
    refused(P(json={"type": "string", "pattern": "^a{1000000}$"}), "counted repetitions")
    alternatives = MAX_GRAMMAR_ALTERNATIVES + 1
    refused(P(grammar="root ::= " + " | ".join(f'"w{i}"' for i in range(alternatives + 1))), "alternatives")
    refused(P(grammar="start: " + '("a") ' * (MAX_CONSTRAINT_NODES + 1)), "rules, groups")
    deep: Any = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    refused(P(json=deep), "levels of nesting")
    many = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(MAX_SCHEMA_PROPERTIES + 1)}}
    refused(P(json=many), "properties in one object")
    with pytest.raises(ConfigError, match="choice must hold"):
        P(choice=[f"c{i}" for i in range(MAX_CHOICES + 1)])
    # Within the limits: nothing refused.
    check_complexity(P(regex=f"a{{{MAX_REPETITION}}}"))
    check_complexity(P(grammar=lark_chain(5000)))
    check_complexity(P(json=prop_chain(2000)))


def test_a_deeply_nested_schema_is_a_config_error_before_and_after_parsing() -> None:
    with pytest.raises(ConfigError, match="nested too deeply"):
        P(json="[" * 5000 + "]" * 5000)  # json.loads recurses: refused, not a RecursionError
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(5000):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(ConfigError, match="nested too deeply"):
        P(json=deep)


def test_a_chain_past_the_default_stack_compiles(compiler: GrammarCompiler) -> None:
    # ~2,650 chained rules overflowed a default 8 MB thread stack: the process died.
    grammar = compiler.compile(P(grammar=lark_chain(6000))).result(timeout=120)
    assert grammar.kind == "grammar"
    compiler.compile(P(json=prop_chain(3000))).result(timeout=120)


@pytest.mark.parametrize(
    "constraint, reason",
    [
        ({"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "no output can complete it"),
        ({"grammar": 'start: ""'}, "admits only the empty output"),
        ({"regex": "()"}, "admits only the empty output"),
        # A JSON anyOf of 3,000 objects passes every text limit; its first token's Earley row
        # holds 3,000 items (> max_items_in_row): found by the compile's first tokens.
        (
            {
                "json": {
                    "anyOf": [
                        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                        for i in range(3000)
                    ]
                }
            },
            "Current row has 3000 items",
        ),
    ],
)
def test_grammars_that_would_fail_later_fail_at_compile_and_stay_failed(
    compiler: GrammarCompiler, constraint: dict[str, Any], reason: str
) -> None:
    params = P(**constraint)
    with pytest.raises(StructuredOutputError, match=reason):
        compiler.compile(params).result(timeout=60)
    hits = compiler.num_cache_hits
    with pytest.raises(StructuredOutputError, match=reason):  # the same answer, from the cache
        compiler.compile(params).result(timeout=60)
    assert compiler.num_cache_hits == hits + 1


def test_many_choices_are_one_lexeme(compiler: GrammarCompiler) -> None:
    # As a rule of alternatives, more than 1,999 choices failed at the first token.
    grammar = compiler.compile(P(choice=[f"choice-{i}" for i in range(MAX_CHOICES)])).result(timeout=60)
    matcher = grammar.new_matcher()
    assert matcher.try_consume_tokens(compiler.tokenizer().tokenize_str("choice-4095")) > 0
    assert not matcher.is_error()


def test_the_queue_is_bounded_and_a_compile_nobody_waits_for_is_dropped(compiler: GrammarCompiler) -> None:
    # One thread, one queue slot. The thread is busy with a slow compile (~0.4 s of a $ref chain,
    # and the tokenizer first; the acquires below take microseconds), so the next compile waits and the one after is refused.
    running = compiler.acquire(P(json=prop_chain(3000, "running")))
    deadline = time.monotonic() + 60
    while not running.future.running():  # the thread took it (it starts with the first compile)
        assert time.monotonic() < deadline and not running.future.done()
        time.sleep(0.001)
    queued = compiler.acquire(P(regex="[a-z]+"))
    with pytest.raises(OverloadedError, match="max_queued_compiles=1"):
        compiler.acquire(P(regex="[0-9]+"))
    assert compiler.num_refused == 1
    # A constraint already queued is joined, never refused; its compile survives one release.
    joined = compiler.acquire(P(regex="[a-z]+"))
    assert joined.future is queued.future
    joined.release()
    assert not queued.future.cancelled()
    # Its last waiter goes away before it starts: dropped from the queue and the cache.
    queued.release()
    assert queued.future.cancelled() and compiler.num_cancelled == 1 and compiler.num_queued == 0
    again = compiler.acquire(P(regex="[a-z]+"))
    assert again.future is not queued.future
    running.future.result(timeout=120)
    again.future.result(timeout=60)
    for handle in (running, again):
        handle.release()
    # Released after it ran: kept (a cache hit), not cancelled.
    assert compiler.compile(P(regex="[a-z]+")).result() is again.future.result()


def test_a_grammar_that_failed_a_request_is_evicted(compiler: GrammarCompiler) -> None:
    params = P(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    grammar = compiler.compile(params).result(timeout=60)
    assert compiler.compile(params).result() is grammar
    compiler.evict(grammar)
    assert compiler.compile(params).result(timeout=60) is not grammar


def test_compiles_are_shared_within_a_tenant_only(compiler: GrammarCompiler) -> None:
    # Keyed by the request's cache salt, as the prefix cache is: a tenant never hits (or joins)
    # a compile another tenant's constraint started, so its time tells nothing about others.
    params = P(regex="(yes|no)")
    a = compiler.compile(params, tenant="tenant-a").result(timeout=60)
    hits = compiler.num_cache_hits
    assert compiler.compile(params, tenant="tenant-a").result() is a
    assert compiler.num_cache_hits == hits + 1
    b = compiler.compile(params, tenant="tenant-b").result(timeout=60)
    unsalted = compiler.compile(params).result(timeout=60)
    assert b is not a and unsalted is not a and unsalted is not b
    assert compiler.num_cache_hits == hits + 1
    assert (a.key[0], b.key[0], unsalted.key[0]) == ("tenant-a", "tenant-b", None) and a.kind == "regex"


def test_unsupported_feature_errors_are_short(compiler: GrammarCompiler) -> None:
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(P(json={"type": "array", "uniqueItems": True})).result(timeout=60)
    assert "uniqueItems" in str(info.value) and len(str(info.value)) < 2200
    assert json.dumps(str(info.value))  # plain text


def test_a_compile_that_raises_is_survived_reported_and_not_cached(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_one = compiler._compile
    broken = {"on": True}

    def flaky(params: P, key: Any) -> Any:
        if broken["on"]:
            raise RuntimeError("llguidance did something unexpected")
        return compile_one(params, key)

    monkeypatch.setattr(compiler, "_compile", flaky)
    params = P(regex="[a-c]+")
    with pytest.raises(StructuredOutputError, match="could not be compiled: llguidance did something"):
        compiler.compile(params).result(timeout=60)
    health = compiler.background.health()
    assert health["status"] == "ok" and health["threads"]["pagedkv-grammar-0"]["errors"] == 1, health
    broken["on"] = False  # not cached: the same constraint compiles now
    assert compiler.compile(params).result(timeout=60).kind == "regex"


def test_a_dead_compile_thread_makes_health_degraded(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dies(params: P, key: Any) -> Any:
        raise SystemExit("gone")

    monkeypatch.setattr(compiler, "_compile", dies)
    future = compiler.compile(P(regex="[x-z]+"))
    with pytest.raises(SystemExit):  # its waiter is told
        future.result(timeout=60)
    deadline = time.monotonic() + 30
    while compiler.background.health()["status"] == "ok":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert compiler.background.health()["dead"] == ["pagedkv-grammar-0"]
