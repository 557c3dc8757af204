"""One streamed chat choice's text as deltas: its reasoning block (server/reasoning.py; or
gpt-oss's analysis messages, server/harmony.py), then content or tool calls
(server/tool_calling.py). The chat completions stream sends
them as chunks; the Responses API (server/responses.py) as its events."""

from __future__ import annotations

from typing import Any

from jaxserve.outputs import StepOutput
from server import harmony, reasoning, tool_calling


class ChatDeltas:
    """A choice's outputs in, chat deltas out: {"reasoning_content", "reasoning"} (only
    with `include_reasoning`), {"content"} and {"tool_calls": [...]} dicts. `think`: where
    the output starts (reasoning.prompt_state; harmony.MODE: gpt-oss's harmony; None: no
    reasoning parser); `plan`: its tools (None: none)."""

    def __init__(self, plan: tool_calling.ToolPlan | None, think: bool | str | None,
                 include_reasoning: bool = True):
        self.tools = tool_calling.ToolStream(plan) if plan is not None else None
        self.thought = (harmony.HarmonyStream(calls=plan is not None) if think == harmony.MODE
                        else reasoning.ReasoningStream.after(think) if think is not None
                        else None)
        self.include_reasoning = include_reasoning

    @property
    def plain(self) -> bool:
        """Whether its text goes out as it comes (no reasoning to split, no tools)."""
        return self.tools is None and self.thought is None

    def feed(self, out: StepOutput) -> list[dict[str, Any]]:
        """The deltas of an output's new text (and, when it is the last, of what was held
        back)."""
        thought, tools = self.thought, self.tools
        pieces = [("content", out.new_text)] if thought is None else (
            thought.feed(out.new_text) + (thought.finish() if out.finished else []))
        deltas = []
        for kind, text in pieces:
            if kind == "reasoning":
                if self.include_reasoning:
                    deltas.append({"reasoning_content": text, "reasoning": text})
            elif tools is not None:
                deltas += tools.feed(text)
            elif text:
                deltas.append({"content": text})
        if tools is not None and out.finished:
            deltas += tools.finish()
        return deltas
