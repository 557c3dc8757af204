"""OpenAI tool calling on /v1/chat/completions.

The tools go to the chat template. `tool_choice` then decides what the output is:

- `"none"`: text, as without tools;
- `"auto"` (the default when tools are given): the model decides; its output is read by
  the server's `--tool-call-parser` (server/tool_parsers.py) into content and tool calls;
- `"required"`: one or more calls, enforced by a JSON Schema constraint (an array of
  `{"name", "parameters"}` objects, one shape per tool, vLLM's), `maxItems: 1` when
  `parallel_tool_calls` is false;
- a named function: its arguments, enforced by the function's parameters schema.

With gpt-oss's harmony parser a required or named call is enforced as gpt-oss writes one
(server/harmony.py: a message to `functions.NAME` holding its arguments) and read back by
the tool parser, as with "auto".

Streamed as OpenAI streams them: a named call's header (id, name) comes first and its
arguments follow as they are generated; a required or parsed call is sent whole when it
is complete; content before a parsed call streams as content, with text that could be the
start of the parser's marker held back until it cannot.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from jaxserve.sampling_params import StructuredOutputsParams
from server.tool_parsers import PARSERS, ParsedCall, ToolParser


class ToolChoiceError(ValueError):
    """A tools / tool_choice combination that cannot be served (400)."""

    def __init__(self, message: str, param: str = "tool_choice"):
        super().__init__(message)
        self.param = param


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parameters(tool: dict) -> dict:
    """A tool's parameters schema (an object with no properties when it gives none)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


@dataclasses.dataclass
class ToolPlan:
    """How one request's output becomes tool calls."""

    mode: str  # "auto" | "required" | "named"
    parser: ToolParser | None = None  # auto (and harmony's calls): reads calls out of text
    function: str | None = None  # named
    schema: dict | None = None  # required / named: what the output must be
    grammar: str | None = None  # or, as Lark (harmony's calls): what the output must be

    def constraint(self) -> StructuredOutputsParams | None:
        if self.grammar is not None:
            return StructuredOutputsParams(grammar=self.grammar)
        return None if self.schema is None else StructuredOutputsParams(json=self.schema)


def plan(tools: list[dict] | None, tool_choice: str | dict | None,
         parallel_tool_calls: bool | None, parser: ToolParser | None) -> ToolPlan | None:
    """The plan for a request's tools and tool_choice; None for plain text.
    ToolChoiceError names what is wrong."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise ToolChoiceError(f"tool_choice {json.dumps(choice)} needs tools")
    if choice == "auto":
        if parser is None:
            raise ToolChoiceError('tool_choice "auto" needs the server started with '
                                  f"--tool-call-parser ({', '.join(PARSERS)}); "
                                  'or ask for "required", a named function, or "none"')
        return ToolPlan("auto", parser=parser)
    if choice == "required":
        branches = [{"type": "object", "additionalProperties": False,
                     "required": ["name", "parameters"],
                     "properties": {"name": {"const": t["function"]["name"]},
                                    "parameters": parameters(t)}} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", schema=schema)
    name = choice["function"]["name"]  # named; its shape was checked by the protocol
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not in "
                              f"tools")
    return ToolPlan("named", function=name, schema=parameters(tool))


def _tool_call(call: ParsedCall, index: int | None = None) -> dict:
    out = {"id": call.id or _call_id(), "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _required_calls(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
        return [ParsedCall(x["name"], json.dumps(x["parameters"], ensure_ascii=False))
                for x in items]
    except (ValueError, TypeError, KeyError):
        return None  # cut short (max_tokens): the text is returned as content


def message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """A finished choice's (content, tool_calls)."""
    if plan.parser is not None:
        parsed = plan.parser.parse(text)
        return parsed.content, [_tool_call(c) for c in parsed.calls]
    if plan.mode == "named":
        return None, [_tool_call(ParsedCall(plan.function, text))]
    calls = _required_calls(text)
    return (text, []) if calls is None else (None, [_tool_call(c) for c in calls])


def finish_reason(plan: ToolPlan, reason: str | None, tool_calls: list) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named call
    keeps "stop"."""
    return "tool_calls" if tool_calls and reason == "stop" and plan.mode != "named" else reason


class ToolStream:
    """One choice's streamed output as chat deltas (see the module docstring)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text sent as content (auto) or arguments (named)
        self.call_start: int | None = None  # auto: where the parsed calls begin
        self.num_calls = 0
        self._named_id = _call_id()

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        self.text += new_text
        if self.plan.parser is None and self.plan.mode == "named":
            if not new_text and self.sent:
                return []
            first = self.sent == 0 and not self.num_calls
            self.sent += len(new_text)
            self.num_calls = 1
            call = {"index": 0, "function": {"arguments": new_text}}
            if first:
                call = {"index": 0, "id": self._named_id, "type": "function",
                        "function": {"name": self.plan.function, "arguments": new_text}}
            return [{"tool_calls": [call]}]
        if self.plan.parser is None or self.call_start is not None:  # required
            return []
        start = self.plan.parser.start(self.text)
        if start is not None:
            self.call_start = start
            return self._content(start)
        return self._content(self.plan.parser.may_start_at(self.text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left when the choice has ended."""
        if self.plan.parser is None and self.plan.mode == "named":
            return self.feed("") if not self.num_calls else []
        if self.plan.parser is None:  # required
            calls = _required_calls(self.text)
            if calls is None:
                return self._content(len(self.text))
        elif self.call_start is None:
            return self._content(len(self.text))
        else:
            calls = self.plan.parser.parse(self.text).calls
            if not calls:  # did not parse after all: it was content
                return self._content(len(self.text))
        self.num_calls = len(calls)
        return [{"tool_calls": [_tool_call(c, i)]} for i, c in enumerate(calls)]

    def _content(self, upto: int) -> list[dict[str, Any]]:
        if upto <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:upto], upto
        return [{"content": piece}]
