"""Reasoning outputs on /v1/chat/completions: a thinking model's `<think> ... </think>` block
split from its answer, as vLLM's and SGLang's `--reasoning-parser` do.

With `--reasoning-parser deepseek_r1` or `qwen3` (one format: DeepSeek-R1 and its
distills, QwQ, Qwen3 and Qwen3-Thinking) a chat completion's message carries the block's
text as `reasoning_content` (SGLang's and DeepSeek's name; `reasoning` too, vLLM's current
name) and the rest as `content`; streamed, the block arrives as `reasoning_content` deltas,
then the answer as `content` deltas. The block is open from the first output token when
the prompt left one open (the R1 and Qwen3-Thinking chat templates end the prompt with
`<think>`); otherwise output that begins with `<think>` opens it, and output that does not
is all content (Qwen3 with `enable_thinking: false`). Output that ends inside the block
(max_tokens) is all reasoning, content null, streamed or not. Tool calls are read from the
content only, and an output constraint (response_format, guided_*, a required or named
tool) holds after the block (StructuredOutputsParams.reasoning: from the first token
when the prompt closed one, as vLLM's does). A request's `include_reasoning: false`
(vLLM's) drops the reasoning.
"""

from __future__ import annotations

import dataclasses

from jaxserve.sampling_params import REASONING_END as END
from jaxserve.sampling_params import REASONING_START as START


def prompt_state(prompt_text: str) -> str | None:
    """Where a prompt leaves the reasoning: "open" (its last marker is START: R1's and
    Qwen3-Thinking's generation prompts), "closed" (END: Qwen3's with enable_thinking
    false), None (no marker)."""
    start, end = prompt_text.rfind(START), prompt_text.rfind(END)
    return None if start == end else "open" if start > end else "closed"


def split(text: str, opened: bool) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content): reasoning None when there is no block,
    content None when nothing follows it."""
    if not opened:
        if not text.startswith(START):
            return None, text
        text = text[len(START):]
    reasoning, end, content = text.partition(END)
    return reasoning, (content or None) if end else None


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclasses.dataclass
class ReasoningStream:
    """One choice's output text as it streams, cut into ("reasoning" | "content", text)
    pieces; text that could be the start of a marker is held back until it cannot."""

    state: str  # "start" (a block may open), "reasoning", "content"
    pending: str = ""

    @classmethod
    def after(cls, opened: bool) -> ReasoningStream:
        return cls("reasoning" if opened else "start")

    def feed(self, new_text: str) -> list[tuple[str, str]]:
        text, self.pending, out = self.pending + new_text, "", []
        if self.state == "start":
            if START.startswith(text) and len(text) < len(START):
                self.pending = text
                return out
            if text.startswith(START):
                self.state, text = "reasoning", text[len(START):]
            else:
                self.state = "content"
        if self.state == "reasoning":
            before, end, after = text.partition(END)
            if not end:
                keep = _held(text, END)
                before, self.pending = text[:len(text) - keep], text[len(text) - keep:]
            if before:
                out.append(("reasoning", before))
            if not end:
                return out
            self.state, text = "content", after
        if text:
            out.append(("content", text))
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, once the output has ended."""
        text, self.pending = self.pending, ""
        if not text:
            return []
        return [("reasoning" if self.state == "reasoning" else "content", text)]
