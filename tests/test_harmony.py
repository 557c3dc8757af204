"""gpt-oss's harmony output (server/harmony.py, `--reasoning-parser openai_gptoss` with
`--tool-call-parser openai`): assistant turns rendered by OpenAI's own harmony library
(openai_harmony, the oss-harmony build that carries its vocabulary) and decoded to text
with their special tokens, split back into what that library's own parser reads from the
same tokens: the analysis messages as reasoning, final messages and preambles as content,
messages to a function as tool calls; a stream fed piece by piece adds up to the split;
the chat message and the streamed deltas a server makes of them; and a server with the
parser refuses output constraints, naming the field."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from jaxserve.outputs import StepOutput
from server import harmony, tool_calling
from server.chat_deltas import ChatDeltas
from server.http_server import Choice, HTTPServer
from server.tool_parsers import get_parser
from serverproc import running_server

oh = pytest.importorskip("openai_harmony", reason="the oracle: pip install oss-harmony")
ENCODING = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def _message(text: str, channel: str, recipient: str | None = None):
    m = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)
    if recipient is not None:
        m = m.with_recipient(recipient).with_content_type("<|constrain|>json")
    return m


# Assistant turns: (channel, text, recipient) per message, as gpt-oss writes them.
TURNS = {
    "think then answer": [("analysis", "User asks 2+2. Easy: 4 < 5.", None),
                          ("final", "2 + 2 = 4.", None)],
    "preamble and a call": [("analysis", "Need weather; call the tool.", None),
                            ("commentary", "Let me check the weather.", None),
                            ("commentary", '{"city": "Paris"}', "functions.get_weather")],
    "two calls": [("commentary", '{"city": "Oslo"}', "functions.get_weather"),
                  ("commentary", "{}", "functions.get_time")],
    "answer only": [("final", "Bonjour! <not a marker> |> ok", None)],
    "unicode": [("analysis", "Réfléchir… 日本語", None), ("final", "Réponse: ✓", None)],
}


def _output(turn) -> tuple[list[int], str]:
    """(token ids, text) of the turn as the model writes it after the generation prompt's
    `<|start|>assistant`: each message rendered by harmony, the last one's end marker
    (`<|return|>` or `<|call|>`, an EOS token) not in the text."""
    tokens = []
    for channel, text, recipient in turn:
        tokens += ENCODING.render(_message(text, channel, recipient))
    prefix = ENCODING.encode("<|start|>assistant", allowed_special="all")
    assert tokens[:len(prefix)] == prefix
    tokens = tokens[len(prefix):]
    return tokens, ENCODING.decode_utf8(tokens[:-1])


def _oracle(tokens: list[int]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, calls) as harmony's own parser reads the turn."""
    messages = ENCODING.parse_messages_from_completion_tokens(tokens, oh.Role.ASSISTANT)
    texts = [(m.channel, m.recipient, m.content[0].text) for m in messages]
    reasoning = [t for c, r, t in texts if c == "analysis" and r is None]
    content = "".join(t for c, r, t in texts if c != "analysis" and r is None)
    calls = [(r.removeprefix("functions."), t) for c, r, t in texts if r is not None]
    return ("".join(reasoning) if reasoning else None), content or None, calls


def _calls(content: str | None) -> tuple[str | None, list[tuple[str, str]]]:
    parsed = get_parser("openai").parse(content or "")
    return parsed.content, [(c.name, json.dumps(json.loads(c.arguments)))
                            for c in parsed.calls]


@pytest.mark.parametrize("name", list(TURNS))
def test_turns_split_as_harmony_reads_them(name):
    tokens, text = _output(TURNS[name])
    assert text.startswith("<|channel|>")
    want_reasoning, want_content, want_calls = _oracle(tokens)
    reasoning, content = harmony.split(text)
    assert reasoning == want_reasoning
    content, calls = _calls(content)
    assert content == want_content
    assert calls == [(n, json.dumps(json.loads(a))) for n, a in want_calls]
    assert harmony.split(text, calls=False) == (reasoning, content)  # no tools: no calls


@pytest.mark.parametrize("name", list(TURNS))
@pytest.mark.parametrize("seed", [0, 1])
def test_a_stream_adds_up_to_the_split(name, seed):
    """Pieces of 1 to 6 characters (markers cut anywhere): the same reasoning and
    content, and no piece of a marker ever in what a client sees."""
    _, text = _output(TURNS[name])
    rng = np.random.default_rng(seed)
    stream, pieces, at = harmony.HarmonyStream(), [], 0
    while at < len(text):
        n = int(rng.integers(1, 7))
        pieces += stream.feed(text[at:at + n])
        at += n
    pieces += stream.finish()
    reasoning = [t for k, t in pieces if k == "reasoning"]
    content = "".join(t for k, t in pieces if k == "content")
    assert (("".join(reasoning) if reasoning else None), content or None) == \
        harmony.split(text)
    shown = [t for k, t in pieces if k == "reasoning"] + [_calls(content)[0] or ""]
    assert not any(m[:3] in t for t in shown for m in (harmony.START, harmony.MESSAGE))


def test_output_that_is_not_harmony_or_is_cut_short():
    """Text that does not open a message is content; a message cut short keeps its text;
    a header cut short gives nothing; a call cut short is still handed on."""
    assert harmony.split("Hello <|channel|> there") == (None, "Hello <|channel|> there")
    assert harmony.split("<|chan") == (None, "<|chan")
    assert harmony.split("<|channel|>analysis<|message|>Thinking ab") == ("Thinking ab", None)
    assert harmony.split("<|channel|>analysis<|message|>x<|end|><|start|>assist") == \
        ("x", None)
    reasoning, content = harmony.split(
        '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"a": 1')
    assert reasoning is None and content == harmony.call_text("functions.get_time", '{"a": 1')


def test_chat_message_and_deltas_carry_reasoning_content_and_calls():
    """A server's reading of a finished choice (its message) and of the same output
    streamed token by token (its deltas), with tools (tool_choice auto) and without."""
    tokens, text = _output(TURNS["preamble and a call"])
    plan = tool_calling.plan(TOOLS, "auto", None, get_parser("openai"))
    answer = HTTPServer._chat_message(Choice(text=text, finish_reason="stop"), plan,
                                      harmony.MODE, include_reasoning=True)
    message = answer["message"]
    assert answer["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == message["reasoning"] == \
        "Need weather; call the tool."
    assert message["content"] == "Let me check the weather."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    deltas = ChatDeltas(plan, harmony.MODE)
    pieces = [ENCODING.decode_utf8([t]) for t in tokens[:-1]]
    got = []
    for i, piece in enumerate(pieces):
        got += deltas.feed(StepOutput("r", [tokens[i]], piece, None,
                                      finished=i == len(pieces) - 1))
    assert "".join(d.get("reasoning_content", "") for d in got) == \
        message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in got) == message["content"]
    streamed = [c for d in got for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    plain = HTTPServer._chat_message(Choice(text=_output(TURNS["think then answer"])[1],
                                            finish_reason="stop"), None, harmony.MODE,
                                     include_reasoning=False)
    assert plain == {"message": {"role": "assistant", "content": "2 + 2 = 4."},
                     "finish_reason": "stop"}


@pytest.mark.slow
def test_a_server_with_the_parser_answers_and_refuses_constraints(checkpoints, tmp_path):
    """`--reasoning-parser openai_gptoss --tool-call-parser openai`: a chat answers (a
    random tiny model writes no harmony: its text is content), tools with tool_choice
    auto are taken, reasoning_effort reaches the template, and an output constraint is a
    400 naming its field."""
    path, _ = checkpoints("llama")
    with running_server(path, tmp_path / "server.log", "--reasoning-parser", "openai_gptoss",
                        "--tool-call-parser", "openai") as (_, server):
        url = f"{server.http_url}/v1/chat/completions"
        body = {"model": str(path), "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Hi"}]}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        assert httpx.post(url, json={**body, "tools": TOOLS}, timeout=60).status_code == 200
        # OpenAI's reasoning_effort reaches the chat template (gpt-oss's reads it), from
        # the Responses API's reasoning.effort too.
        template = "{{ reasoning_effort }}|{% for m in messages %}{{ m.content }}{% endfor %}"
        want = httpx.post(f"{server.http_url}/tokenize", json={
            "prompt": "high|Hi", "add_special_tokens": False}).json()["tokens"]
        r = httpx.post(url, json={**body, "chat_template": template, "return_token_ids": True,
                                  "reasoning_effort": "high"}, timeout=60)
        assert r.json()["prompt_token_ids"] == want
        r = httpx.post(url, json={**body, "reasoning_effort": "extreme"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
        r = httpx.post(f"{server.http_url}/v1/responses", json={
            "model": str(path), "input": "Hi", "max_output_tokens": 4,
            "reasoning": {"effort": "extreme"}}, timeout=60)
        assert r.status_code == 400, r.text
        for field, value in (("response_format", {"type": "json_object"}),
                             ("guided_regex", "[a-z]+"),
                             ("tool_choice", "required")):
            r = httpx.post(url, json={**body, "tools": TOOLS, field: value}, timeout=60)
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field and "openai_gptoss" in r.text
