"""gpt-oss's harmony output on /v1/chat/completions and /v1/responses: `--reasoning-parser
openai_gptoss` (vLLM's name).

gpt-oss writes its turn as messages on channels, each `<|channel|>NAME<|message|>TEXT` and
ended by `<|end|>` (another message follows, `<|start|>assistant...`), `<|return|>` (the
answer is done) or `<|call|>` (a tool call is done; both are its EOS tokens). The chat
template's generation prompt ends with `<|start|>assistant`, so the output starts at the
first message's `<|channel|>`. What becomes of each message:

- `analysis`: the chain of thought -> `reasoning_content` (and vLLM's `reasoning`);
- `final`, and `commentary` without a recipient (a preamble before tool calls) ->
  `content`;
- a message to a recipient (`... to=functions.NAME ...`, on `commentary`, arguments as
  its text) -> a tool call: passed on to the tool stage as one canonical
  `<|channel|>commentary to=NAME<|message|>ARGS<|call|>`, which `--tool-call-parser
  openai` (server/tool_parsers.py) reads into `tool_calls` (tool_choice "auto"); dropped
  when the request has no tools.

The markers are special tokens: the output is detokenized with them kept. Output that
does not start as harmony (no `<|channel|>` or `<|start|>` first) is all content; a
message cut short (max_tokens) keeps what it wrote. Streamed, text that could be the
start of a marker is held back until it cannot.

Output constraints hold where harmony puts what they describe, with any analysis
messages before it (free: the chain of thought is not constrained): response_format and
guided_* the final message's text (StructuredOutputsParams.reasoning "harmony"); a
required or named tool_choice one message to `functions.NAME` on commentary whose text is
the function's arguments (`call_plan`), read back as a tool call as with "auto" (one call:
gpt-oss's turn ends at `<|call|>`). Preambles are not allowed then. Both need the prompt to
end with the generation prompt's `<|start|>assistant` (`opens_a_turn`).
"""

from __future__ import annotations

import dataclasses
import json
import re

from jaxserve.engine.structured_output import COMPACT_JSON, harmony_grammar
from server import tool_calling
from server.tool_parsers import get_parser

MODE = "harmony"  # the `think` of a chat run read as harmony (server/http_server.py)
START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
# What ends a message's text: its end markers, or the next message's start.
_BODY_ENDS = (END, RETURN, CALL, START)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def call_text(recipient: str, arguments: str) -> str:
    """A tool call as the tool stage reads it (tool_parsers.OpenAIParser)."""
    return f"{CHANNEL}commentary to={recipient}{MESSAGE}{arguments}{CALL}"


def opens_a_turn(prompt_text: str) -> bool:
    """Whether a prompt ends with the generation prompt (its output starts a turn's first
    message): what a constraint's grammar starts from."""
    return prompt_text.endswith(f"{START}assistant")


def call_plan(plan: tool_calling.ToolPlan, tools: list[dict]) -> tool_calling.ToolPlan:
    """A required or named tool_choice's plan as gpt-oss writes a call: after any analysis
    messages, `<|channel|>commentary to=functions.NAME [<|constrain|>json]<|message|>`
    and the arguments (compact JSON of the function's parameters schema), then its EOS;
    read back by the openai tool parser."""
    names = ([plan.function] if plan.mode == "named"
             else [t["function"]["name"] for t in tools])
    schemas = {t["function"]["name"]: tool_calling.parameters(t) for t in tools}
    # Names are [a-zA-Z0-9_-] (the protocol checks them): safe in a Lark string.
    rules = "".join(
        f'call_{i}: "commentary to=functions.{name}" " "? (<|constrain|> "json")? '
        f'<|message|> %json {json.dumps({**schemas[name], "x-guidance": COMPACT_JSON})}\n'
        for i, name in enumerate(names))
    grammar = harmony_grammar("(" + " | ".join(f"call_{i}" for i in range(len(names))) + ")",
                              rules)
    return dataclasses.replace(plan, parser=get_parser("openai"), schema=None,
                               grammar=grammar)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers`."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


@dataclasses.dataclass
class HarmonyStream:
    """One choice's output text as it streams, cut into ("reasoning" | "content", text)
    pieces (a tool call's canonical text among the content; module doc). `calls`: whether
    tool calls are kept (the request has tools)."""

    calls: bool = True
    state: str = "start"  # "start", "plain", "header", "body"
    header: str = ""  # the current message's header so far
    kind: str = "content"  # the current body's: "reasoning", "content" or "call"
    pending: str = ""  # text held back
    arguments: str = ""  # the current call's text so far
    recipient: str = ""

    def feed(self, new_text: str) -> list[tuple[str, str]]:
        text, self.pending, out = self.pending + new_text, "", []
        if self.state == "start":
            if any(m.startswith(text) and len(text) < len(m) for m in (CHANNEL, START)):
                self.pending = text  # still may open a message
                return out
            self.state = "header" if text.startswith((CHANNEL, START)) else "plain"
        if self.state == "plain":
            return [("content", text)] if text else out
        while text:
            if self.state == "header":  # (a marker may straddle two pieces)
                self.header, found, text = (self.header + text).partition(MESSAGE)
                if not found:
                    return out
                self._open()
                continue
            ends = [(i, m) for m in _BODY_ENDS if (i := text.find(m)) >= 0]
            if not ends:
                keep = _held(text, _BODY_ENDS)
                self._body(text[:len(text) - keep], out)
                self.pending = text[len(text) - keep:]
                return out
            i, marker = min(ends)
            self._body(text[:i], out)
            self._close(out)
            text = text[i + len(marker):]
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, once the output has ended (a call cut short is ended)."""
        out = self.feed("") if self.state == "start" else []
        text, self.pending = self.pending, ""
        if self.state == "plain" or (self.state == "start" and text):
            return out + [("content", text)]
        if self.state == "body":
            self._body(text, out)
            self._close(out)
        return out

    def _open(self) -> None:
        """The header is whole: the message's kind from its channel and recipient."""
        recipient = _RECIPIENT.search(self.header)
        channel = _CHANNEL.search(self.header)
        self.recipient = recipient.group(1) if recipient else ""
        self.kind = ("call" if self.recipient
                     else "reasoning" if channel and channel.group(1) == "analysis"
                     else "content")
        self.state, self.header, self.arguments = "body", "", ""

    def _body(self, text: str, out: list) -> None:
        if not text:
            return
        if self.kind == "call":
            self.arguments += text
        else:
            out.append((self.kind, text))

    def _close(self, out: list) -> None:
        if self.kind == "call" and self.calls:
            out.append(("content", call_text(self.recipient, self.arguments)))
        self.state = "header"


def split(text: str, calls: bool = True) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content): None where there is none."""
    stream = HarmonyStream(calls)
    pieces = stream.feed(text) + stream.finish()
    joined = {kind: "".join(t for k, t in pieces if k == kind) for kind in ("reasoning",
                                                                           "content")}
    reasoning = joined["reasoning"] if any(k == "reasoning" for k, _ in pieces) else None
    return reasoning, joined["content"] or None
