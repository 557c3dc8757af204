"""gpt-oss's harmony output (server/harmony.py, `--reasoning-parser openai_gptoss` with
`--tool-call-parser openai`): assistant turns rendered by OpenAI's own harmony library
(openai_harmony, the oss-harmony build that carries its vocabulary) and decoded to text
with their special tokens, split back into what that library's own parser reads from the
same tokens: the analysis messages as reasoning, final messages and preambles as content,
messages to a function as tool calls; a stream fed piece by piece adds up to the split;
the chat message and the streamed deltas a server makes of them. Output constraints with
the parser: harmony turns rendered by that library, retokenized by a byte tokenizer that
holds harmony's markers as special tokens, are what the constraint's grammar (llguidance)
accepts or refuses, and a server's constrained answers parse and validate (jsonschema)."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import numpy as np
import pytest

from jaxserve.demo import write_byte_tokenizer
from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.outputs import StepOutput
from jaxserve.sampling_params import StructuredOutputsParams
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
    auto are taken, reasoning_effort reaches the template, and an output constraint after
    a prompt that is not harmony's is a 400 naming its field."""
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
        # This template's generation prompt is not harmony's: a constraint cannot start.
        for field, value in (("response_format", {"type": "json_object"}),
                             ("guided_regex", "[a-z]+"),
                             ("tool_choice", "required")):
            r = httpx.post(url, json={**body, "tools": TOOLS, field: value}, timeout=60)
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field and "<|start|>assistant" in r.text


# --- output constraints -----------------------------------------------------------------

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>"]
# A template that renders harmony's turns (gpt-oss's, without its system and developer
# messages), its generation prompt `<|start|>assistant`.
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
                    "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant"
                    "{% endif %}")


def write_harmony_tokenizer(path) -> dict[str, int]:
    """The demo's byte tokenizer with harmony's markers as special tokens (ids 259-265,
    inside the tiny models' vocabulary), `<|return|>` and `<|call|>` its EOS tokens (as
    gpt-oss's generation_config has them) and HARMONY_TEMPLATE; returns the markers' ids."""
    from tokenizers import Tokenizer as HFTokenizer

    write_byte_tokenizer(path)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(MARKERS)
    tok.save(str(path / "tokenizer.json"))
    ids = {m: tok.token_to_id(m) for m in MARKERS}
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "eos_token": "<|return|>", "chat_template": HARMONY_TEMPLATE}))
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            (path / name).write_text(json.dumps({
                **json.loads((path / name).read_text()),
                "eos_token_id": [ids["<|return|>"], ids["<|call|>"]]}))
    return ids


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony_tokenizer")
    ids = write_harmony_tokenizer(path)
    tokenizer = Tokenizer.from_pretrained(path)
    return tokenizer, GrammarCompiler(tokenizer, 320, [ids["<|return|>"], ids["<|call|>"]])


def _accepts(grammars, constraint: StructuredOutputsParams, turn) -> bool:
    """Whether the constraint's grammar takes the turn harmony renders (as the model
    writes it after `<|start|>assistant`, retokenized by our tokenizer) and lets it end
    there (EOS: `<|return|>` or `<|call|>`)."""
    tokenizer, compiler = grammars
    tokens = tokenizer.encode(_output(turn)[1], add_special_tokens=False)
    matcher = compiler.matcher(constraint)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "n"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}}}


@pytest.mark.parametrize("turn, valid", [
    ([("final", '{"answer": "yes", "n": 3}', None)], True),
    ([("analysis", 'Think: {"answer": maybe} <x> |>', None),
      ("analysis", "More thought.", None),
      ("final", '{"answer": "no", "n": -12}', None)], True),
    ([("final", '{"answer": "maybe", "n": 3}', None)], False),  # not the schema's
    ([("final", '{"answer":"yes","n":3}', None)], False),  # JSON comes out compact
    ([("analysis", "Only thinking.", None)], False),  # no final message: cannot end
    ([("commentary", "A preamble.", None),  # preambles would join the content
      ("final", '{"answer": "yes", "n": 3}', None)], False),
    ([("analysis", "Call it.", None),
      ("commentary", '{"city": "Oslo"}', "functions.get_weather")], False),
])
def test_a_response_format_holds_as_the_final_message(grammars, turn, valid):
    """reasoning "harmony": analysis messages free, the final message's text the schema's
    JSON (as jsonschema judges it: the grammar agrees), nothing else."""
    final = [text for channel, text, _ in turn if channel == "final"]
    if final:
        try:
            jsonschema.validate(json.loads(final[0]), ANSWER)
            schema_valid = True
        except (ValueError, jsonschema.ValidationError):
            schema_valid = False
        assert schema_valid or not valid
    constraint = StructuredOutputsParams(json=ANSWER, reasoning="harmony")
    assert _accepts(grammars, constraint, turn) == valid
    choice = StructuredOutputsParams(choice=["yes", "no"], reasoning="harmony")
    assert _accepts(grammars, choice, [("analysis", "x", None), ("final", "no", None)])
    assert not _accepts(grammars, choice, [("final", "nope", None)])


CALL_TOOLS = TOOLS + [{"type": "function", "function": {"name": "set-unit", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["unit"],
    "properties": {"unit": {"enum": ["c", "f"]}}}}}]


@pytest.mark.parametrize("choice", ["required", "get_weather", "set-unit"])
def test_a_required_or_named_tool_is_a_message_to_the_function(grammars, choice):
    """tool_choice required / named: one message to functions.NAME (after any analysis)
    holding the arguments; read back, the call is what harmony's own parser reads."""
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    plan = harmony.call_plan(tool_calling.plan(CALL_TOOLS, tool_choice, None, None),
                             CALL_TOOLS)
    constraint = plan.constraint()
    calls = {"get_weather": '{"city": "Paris"}', "get_time": "{}", "set-unit": '{"unit": "f"}'}
    for name, arguments in calls.items():
        turn = [("analysis", "Need a tool.", None),
                ("commentary", arguments, f"functions.{name}")]
        takes = choice in ("required", name)
        assert _accepts(grammars, constraint, turn) == takes, name
        assert _accepts(grammars, constraint, turn[1:]) == takes, name
        if takes:
            tokens, text = _output(turn)
            _, content = harmony.split(text)
            content, tool_calls = tool_calling.message(plan, content)
            assert content is None
            assert [(c["function"]["name"], c["function"]["arguments"])
                    for c in tool_calls] == _oracle(tokens)[2]
    wrong = {"get_weather": '{"city": 3}', "set-unit": '{"unit": "k"}'}.get(choice)
    if wrong is not None:
        assert not _accepts(grammars, constraint, [("commentary", wrong, f"functions.{choice}")])
    assert not _accepts(grammars, constraint, [("final", '{"city": "Paris"}', None)])


@pytest.mark.slow
def test_a_server_answers_constrained_requests_in_harmony(checkpoints, tmp_path):
    """A tiny model with harmony's markers in its tokenizer, served with the parser:
    response_format gives content that validates, tool_choice named and required give
    the call (streamed alike); a prompt that does not end with the generation prompt is
    a 400 naming the field. logit_bias steers the random model's free choices (into the
    final message, or to the call) where the grammar leaves it several."""
    import openai

    source, _ = checkpoints("llama")
    path = tmp_path / "model"
    shutil.copytree(source, path)
    ids = write_harmony_tokenizer(path)
    byte = Tokenizer.from_pretrained(path)
    f, c = (byte.encode(x, add_special_tokens=False)[0] for x in ("f", "c"))
    with running_server(path, tmp_path / "server.log", "--reasoning-parser", "openai_gptoss",
                        "--tool-call-parser", "openai") as (_, server):
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
        body = dict(model=str(path), max_tokens=40, temperature=0,
                    messages=[{"role": "user", "content": "Answer?"}])
        schema = {"type": "object", "additionalProperties": False, "required": ["answer"],
                  "properties": {"answer": {"enum": ["yes", "no"]}}}
        response_format = {"type": "json_schema",
                           "json_schema": {"name": "answer", "schema": schema}}
        token_ids = {"return_token_ids": True}

        def written(r) -> str:  # what the model wrote, markers and all
            return byte.decode(r.choices[0].token_ids, skip_special_tokens=False)

        bias = {str(f): 50, str(ids["<|message|>"]): 100}
        r = client.chat.completions.create(**body, response_format=response_format,
                                           logit_bias=bias, extra_body=token_ids)
        message = r.choices[0].message
        jsonschema.validate(json.loads(message.content), schema)
        assert written(r) == f"<|channel|>final<|message|>{message.content}"
        assert r.choices[0].finish_reason == "stop" and not message.tool_calls
        stream = client.chat.completions.create(**body, response_format=response_format,
                                                logit_bias=bias, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices) == message.content

        body["max_tokens"] = 80  # the call's header alone is 33 of these byte tokens
        bias = {str(c): 50, str(ids["<|message|>"]): 100}
        named = {"type": "function", "function": {"name": "set-unit"}}
        r = client.chat.completions.create(**body, tools=CALL_TOOLS, tool_choice=named,
                                           logit_bias=bias, extra_body=token_ids)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "set-unit" and r.choices[0].finish_reason == "stop"
        assert written(r) == ("<|channel|>commentary to=functions.set-unit<|message|>"
                              f"{call.function.arguments}")
        jsonschema.validate(json.loads(call.function.arguments),
                            CALL_TOOLS[2]["function"]["parameters"])
        stream = client.chat.completions.create(**body, tools=CALL_TOOLS, tool_choice=named,
                                                logit_bias=bias, stream=True)
        streamed = [t for chunk in stream if chunk.choices
                    for t in chunk.choices[0].delta.tool_calls or []]
        assert [(t.function.name, t.function.arguments) for t in streamed] == \
            [(call.function.name, call.function.arguments)]
        r = client.chat.completions.create(**body, tools=CALL_TOOLS, tool_choice="required",
                                           logit_bias=bias)
        (call,) = r.choices[0].message.tool_calls
        tool = next(t for t in CALL_TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments),
                            tool["function"]["parameters"])
        assert r.choices[0].finish_reason == "tool_calls"

        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**body, response_format=response_format,
                                           extra_body={"add_generation_prompt": False})
        assert e.value.body["param"] == "response_format"
        assert "<|start|>assistant" in e.value.body["message"]
