"""Tool calling on ``/v1/chat/completions``: tools into the prompt, calls out of the output.

- **Request.** ``tools`` (OpenAI's ``{"type": "function", "function": {"name", "description",
  "parameters"}}``, at most :data:`MAX_TOOLS`), ``tool_choice`` (``"none"``, ``"auto"`` — the
  default with tools —, ``"required"``, or ``{"type": "function", "function": {"name": ...}}``)
  and ``parallel_tool_calls`` (default true) become a :class:`ToolRequest`.
- **Prompt.** A chat template that knows tools (its source uses ``tools``) gets them as
  transformers passes them (``apply_chat_template(tools=...)``), with assistant ``tool_calls``
  and ``role: "tool"`` messages as they are. A template without a tools section (SmolLM2's) gets
  the hermes convention written out by :func:`render_without_tool_template`: a system prompt that
  lists the tools as JSON in ``<tools></tools>`` and asks for each call as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; earlier calls are written back
  in that form and tool results as a user turn of ``<tool_response>`` blocks.
- **Enforcement.** ``required`` and a named function are a grammar (:meth:`ToolRequest.constraint`):
  one call (or, with ``parallel_tool_calls``, one or more) in the hermes format, each call's JSON
  matching ``{"name": <a tool's name>, "arguments": <its parameters schema>}``. ``auto`` is not
  constrained: the output is parsed (the ``hermes`` parser, ``pagedkv serve --tool-call-parser``).
- **Output.** :class:`HermesToolParser` splits the text into content and calls, whole
  (:meth:`~HermesToolParser.parse`) or as a stream (:meth:`~HermesToolParser.feed`): content
  deltas, then per call a first delta with its ``id``, ``type`` and ``function.name`` (and empty
  ``arguments``), then argument fragments whose concatenation is the call's arguments JSON.
  A choice that made calls ends with ``finish_reason: "tool_calls"``. With
  ``parallel_tool_calls: false`` the parser keeps the first call and drops the ones after it
  (their text too), whole or streamed alike (``max_calls``), as vLLM does: the same request
  gives the same calls either way.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedkv.structured.params import StructuredOutputsParams

__all__ = [
    "MAX_TOOLS",
    "TOOL_CALL_PARSERS",
    "HermesToolParser",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolRequest",
    "render_without_tool_template",
    "template_knows_tools",
    "tool_request",
]

MAX_TOOLS = 128
# `pagedkv serve --tool-call-parser` choices (vLLM's flag): how a choice's text becomes calls.
TOOL_CALL_PARSERS = ("hermes",)
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# The head of a hermes call's JSON, up to where its arguments start.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_ANY_OBJECT = {"type": "object"}


class ToolError(ValueError):
    """A malformed ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass
class ToolRequest:
    """A chat request's tools and how they may be used (see the module docs)."""

    tools: list[Tool]
    # "none", "auto", "required", or the name of the one function to call.
    choice: str
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the tools are offered to the model (and its output parsed for calls)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def max_calls(self) -> int | None:
        """The most calls a choice returns: 1 without ``parallel_tool_calls``, else no limit."""
        return None if self.parallel else 1

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of ``required`` / a named function (None for ``auto`` and ``none``)."""
        if not self.forced:
            return None
        tools = self.tools if self.choice == "required" else [t for t in self.tools if t.name == self.choice]
        shapes = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters or _ANY_OBJECT},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        repeat = "+" if self.parallel and self.choice == "required" else ""
        lark = (
            f"start: call{repeat}\n"
            f"call: {json.dumps(_OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + _CLOSE + chr(10))}\n"
        )
        return StructuredOutputsParams(grammar=lark)


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The request's :class:`ToolRequest`, None without tools (then ``tool_choice`` may only be
    ``"none"`` / ``"auto"``); ToolError naming the field for a malformed one."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools per request, got {len(tools)}")
    parsed: list[Tool] = []
    for i, entry in enumerate(tools):
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError("tools", f"tools[{i}]: a function name is 1-64 of A-Z a-z 0-9 _ . -, got {name!r}")
        if any(t.name == name for t in parsed):
            raise ToolError("tools", f"tools[{i}]: the function name {name!r} is given twice")
        parameters = function.get("parameters") or _ANY_OBJECT
        if not isinstance(parameters, dict):
            raise ToolError("tools", f"tools[{i}]: parameters must be a JSON schema object")
        description = function.get("description")
        parsed.append(Tool(name, description if isinstance(description, str) else None, parameters))
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError(
                "tool_choice",
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            )
        if not any(t.name == name for t in parsed):
            raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    return ToolRequest(parsed, choice, parallel)


def template_knows_tools(chat_template: Any) -> bool:
    """Whether a chat template renders tools itself (its source uses the ``tools`` variable)."""
    return isinstance(chat_template, str) and re.search(r"\btools\b", chat_template) is not None


def _system_prompt(tools: list[Tool]) -> str:
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help with the user's request. The functions you can call are "
        "listed in <tools></tools> as JSON signatures:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, write a JSON object with its name and its arguments between "
        "<tool_call></tool_call> tags, one call per pair of tags:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<the arguments as JSON>}}\n</tool_call>'
    )


def _text(content: Any) -> str:
    """A message's content as text (OpenAI's list of text parts joined, None as empty)."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def render_without_tool_template(messages: list[dict[str, Any]], tools: ToolRequest | None) -> list[dict[str, Any]]:
    """``messages`` for a template without a tools section, in the hermes convention (module
    docs): the tools in the system prompt (merged into the first system message, if any),
    assistant ``tool_calls`` as ``<tool_call>`` blocks after its content, each run of ``tool``
    messages as one user turn of ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = []
            for call in message["tool_calls"]:
                function = call.get("function", {}) if isinstance(call, dict) else {}
                arguments = function.get("arguments", "{}")
                try:
                    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                except ValueError:
                    pass  # written back as the string the client sent
                body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
                blocks.append(f"{_OPEN}\n{body}\n{_CLOSE}")
            content = _text(message.get("content"))
            text = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    for message in out:
        message.pop("_tool_responses", None)
    if tools is not None and tools.active:
        prompt = _system_prompt(tools.tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class HermesToolParser:
    """Splits one choice's output into content and hermes ``<tool_call>`` calls, whole or as a
    stream. Streaming invariant: what :meth:`feed` has emitted of a call's arguments is always a
    prefix of its final arguments (text is held back while it could still be the call's closing
    ``}`` or ``</tool_call>``).

    ``max_calls`` (``parallel_tool_calls: false``: 1): calls past it are dropped, with their
    text, by :meth:`parse` and :meth:`feed` alike (a streamed call past it is held back until
    its end shows whether it is a call, which is dropped, or not, which is content)."""

    max_calls: int | None = None
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _pos: int = 0  # text before this is emitted (content) or consumed (calls)
    _args_start: int | None = None  # in a call whose name was emitted: where its arguments start
    _args_sent: int = 0  # characters of the current call's arguments emitted

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output: (content without the calls, or None when empty; the calls). A
        block whose JSON does not parse as a call stays in the content."""
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        for match in re.finditer(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|$)", text, re.S):
            call = _call_from_json(match.group(1))
            if call is None:
                continue
            content.append(text[pos : match.start()])
            if self.max_calls is None or len(calls) < self.max_calls:
                calls.append(call)
            pos = match.end()
        content.append(text[pos:])
        joined = "".join(content).strip()
        return (joined or None), calls

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The deltas (OpenAI's ``delta`` bodies) of ``delta``, the newly generated text."""
        self.text += delta
        out: list[dict[str, Any]] = []
        while True:
            if self._args_start is None:
                start = self.text.find(_OPEN, self._pos)
                if start < 0:
                    end = len(self.text) - _partial_suffix(self.text, _OPEN)
                    if end > self._pos:
                        out.append({"content": self.text[self._pos : end]})
                        self._pos = end
                    return out
                if start > self._pos:
                    out.append({"content": self.text[self._pos : start]})
                head = _HEAD.match(self.text, start + len(_OPEN))
                if head is None:
                    self._pos = start  # wait for the call's name
                    if len(self.text) - start > 4096:  # not a call after all: content
                        out.append({"content": self.text[start:]})
                        self._pos = len(self.text)
                    return out
                if self._full:
                    # A call past max_calls: dropped whole once its end is here, as parse()
                    # drops it; a block that does not parse as a call is content, as there.
                    close = self.text.find(_CLOSE, head.end())
                    if close < 0:
                        self._pos = start  # wait for its end
                        return out
                    if _call_from_json(self.text[start + len(_OPEN) : close]) is None:
                        out.append({"content": self.text[start : close + len(_CLOSE)]})
                    self._pos = close + len(_CLOSE)
                    continue
                name = json.loads(f'"{head.group(1)}"')
                call = ToolCall(_call_id(), name, "")
                self.calls.append(call)
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": len(self.calls) - 1,
                                "id": call.id,
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }
                        ]
                    }
                )
                self._args_start, self._args_sent = head.end(), 0
                self._pos = head.end()
                continue
            close = self.text.find(_CLOSE, self._args_start)
            raw = self.text[self._args_start : close if close >= 0 else len(self.text)]
            final = close >= 0
            if final:
                body = raw.rstrip()
                ready = body[:-1] if body.endswith("}") else body  # the call object's own brace
            else:
                ready = _without_possible_end(raw)
            if len(ready) > self._args_sent:
                piece = ready[self._args_sent :]
                self.calls[-1].arguments += piece
                out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
                self._args_sent = len(ready)
            if not final:
                return out
            self._pos = close + len(_CLOSE)
            self._args_start = None

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of text held back at the end of the output (an unclosed call past
        ``max_calls`` is dropped, as :meth:`parse` drops it)."""
        if self._args_start is None and self._pos < len(self.text):
            piece = self.text[self._pos :]
            self._pos = len(self.text)
            if self._full and piece.startswith(_OPEN) and _call_from_json(piece[len(_OPEN) :]) is not None:
                return []
            return [{"content": piece}]
        return []

    @property
    def _full(self) -> bool:
        """Whether the calls so far reach ``max_calls``."""
        return self.max_calls is not None and len(self.calls) >= self.max_calls


def _call_from_json(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(_call_id(), value["name"], text)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _without_possible_end(raw: str) -> str:
    """``raw`` (a call's arguments so far) without what could still turn out to be the call's
    end: a last ``}`` followed only by whitespace and a partial ``</tool_call>``."""
    cut = len(raw) - _partial_suffix(raw, _CLOSE)
    head = raw[:cut].rstrip()
    if head.endswith("}"):
        return head[:-1]
    return raw[:cut]
