"""Attacks 4, 5 and 6: grammars that crashed the process, broke their own constraint, or
filled the compile queue.

4. ~3,000 chained Lark rules (or JSON ``$ref`` links) overflowed the compile thread's stack: a
   segfault, every request lost. Now they compile on threads with a deep stack, and past the
   node limit they are a 400.
5. Over-limit grammars (``a{1000000}``, 20,000 GBNF alternatives, a ``$ref`` cycle, an empty
   grammar) gave a 500 mid-generation, then a 200 with ``""`` from the cache. Now each is a 400
   before any token, the same 400 every time; a grammar that breaks mid-generation anyway
   fails its request alone (a 400) and is not cached as valid. 2,500 choices are served.
6. Slow grammars sent by a client that leaves sat in an unbounded queue: everyone else's
   structured requests timed out. Now the queue is bounded (503 past it) and a compile whose
   every client left is dropped.

Lower: a schema 5,000 levels deep in the JSON text of ``response_format`` is a 400.

One real server (SmolLM2) for the module; every attack runs through the harness beside the
honest client (its text unchanged, ``/health`` ok, no block lost). An honest *structured*
request, on a constraint nobody compiled before, gets its unattacked text after each attack.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from harness import HONEST_PROMPT, Attacks, error_of, post_json  # noqa: E402

from pagedkv.server.launch import ServerProcess  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

MAX_QUEUED_COMPILES = 6
FLAGS = [
    "--dtype", "float32", "--device", "cpu", "--block-size", "16", "--num-blocks", "64",
    "--max-model-len", "256",
    "--structured-outputs-config", json.dumps({"max_queued_compiles": MAX_QUEUED_COMPILES}),
]  # fmt: skip
# The honest structured request: a regex the greedy model answers " Paris" to. Each call adds an
# alternative nobody takes, so its constraint is new (compiled, not a cache hit) every time.
HONEST_REGEX = r" (Paris|London|Rome)"


_honest_calls = iter(range(10**6))


def structured_text(url: str, constraint: dict[str, Any], *, field: str = "structured_outputs") -> httpx.Response:
    body = {"prompt": HONEST_PROMPT, "max_tokens": 12, "temperature": 0.0, field: constraint}
    return post_json(url + "/v1/completions", body)


def honest_structured(url: str) -> str:
    """The honest structured request, on a constraint not compiled before."""
    fresh = HONEST_REGEX.replace(")", f"|Zq{next(_honest_calls)}x)")
    r = structured_text(url, {"regex": fresh})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def honest_structured_text(server: ServerProcess) -> str:
    text = honest_structured(server.url)
    assert text == " Paris", text
    return text


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def test_long_rule_chains_compile_and_the_server_lives(
    server: ServerProcess, attacks: Attacks, honest_structured_text: str
) -> None:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
    defs["d3000"] = {"enum": [7]}

    def attack() -> list[httpx.Response]:
        return [
            structured_text(server.url, {"grammar": lark_chain(3000)}),  # the process died here
            structured_text(server.url, {"json": {"$ref": "#/$defs/d0", "$defs": defs}}),
            structured_text(server.url, {"grammar": "start: " + '("a") ' * 20001}),  # past the node limit
        ]

    chain, refs, too_many = attacks.run("grammar-rule-chain", attack).result
    assert chain.status_code == 200 and chain.json()["choices"][0]["text"] == "a", chain.text
    assert refs.status_code == 200 and refs.json()["choices"][0]["text"] == "7", refs.text
    error = error_of(too_many, 400)
    assert error["param"] == "structured_outputs" and "rules, groups" in error["message"], error
    assert honest_structured(server.url) == honest_structured_text


# Each is refused before any token, naming the field, with the same answer the second time.
OVER_LIMIT = {
    "regex-a-million": ({"regex": "a{1000000}"}, "counted repetitions"),
    "lark-repeat": ({"grammar": 'start: "a"~100000'}, "counted repetitions"),
    "gbnf-20000-alternatives": (
        {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(20000))},
        "alternatives",
    ),
    "ref-cycle": ({"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}, "no output can complete it"),
    "empty-grammar": ({"grammar": 'start: ""'}, "admits only the empty output"),
    "empty-regex": ({"regex": "()"}, "admits only the empty output"),
    "too-many-choices": ({"choice": [f"c{i}" for i in range(4097)]}, "choice must hold"),
    "deep-schema-text": ({"json": '{"items":' * 5000 + "{}" + "}" * 5000}, "nested too deeply"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OVER_LIMIT))
def test_over_limit_grammars_are_the_same_400_every_time(server: ServerProcess, attacks: Attacks, name: str) -> None:
    constraint, reason = OVER_LIMIT[name]

    def attack() -> list[httpx.Response]:
        return [structured_text(server.url, constraint) for _ in range(2)]

    first, second = attacks.run(f"grammar-{name}", attack).result
    error = error_of(first, 400)
    assert error["param"] == "structured_outputs" and reason in error["message"], error
    assert second.status_code == 400 and second.json()["error"] == error  # never cached as valid


def test_a_deep_schema_in_response_format_is_a_400_naming_it(server: ServerProcess, attacks: Attacks) -> None:
    schema = '{"items":' * 5000 + "{}" + "}" * 5000  # JSON text: Python's json recursed on it (500)
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    report = attacks.run(
        "grammar-deep-response-format", lambda: structured_text(server.url, response_format, field="response_format")
    )
    error = error_of(report.result, 400)
    assert error["param"] == "response_format" and "nested too deeply" in error["message"], error


def test_many_choices_are_served(server: ServerProcess, attacks: Attacks) -> None:
    choices = [f"option {i}" for i in range(2500)]  # past 1,999 every request failed at its first token

    report = attacks.run("grammar-2500-choices", lambda: structured_text(server.url, {"choice": choices}))
    assert report.result.status_code == 200, report.result.text
    assert report.result.json()["choices"][0]["text"] in choices


def test_a_constraint_that_breaks_mid_generation_fails_alone_and_is_not_cached(
    server: ServerProcess, attacks: Attacks, honest_structured_text: str
) -> None:
    # Within every text limit, and its first tokens compile and mask: the anyOf of 3,000
    # objects is reached only after the string, where its Earley row passes max_items_in_row.
    shapes = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(3000)
    ]
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"anyOf": shapes}},
        "required": ["a", "b"],
    }
    constraint = {"json": schema, "disable_any_whitespace": True}

    def attack() -> list[httpx.Response]:
        return [structured_text(server.url, constraint) for _ in range(2)]

    for r in attacks.run("grammar-breaks-mid-generation", attack).result:
        error = error_of(r, 400)  # not a 200 with text that does not match
        assert error["code"] == "StructuredOutputError" and "max is 2000" in error["message"], error
    assert honest_structured(server.url) == honest_structured_text


def slow_schema(tag: int) -> dict[str, Any]:
    """A schema within every limit that takes ~1.2 s to compile (10 objects of 1,000 optional
    properties: llguidance compiles them in quadratic time), different for each ``tag``."""
    objects = {
        f"p{j}": {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(1000)}}
        for j in range(10)
    }
    objects["p0"]["properties"]["k0"] = {"const": tag}
    return {"type": "object", "properties": objects}


def cancelled_compiles(server: ServerProcess) -> float:
    m = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
    return m.get("pagedkv:structured_output_compiles_cancelled_total{}", 0.0)


def test_a_flood_of_slow_grammars_that_leaves_is_dropped(
    server: ServerProcess, attacks: Attacks, honest_structured_text: str
) -> None:
    count = 2 * MAX_QUEUED_COMPILES + 4  # past the queue: 2 running, 6 queued, the rest refused
    bodies = [
        json.dumps({"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": slow_schema(i)}})
        for i in range(count)
    ]
    before = cancelled_compiles(server)

    def flood() -> list[int | str]:
        results: list[int | str] = [""] * count

        def one(i: int) -> None:
            try:
                # Each request leaves after 0.5 s: the compiles queued behind the two running
                # ones (1.2 s each) had not started, and must go with it.
                r = httpx.post(
                    server.url + "/v1/completions",
                    content=bodies[i],
                    headers={"Content-Type": "application/json"},
                    timeout=httpx.Timeout(60.0, read=0.5),
                )
                results[i] = r.status_code
                if r.status_code == 503:
                    assert r.json()["error"]["code"] == "server_overloaded", r.text
            except httpx.TimeoutException:
                results[i] = "left"

        threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    results = attacks.run("grammar-flood-and-leave", flood).result
    # Refused at once past the queue (503, retry later), or left; a compile that ended in time
    # is served (a bounded answer).
    assert set(results) <= {503, "left", 200}, results
    assert results.count("left") >= 1, results
    # The honest structured request right after: not behind the compiles of a client that left.
    assert honest_structured(server.url) == honest_structured_text
    assert cancelled_compiles(server) > before
    assert re.fullmatch(r" (Paris|London|Rome)", honest_structured_text)
