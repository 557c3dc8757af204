"""Tool-call parsers: a model's own tool-call format, read out of its output text.

`--tool-call-parser NAME` picks one; with it, `tool_choice: "auto"` turns what the model
writes in that format into OpenAI `tool_calls` (and the text before it into `content`).
Formats (as the models' chat templates ask for them):

- `hermes` (Hermes 2 Pro, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call;
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the whole output is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (v0.3 tokenizers),
  or `name[ARGS]{...}` per call (v11+ tokenizers; `[CALL_ID]id` may sit between);
- `deepseek_v3` (DeepSeek-V3, R1, V3-0324, R1-0528; also `deepseek_v31`, whose format it
  reads too): `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>`
  NAME, a ```json fenced block of the arguments and `<｜tool▁call▁end｜>` (V3.1 and
  V3.1-Terminus: NAME `<｜tool▁sep｜>` ARGUMENTS instead), and `<｜tool▁calls▁end｜>` (which
  the published templates do not always write, so it is optional).
- `kimi_k2` (Kimi K2): `<|tool_calls_section_begin|>`, then per call
  `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`;
  `functions.NAME:INDEX` becomes the call's id (Kimi's template writes a tool result under
  the id of its call, as vLLM's kimi_k2 parser keeps it).
- `openai` (gpt-oss, with `--reasoning-parser openai_gptoss`): the harmony messages to a
  recipient, which server/harmony.py passes on as
  `<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>`.

Output that does not parse as the format is content, as vLLM returns it.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re

_DECODER = json.JSONDecoder()


@dataclasses.dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str | None = None  # the model's own id of the call (Kimi K2's); None: we make one


@dataclasses.dataclass
class Parsed:
    content: str | None  # text before the calls (None when there is none)
    calls: list[ParsedCall]


def _call(obj, args_keys=("arguments", "parameters")) -> ParsedCall:
    """A {"name", "arguments"} object as a call; ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call needs a name")
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _content(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser(abc.ABC):
    """Finds where a model's tool calls start in its output, and parses them."""

    name: str
    markers: tuple[str, ...]  # text that starts the tool calls

    def start(self, text: str) -> int | None:
        """Where tool calls begin in `text` (None if not in it yet)."""
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    def may_start_at(self, text: str) -> int:
        """Where text that could still become a marker begins (len(text) if nowhere):
        text from there is held back while streaming content."""
        for i in range(max(0, len(text) - max(map(len, self.markers)) + 1), len(text)):
            if any(m.startswith(text[i:]) for m in self.markers):
                return i
        return len(text)

    def parse(self, text: str) -> Parsed:
        start = self.start(text)
        if start is None:
            return Parsed(_content(text), [])
        try:
            calls = self._calls(text[start:])
        except (ValueError, KeyError, TypeError):
            return Parsed(_content(text), [])
        return Parsed(_content(text[:start]), calls) if calls else Parsed(_content(text), [])

    @abc.abstractmethod
    def _calls(self, text: str) -> list[ParsedCall]:
        """The calls in `text`, which starts where `start` said; ValueError if malformed."""


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str) -> list[ParsedCall]:
        return [_call(json.loads(body)) for body in self._block.findall(text) if body.strip()]


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.markers):  # the whole output is the calls
            return len(text) - len(stripped)
        return None

    def may_start_at(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or any(m.startswith(stripped) for m in self.markers):
            return 0  # nothing but whitespace yet, or the start of a marker
        return len(text)

    def _calls(self, text: str) -> list[ParsedCall]:
        text = text.removeprefix("<|python_tag|>")
        calls, i = [], 0
        while i < len(text):
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
            if i == len(text):
                break
            obj, i = _DECODER.raw_decode(text, i)
            calls.append(_call(obj))
        return calls


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    _name = re.compile(r"([^\[{\s]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?(?:\[ARGS\])?\s*(?=\{)")

    def _calls(self, text: str) -> list[ParsedCall]:
        calls = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if part.startswith("["):  # v0.3: a JSON array of calls
                array, _ = _DECODER.raw_decode(part)
                calls += [_call(obj) for obj in array]
                continue
            # v11+: name[ARGS]{...}, maybe name[CALL_ID]id[ARGS]{...}
            match = self._name.match(part)
            if match is None:
                raise ValueError("no tool name")
            args, _ = _DECODER.raw_decode(part, match.end())
            calls.append(_call({"name": match.group(1), "arguments": args}))
        return calls


class DeepSeekParser(ToolParser):
    name = "deepseek_v3"
    markers = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
    _call_block = re.compile("<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)"
                             "(?:<｜tool▁call▁end｜>|$)", re.DOTALL)
    # V3's body after the separator: NAME, then the arguments in a ```json fence.
    _fenced = re.compile(r"\s*([^\s`{]+)\s*```(?:json)?\s*(.*?)\s*(?:```\s*)?$", re.DOTALL)

    def _calls(self, text: str) -> list[ParsedCall]:
        calls = []
        for head, body in self._call_block.findall(text):
            if body.lstrip().startswith("{"):  # V3.1: NAME<sep>{arguments}
                args, _ = _DECODER.raw_decode(body.strip())
                calls.append(_call({"name": head.strip(), "arguments": args}))
                continue
            match = self._fenced.match(body)  # V3: TYPE<sep>NAME ```json {arguments} ```
            if match is None or head.strip() != "function":
                raise ValueError("not a DeepSeek tool call")
            args, _ = _DECODER.raw_decode(match.group(2))
            calls.append(_call({"name": match.group(1), "arguments": args}))
        return calls


class KimiK2Parser(ToolParser):
    name = "kimi_k2"
    markers = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")
    _call_block = re.compile(r"<\|tool_call_begin\|>\s*(.+?)\s*<\|tool_call_argument_begin\|>"
                             r"(.*?)(?:<\|tool_call_end\|>|$)", re.DOTALL)
    _function_id = re.compile(r"(?:functions\.)?([^\s:]+)(?::\d+)?")

    def _calls(self, text: str) -> list[ParsedCall]:
        calls = []
        for function_id, body in self._call_block.findall(text):
            name = self._function_id.fullmatch(function_id)
            if name is None:
                raise ValueError(f"not a Kimi K2 function id: {function_id!r}")
            args, _ = _DECODER.raw_decode(body.strip())
            call = _call({"name": name.group(1), "arguments": args})
            calls.append(dataclasses.replace(call, id=function_id))
        return calls


class OpenAIParser(ToolParser):
    """gpt-oss's harmony calls, as server/harmony.py hands them on (harmony.call_text)."""

    name = "openai"
    markers = ("<|channel|>commentary to=",)
    _call_block = re.compile(r"<\|channel\|>commentary to=(\S+?)<\|message\|>(.*?)"
                             r"(?:<\|call\|>|$)", re.DOTALL)

    def _calls(self, text: str) -> list[ParsedCall]:
        return [_call({"name": recipient.removeprefix("functions."),
                       "arguments": json.loads(body)})
                for recipient, body in self._call_block.findall(text)]


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser,
                                                            MistralParser, DeepSeekParser,
                                                            KimiK2Parser, OpenAIParser)}
PARSERS["deepseek_v31"] = DeepSeekParser  # vLLM's name for V3.1's format


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r}: choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()
