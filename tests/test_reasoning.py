"""Reasoning outputs (server/reasoning.py): what Qwen3's own chat template writes for an
assistant turn with `reasoning_content` splits back into that reasoning and content;
prompts that leave a block open (DeepSeek-R1, Qwen3-Thinking) or close one
(`enable_thinking: false`); a stream fed piece by piece adds up to the whole split; and
through the `openai` package, a server with --reasoning-parser splits, streams and holds
output constraints after the block."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest

from serverproc import accumulate_tool_calls, running_server
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
    assert output.startswith("<think>") and reasoning.prompt_state(prompt) is None
    got_thought, got_content = reasoning.split(output, False)
    # The template wraps the block in newlines; the split keeps them, as vLLM's does.
    assert (got_thought.strip("\n"), got_content.lstrip("\n")) == (thought, content)


def test_prompts_that_open_or_close_a_block():
    closed = _render([USER], add_generation_prompt=True, enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n")
    assert reasoning.prompt_state(closed) == "closed"
    assert reasoning.split("9.8 is larger.", False) == (None, "9.8 is larger.")
    # DeepSeek-R1's and Qwen3-Thinking's templates end the generation prompt in "<think>\n":
    # the output opens inside the block and never writes its start.
    opened = "<｜User｜>Which is larger?<｜Assistant｜><think>\n"
    assert reasoning.prompt_state(opened) == "open"
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


# ------------------------------------------------------------ through a server

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    path, _ = checkpoints("llama")
    log = tmp_path_factory.mktemp("reasoning") / "server.log"
    with running_server(path, log, "--tool-call-parser", "hermes", "--reasoning-parser",
                        "qwen3") as (_, proc):
        yield proc, str(path)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0].http_url}/v1", api_key="unused", max_retries=0)


def _after(prefix: str) -> dict:
    """A chat whose prompt ends with the start of the assistant's turn `prefix`."""
    return dict(messages=ASK + [{"role": "assistant", "content": prefix}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False})


def test_reasoning_is_split_from_the_answer(server, client):
    """--reasoning-parser qwen3: a <think> block the model writes first comes back as
    reasoning_content (and vLLM's `reasoning`), the rest as content; streamed, the same
    pieces; without it (include_reasoning false) only the content; tool calls are read
    after the block. The block is forced by a regex, as a random model would not write
    one; the prompt closed a block (as Qwen3's does with enable_thinking false), so the
    regex holds from the first token."""
    model = server[1]
    closed = _after("</think>")
    body = dict(model=model, max_tokens=60, seed=4, messages=closed["messages"])

    def extra(**kw):
        return {"extra_body": {**closed["extra_body"], **kw}}

    forced = {"guided_regex": r"<think>[a-z ]{4,12}</think>[a-z]{2,8}"}
    r = client.chat.completions.create(**body, **extra(**forced))
    message = r.choices[0].message.model_dump()
    thought, content = message["reasoning_content"], message["content"]
    assert re.fullmatch(r"[a-z ]{4,12}", thought) and re.fullmatch(r"[a-z]{2,8}", content)
    assert message["reasoning"] == thought
    deltas = [c.choices[0].delta.model_dump() for c in client.chat.completions.create(
        **body, stream=True, **extra(**forced)) if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d["content"] or "" for d in deltas) == content
    hidden = client.chat.completions.create(**body, **extra(**forced, include_reasoning=False))
    assert hidden.choices[0].message.content == content
    assert "reasoning_content" not in hidden.choices[0].message.model_dump()
    # Output with no block is all content (no reasoning field), as before.
    plain = client.chat.completions.create(**body, **extra(guided_regex="[a-z]{3}"))
    assert re.fullmatch("[a-z]{3}", plain.choices[0].message.content)
    assert plain.choices[0].message.model_dump().get("reasoning_content") is None
    calls = (r'<think>[a-z]{2,3}</think><tool_call>\{"name": "get_weather", "arguments": '
             r'\{"city": "[a-z]{2,3}"\}\}</tool_call>')
    body["max_tokens"] = 94  # (a byte tokenizer: a token a character)
    r = client.chat.completions.create(**body, tools=[WEATHER_TOOL], **extra(guided_regex=calls))
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert re.fullmatch(r"[a-z]{2,3}", message.model_dump()["reasoning_content"])
    assert message.tool_calls[0].function.name == "get_weather"
    stream = list(client.chat.completions.create(**body, tools=[WEATHER_TOOL], stream=True,
                                                 **extra(guided_regex=calls)))
    assert "".join(c.choices[0].delta.model_dump().get("reasoning_content") or ""
                   for c in stream if c.choices) == message.model_dump()["reasoning_content"]
    content, streamed_calls, finish = accumulate_tool_calls(stream)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == [
        ("get_weather", message.tool_calls[0].function.arguments)]


def test_a_constraint_holds_after_the_reasoning_block(server, client):
    """With a reasoning parser a regex holds after the block, which is free: "<" biased
    up, the model opens a block where the prompt did not (no marker) and writes "<" in it
    until max_tokens, or writes them from the first token where the prompt opened one;
    where the prompt closed one the regex holds from the first token."""
    model = server[1]
    lt = httpx.post(f"{server[0].http_url}/tokenize",
                    json={"prompt": "<", "add_special_tokens": False}).json()["tokens"]
    body = dict(model=model, max_tokens=12, seed=1, temperature=0)
    bias = {"guided_regex": "[a-z]{3}", "logit_bias": {str(lt[0]): 100}}
    cases = [(dict(messages=ASK, extra_body=bias), "<think>" + "<" * 5),
             (_after("<think>\n"), "<" * 12)]
    for chat, output in cases:
        chat = {**chat, "extra_body": {**chat["extra_body"], **bias}}
        choice = client.chat.completions.create(**body, **chat).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        assert choice.message.model_dump()["reasoning_content"] == output.removeprefix(
            "<think>")
    closed = _after("</think>")
    closed["extra_body"].update(bias)
    choice = client.chat.completions.create(**body, **closed).choices[0]
    assert re.fullmatch("[a-z]{3}", choice.message.content)
    assert choice.message.model_dump().get("reasoning_content") is None


def test_disaggregated_requests_are_refused(server):
    """The router joins the first token's text with the rest, so a marker may straddle
    the two servers: a reasoning parser refuses kv_transfer_params (400)."""
    r = httpx.post(f"{server[0].http_url}/v1/chat/completions", json={
        "model": server[1], "messages": ASK, "max_tokens": 4,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]
