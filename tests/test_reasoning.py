"""Reasoning outputs (server/reasoning.py): what Qwen3's own chat template writes for an
assistant turn with `reasoning_content` splits back into that reasoning and content;
prompts that leave a block open (DeepSeek-R1, Qwen3-Thinking) or close one
(`enable_thinking: false`); and a stream fed piece by piece adds up to the whole split."""

from __future__ import annotations

from pathlib import Path

import pytest

from server import reasoning

QWEN3 = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
USER = {"role": "user", "content": "Which is larger, 9.11 or 9.8?"}
# (reasoning, content) as a client sends an earlier assistant turn back.
TURNS = [("9.8 = 9.80 and 80 > 11, so 9.8.", "9.8 is larger."),
         ("Compare the tenths:\n1 < 8.", "9.8"),
         ("A < B? </thin no.", "Answer: <think> is a tag.")]


def _render(messages, **kw) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template([messages], chat_template=QWEN3, **kw)[0][0]


def _model_output(thought: str, content: str) -> tuple[str, str]:
    """(prompt, output): what the template writes after the generation prompt for an
    assistant turn with this reasoning, up to the end of the turn."""
    prompt = _render([USER], add_generation_prompt=True)
    whole = _render([USER, {"role": "assistant", "content": content,
                            "reasoning_content": thought}])
    assert whole.startswith(prompt)
    return prompt, whole[len(prompt):whole.rindex("<|im_end|>")]


@pytest.mark.parametrize("thought, content", TURNS)
def test_qwen3_turns_split_back(thought, content):
    prompt, output = _model_output(thought, content)
    assert output.startswith("<think>") and not reasoning.opened_by(prompt)
    got_thought, got_content = reasoning.split(output, reasoning.opened_by(prompt))
    # The template wraps the block in newlines; the split keeps them, as vLLM's does.
    assert (got_thought.strip("\n"), got_content.lstrip("\n")) == (thought, content)


def test_prompts_that_open_or_close_a_block():
    closed = _render([USER], add_generation_prompt=True, enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n") and not reasoning.opened_by(closed)
    assert reasoning.split("9.8 is larger.", False) == (None, "9.8 is larger.")
    # DeepSeek-R1's and Qwen3-Thinking's templates end the generation prompt in "<think>\n":
    # the output opens inside the block and never writes its start.
    opened = "<｜User｜>Which is larger?<｜Assistant｜><think>\n"
    assert reasoning.opened_by(opened)
    assert reasoning.split("Compare.\n</think>\n\n9.8", True) == ("Compare.\n", "\n\n9.8")
    assert reasoning.split("Compare, then", True) == ("Compare, then", None)  # cut short
    assert reasoning.split("<think>Hmm.</think>", False) == ("Hmm.", None)
    assert reasoning.split("Hi <think>", False) == (None, "Hi <think>")  # not at the start


@pytest.mark.parametrize("opened, output", [
    *[(False, _model_output(*turn)[1]) for turn in TURNS],
    (True, "Compare.\n</think>\n\n9.8"), (True, "cut short </thi"), (False, "<thi"),
    (False, "plain answer"), (False, "<think>open, never closed"), (False, ""),
])
@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_a_stream_adds_up_to_the_split(opened, output, piece):
    stream = reasoning.ReasoningStream.after(opened)
    pieces = []
    for i in range(0, len(output), piece):
        pieces += stream.feed(output[i:i + piece])
    pieces += stream.finish()
    thought, content = reasoning.split(output, opened)
    assert "".join(t for k, t in pieces if k == "reasoning") == (thought or "")
    assert "".join(t for k, t in pieces if k == "content") == (content or "")
    kinds = [k for k, t in pieces]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # never back
    assert all(t for _, t in pieces)


def test_markers_are_held_back_until_they_cannot_be_one():
    stream = reasoning.ReasoningStream.after(False)
    assert stream.feed("<th") == []
    assert stream.feed("ink>I think") == [("reasoning", "I think")]
    assert stream.feed(" so</") == [("reasoning", " so")]
    assert stream.feed("b>") == [("reasoning", "</b>")]
    assert stream.feed("</think>Yes") == [("content", "Yes")]
    other = reasoning.ReasoningStream.after(False)
    assert other.feed("<tho") == [("content", "<tho")]
