"""Tool calling's pieces without a server (pagedkv.server.tools): the request checks, the grammar
of ``required`` / a named function (what it accepts and refuses, on SmolLM2's tokenizer), the
hermes rendering for a template without tools, and the hermes parser, whole and streamed (the
stream's deltas reassemble to the whole parse however the text is split).
"""

from __future__ import annotations

import json
import random

import pytest

from pagedkv.server.tools import (
    HermesToolParser,
    ToolError,
    render_without_tool_template,
    template_knows_tools,
    tool_request,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
# A user question, the assistant's call, and the tool's result.
CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
OUTPUT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "extra": {"nested": [1, 2, "}"]}}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
    "</tool_call>\n"
)


def test_request_checks() -> None:
    assert tool_request(None, None, None) is None
    request = tool_request([WEATHER, ADD], None, None)
    assert request is not None and request.choice == "auto" and request.parallel and request.constraint() is None
    named = tool_request([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, False)
    assert named is not None and named.choice == "add" and named.constraint() is not None
    for tools, choice, param in [
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools"),
        ([WEATHER, WEATHER], None, "tools"),
        ([{"type": "retrieval"}], None, "tools"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "add"}}, "tool_choice"),
        (None, "required", "tool_choice"),
        ([WEATHER] * 200, None, "tools"),
    ]:
        with pytest.raises(ToolError) as info:
            tool_request(tools, choice, None)
        assert info.value.param == param


def test_required_grammar_accepts_calls_and_refuses_others() -> None:
    llguidance = pytest.importorskip("llguidance")
    from transformers import AutoTokenizer

    from pagedkv.worker.model_files import default_model_dir

    hf = AutoTokenizer.from_pretrained(default_model_dir())
    from llguidance.hf import from_tokenizer

    tokenizer = from_tokenizer(hf, n_vocab=len(hf))

    def accepts(request, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, request.constraint().to_grammar(), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ok = matcher.consume_tokens(hf.encode(text, add_special_tokens=False))
        return bool(ok and matcher.is_accepting())

    required = tool_request([WEATHER, ADD], "required", True)
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    two = one + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    assert accepts(required, one) and accepts(required, two)
    assert not accepts(required, '<tool_call>\n{"name": "add", "arguments": {"a": "x", "b": 2}}\n</tool_call>\n')
    assert not accepts(required, '<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>\n')
    assert not accepts(required, "Hello")
    single = tool_request([WEATHER, ADD], "required", False)
    assert accepts(single, one) and not accepts(single, two)
    named = tool_request([WEATHER, ADD], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert not accepts(named, one)
    assert accepts(named, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n')


def test_hermes_rendering_without_a_tool_template() -> None:
    request = tool_request([WEATHER], None, None)
    messages = [
        {"role": "system", "content": "Be brief."},
        *CONVERSATION,
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12 C"}]},
    ]
    out = render_without_tool_template(messages, request)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12 C\n</tool_response>"
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)
    assert render_without_tool_template(messages[:2], None) == messages[:2]
    assert template_knows_tools("{% if tools %}...{% endif %}") and not template_knows_tools("{{ messages }}")


def test_hermes_parser_whole_and_streamed() -> None:
    content, calls = HermesToolParser().parse(OUTPUT)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "extra": {"nested": [1, 2, "}"]}}
    assert json.loads(calls[1].arguments) == {"a": 1, "b": 2}
    assert HermesToolParser().parse("no calls here") == ("no calls here", [])
    assert HermesToolParser().parse("<tool_call>not json</tool_call>")[1] == []
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), rng.randint(1, 40)))
        parser = HermesToolParser()
        deltas = []
        for i, j in zip([0, *cuts], [*cuts, len(OUTPUT)]):
            deltas += parser.feed(OUTPUT[i:j])
        deltas += parser.finish()
        text = "".join(d.get("content", "") for d in deltas)
        names, arguments = {}, {}
        for d in deltas:
            for call in d.get("tool_calls", []):
                if "id" in call:  # the header comes first, with the name
                    assert call["index"] not in names and call["index"] not in arguments
                    names[call["index"]] = call["function"]["name"]
                arguments[call["index"]] = arguments.get(call["index"], "") + call["function"]["arguments"]
        assert text.strip() == "Let me check."
        assert names == {0: "get_weather", 1: "add"}
        assert [json.loads(arguments[i]) for i in (0, 1)] == [json.loads(c.arguments) for c in calls]


def streamed(parser: HermesToolParser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the (name, arguments) calls that ``parser``'s deltas of ``text``, fed
    in the pieces ``cuts`` makes, add up to."""
    deltas = []
    for i, j in zip([0, *cuts], [*cuts, len(text)]):
        deltas += parser.feed(text[i:j])
    deltas += parser.finish()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            if "id" in call:
                names[call["index"]] = call["function"]["name"]
            arguments[call["index"]] = arguments.get(call["index"], "") + call["function"]["arguments"]
    return "".join(d.get("content", "") for d in deltas), [(names[i], arguments[i]) for i in sorted(names)]


@pytest.mark.parametrize(
    "output",
    [
        OUTPUT,
        OUTPUT + "Done.",  # text after the dropped call stays content
        OUTPUT + '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}',  # a third call, unclosed
        OUTPUT.replace('"add", "arguments": {"a": 1, "b": 2}', '"add", "arguments": {"a": 1, "b": }'),  # not JSON
    ],
)
def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed(output: str) -> None:
    # parallel_tool_calls=false: the first call, whole or streamed however the text is cut;
    # the calls after it are dropped with their text, a block that is not a call stays content.
    request = tool_request([WEATHER, ADD], "auto", False)
    assert request is not None and request.max_calls == 1
    content, calls = HermesToolParser(max_calls=request.max_calls).parse(output)
    assert [c.name for c in calls] == ["get_weather"]
    whole = [(c.name, c.arguments) for c in calls]
    rng = random.Random(1)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(output)), rng.randint(1, 40)))
        text, got = streamed(HermesToolParser(max_calls=1), output, cuts)
        assert [name for name, _ in got] == ["get_weather"]
        assert [json.loads(a) for _, a in got] == [json.loads(a) for _, a in whole]
        assert text.strip().replace("\n", "") == (content or "").replace("\n", ""), (text, content)
    # Parallel calls allowed: every call, both ways.
    _, every = HermesToolParser().parse(OUTPUT)
    assert [c.name for c in every] == ["get_weather", "add"]


def test_a_template_that_renders_tools_gets_them() -> None:
    from transformers import AutoTokenizer

    from pagedkv.engine.prompts import chat_prompt
    from pagedkv.worker.model_files import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }}]{% endfor %}{% endfor %}"
    )
    assert template_knows_tools(template)
    rendered = chat_prompt(tokenizer, CONVERSATION, chat_template=template, tools=[WEATHER, ADD])["prompt"]
    assert rendered == "[tool get_weather][tool add]<user>Weather in Oslo?<assistant>[call get_weather]<tool>sunny"
