"""Structured outputs through `pagedkv serve` (SmolLM2, float32, CPU), driven by real clients.

- ``openai``'s ``chat.completions.parse`` with a pydantic model (``response_format`` json_schema,
  strict), ``json_object``, a streamed schema reassembled from its deltas;
- vLLM's ``structured_outputs`` (regex, choice) and older ``guided_*`` fields on both endpoints;
- LangChain's ``with_structured_output(method="json_schema")``;
- a schema with a feature the grammar engine does not implement, a malformed ``response_format``
  and two constraints at once: a 400 naming the field, and the server keeps serving;
- ``/metrics`` exposes the compile and mask time histograms;
- tool calls: ``tool_choice`` ``required`` (with and without parallel calls) and a named function,
  every call's arguments valid under its tool's schema; a streamed call reassembled from
  OpenAI's deltas; a conversation with an assistant ``tool_calls`` turn and ``tool`` results;
  LangChain's ``bind_tools`` and ``with_structured_output(method="function_calling")``; LiteLLM.
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

from test_tool_calls import ADD, CONVERSATION, WEATHER  # noqa: E402

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
    step_count = [v for k, v in metrics.items() if k.startswith("pagedkv:structured_output_step_seconds_count")]
    assert step_count and step_count[0] >= 1


# ----------------------------------------------------------------------------- tool calls

TOOLS = [WEATHER, ADD]  # tests/serving/test_tool_calls.py


def check_call(call: Any) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_tool_calls(client: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("What is the weather in Paris?"),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=160,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    # Parallel calls allowed: SmolLM2 greedy repeats its call until max_tokens; every call
    # it completed is returned, each valid.
    several = client.chat.completions.create(
        model=MODEL,
        messages=ask("What is the weather in Paris?"),
        tools=TOOLS,
        tool_choice="required",
        temperature=0.0,
        max_tokens=90,
    )
    assert len(several.choices[0].message.tool_calls) >= 2
    for call in several.choices[0].message.tool_calls:
        check_call(call)
    named = client.chat.completions.create(
        model=MODEL,
        messages=ask("Add 2 and 3."),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        temperature=1.0,
        seed=2,
        max_tokens=80,
    )
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add"
    check_call(calls[0])


def test_streamed_tool_calls_reassemble(client: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("Weather in Oslo, please."),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=6,
        max_tokens=160,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id:  # id and name come first, once
                    assert not entry["arguments"]
                    entry["id"], entry["name"] = delta.id, delta.function.name
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        call = openai.types.chat.ChatCompletionMessageToolCall(
            id=entry["id"], type="function", function={"name": entry["name"], "arguments": entry["arguments"]}
        )
        check_call(call)
    # The client's own stream helper, which assembles the calls from the deltas itself.
    with client.chat.completions.stream(
        model=MODEL,
        messages=ask("Add 7 and 8."),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0.0,
        max_tokens=80,
    ) as helper:
        final = helper.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    (assembled,) = final.choices[0].message.tool_calls
    assert assembled.function.name == "add"
    check_call(assembled)


def test_a_conversation_with_tool_results(client: Any) -> None:
    messages = CONVERSATION
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=24
    )
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0.0, max_tokens=24)
    for call in auto.choices[0].message.tool_calls or []:
        assert call.function.name in ("get_weather", "add")


def test_langchain_bind_tools_and_function_calling(server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, temperature=0.0, max_tokens=160, max_retries=0
    )
    message = model.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False).invoke(
        "What is the weather in Rome?"
    )
    assert message.tool_calls and message.tool_calls[0]["name"] in ("get_weather", "add")
    person = model.with_structured_output(Person, method="function_calling").invoke("Invent a person.")
    assert isinstance(person, Person)


def test_litellm_tool_calls(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    response = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=server.url + "/v1",
        api_key=API_KEY,
        messages=ask("Add 40 and 2."),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=120,
    )
    calls = response.choices[0].message.tool_calls
    assert calls and calls[0].function.name in ("get_weather", "add")
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_bad_tool_requests_are_a_400(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=ask("hi"),
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert info.value.body["param"] == "response_format"
