"""Structured outputs through `pagedkv serve` (SmolLM2, float32, CPU), driven by real clients.

- ``openai``'s ``chat.completions.parse`` with a pydantic model (``response_format`` json_schema,
  strict), ``json_object``, a streamed schema reassembled from its deltas;
- vLLM's ``structured_outputs`` (regex, choice) and older ``guided_*`` fields on both endpoints;
- LangChain's ``with_structured_output(method="json_schema")``;
- a schema with a feature the grammar engine does not implement, a malformed ``response_format``
  and two constraints at once: a 400 naming the field, and the server keeps serving;
- ``/metrics`` exposes the compile and mask time histograms.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pydantic = pytest.importorskip("pydantic")

from pagedkv.server.launch import ServerProcess  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

API_KEY = "structured-key"
MODEL = "smollm2"
TIMEOUT = 120.0


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    mood: Literal["happy", "sad", "calm"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = [
        "--served-model-name", MODEL, "--dtype", "float32", "--device", "cpu", "--max-model-len", "1024",
        "--kv-cache-memory", "64MiB", "--max-num-seqs", "8", "--api-key", API_KEY, "--log-level", "warning",
    ]  # fmt: skip
    with ServerProcess(args, start_timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_openai_parse_with_a_pydantic_model(client: Any) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=ask("Invent a person: name, age and mood, as JSON."),
        response_format=Person,
        temperature=1.0,
        seed=5,
        max_tokens=128,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person), message.content
    assert completion.choices[0].finish_reason == "stop"


def test_json_object_and_streamed_schema(client: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask('Reply with a JSON object with one key, "color", naming a color.'),
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=200,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("Invent a person as JSON."),
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
        temperature=1.0,
        seed=9,
        max_tokens=128,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Person.model_validate_json(text)


def test_vllm_fields_on_both_endpoints(client: Any) -> None:
    completion = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=16,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", completion.choices[0].text)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ask("Is the sky blue?"),
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert chat.choices[0].message.content in ("yes", "no")
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ask("Pick a fruit."),
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=4,
        extra_body={"structured_outputs": {"choice": ["apple", "pear", "plum"]}},
    )
    assert len(chat.choices) == 3
    assert all(c.message.content in ("apple", "pear", "plum") for c in chat.choices)


def test_langchain_with_structured_output(server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, temperature=0.0, max_tokens=128, max_retries=0
    )
    structured = model.with_structured_output(Person, method="json_schema")
    person = structured.invoke("Invent a person: name, age and mood.")
    assert isinstance(person, Person)


def test_bad_constraints_are_a_400_naming_the_field(client: Any) -> None:
    cases = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "uniqueItems",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs", "regex"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "not several"),
    ]
    for extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4, extra_body=extra)
        error = info.value.body
        assert error["param"] == param, error
        assert words in error["message"], error
    ok = client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_metrics_show_compile_and_mask_times(server: ServerProcess, client: Any) -> None:
    client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=4, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}}
    )
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT).text
    metrics = parse_metrics(text)
    compile_count = [v for k, v in metrics.items() if k.startswith("pagedkv:structured_output_compile_seconds_count")]
    mask_count = [v for k, v in metrics.items() if k.startswith("pagedkv:structured_output_mask_seconds_count")]
    assert compile_count and compile_count[0] >= 1
    assert mask_count and mask_count[0] >= 1
