"""Tool-call parsers on outputs written the way each model family writes its calls (the
formats their chat templates ask for), and the streaming of calls: the deltas of a choice
fed piece by piece add up to the message parsed from its whole text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server import tool_calling
from server.tool_parsers import get_parser

WEATHER = '{"city": "Paris", "unit": "celsius"}'

CASES = [
    # (parser, output, content, [(name, arguments)])
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
     '</tool_call>',
     "Let me check both.\n", [("get_weather", '{"city": "Paris"}'),
                              ("get_time", '{"tz": "CET"}')]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', []),
    ("hermes", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + WEATHER + '}',
     None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
     '{"name": "get_time", "parameters": {"tz": "CET"}}',
     None, [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')]),
    ("llama3_json", 'It is sunny in {"city": "Paris"}', 'It is sunny in {"city": "Paris"}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": "{\\"city\\": \\"Rome\\"}"}',
     None, [("get_weather", '{"city": "Rome"}')]),  # arguments as JSON text
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + WEATHER + '}]',
     None, [("get_weather", WEATHER)]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time'
     '[ARGS]{"tz": "CET"}', "Sure. ", [("get_weather", '{"city": "Lyon"}'),
                                       ("get_time", '{"tz": "CET"}')]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Nice"}',
     None, [("get_weather", '{"city": "Nice"}')]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Metz"}',  # [ARGS] decoded away
     None, [("get_weather", '{"city": "Metz"}')]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     "```json\n" + WEATHER + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     None, [("get_weather", WEATHER)]),
    ("deepseek_v3", "Let me check both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
     '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
     '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "CET"}\n```'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Let me check both.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     '```json\n{"city": "Pa',  # cut short
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     '```json\n{"city": "Pa', []),
    ("deepseek_v3", "It is sunny ```json\n{}```", "It is sunny ```json\n{}```", []),
    # V3.1's format: NAME<sep>ARGUMENTS.
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": '
     '"Oslo"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "CET"}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     None, [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     "<|tool_call_argument_begin|>" + WEATHER + "<|tool_call_end|><|tool_calls_section_end|>",
     None, [("get_weather", WEATHER)]),
    ("kimi_k2", "I will check both.<|tool_calls_section_begin|>\n<|tool_call_begin|>"
     'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>\n'
     '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "CST"}'
     "<|tool_call_end|>\n<|tool_calls_section_end|>",
     "I will check both.", [("get_weather", '{"city": "Beijing"}'), ("get_time", '{"tz": "CST"}')]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Bei',  # cut short
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Bei', []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parsers_read_recorded_outputs(name, text, content, calls):
    parsed = get_parser(name).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_calls_add_up_to_the_message(name, text, content, calls, piece):
    plan = tool_calling.ToolPlan("auto", parser=get_parser(name))
    stream = tool_calling.ToolStream(plan)
    deltas = []
    for i in range(0, len(text), piece):
        deltas += stream.feed(text[i:i + piece])
    deltas += stream.finish()
    streamed = "".join(d.get("content", "") for d in deltas)
    got = [c["function"] for d in deltas for c in d.get("tool_calls", [])]
    want_content, want_calls = tool_calling.message(plan, text)
    assert streamed == (want_content or "")
    assert [(f["name"], json.loads(f["arguments"])) for f in got] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want_calls]
    assert stream.num_calls == len(calls)
    assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == list(
        range(len(calls)))


def test_kimi_k2_calls_keep_their_own_ids():
    """Kimi's template writes a tool's result under its call's id: the id goes back as the
    model wrote it (whole and streamed)."""
    text = CASES[-2][1]
    _, calls = tool_calling.message(tool_calling.ToolPlan("auto", parser=get_parser("kimi_k2")),
                                    text)
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    stream = tool_calling.ToolStream(tool_calling.ToolPlan("auto", parser=get_parser("kimi_k2")))
    deltas = stream.feed(text) + stream.finish()
    assert [d["tool_calls"][0]["id"] for d in deltas if "tool_calls" in d] == [
        "functions.get_weather:0", "functions.get_time:1"]


def test_content_that_might_open_a_call_is_held_back():
    stream = tool_calling.ToolStream(tool_calling.ToolPlan("auto", parser=get_parser("hermes")))
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]
    assert stream.feed("box> there") == [{"content": "<toolbox> there"}]
    assert stream.finish() == []


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("tools, choice, parser, problem", [
    (None, "required", None, "needs tools"),
    (TOOLS, "auto", None, "--tool-call-parser"),
    (None, {"type": "function", "function": {"name": "x"}}, None, "needs tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "not in tools"),
])
def test_bad_tool_choices(tools, choice, parser, problem):
    with pytest.raises(tool_calling.ToolChoiceError, match=problem):
        tool_calling.plan(tools, choice, None, parser)


def test_plans():
    assert tool_calling.plan(TOOLS, "none", None, None) is None
    assert tool_calling.plan(None, None, None, None) is None
    assert tool_calling.plan(TOOLS, None, None, get_parser("hermes")).mode == "auto"
    required = tool_calling.plan(TOOLS, "required", False, None)
    assert required.schema["maxItems"] == 1
    assert [b["properties"]["name"]["const"] for b in required.schema["items"]["anyOf"]] == [
        "get_weather", "get_time"]
    named = tool_calling.plan(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                              None, None)
    assert named.schema == {"type": "object", "properties": {}}


TEMPLATES = Path(__file__).parent / "chat_templates"


@pytest.mark.parametrize("template, parser, bos, end, calls", [
    ("qwen2.5", "hermes", "", "<|im_end|>", 2),
    ("qwen3", "hermes", "", "<|im_end|>", 2),
    ("llama3.1", "llama3_json", "<|begin_of_text|>", "<|eot_id|>", 1),  # one call a turn
    ("mistral-v0.3", "mistral", "<s>", "</s>", 2),
])
def test_parsers_read_what_each_family_template_writes(template, parser, bos, end, calls):
    """The model families' own chat templates (tests/chat_templates, rendered by
    transformers) write an assistant turn with tool calls: the text between the generation
    prompt and the end of the turn is what the model was trained to emit, and the parser
    gives back the calls that went in."""
    from transformers.utils.chat_template_utils import render_jinja_template

    wanted = [("get_weather", {"location": "Paris", "unit": "celsius"}),
              ("get_time", {"tz": "Europe/Paris"})][:calls]
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call{i}abcd", "type": "function",
         "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(wanted)]}
    user = {"role": "user", "content": "What is the weather and the time in Paris?"}
    source = (TEMPLATES / f"{template}.jinja").read_text()

    def render(messages, **kw):
        return render_jinja_template([messages], chat_template=source, bos_token=bos,
                                     eos_token=end, **kw)[0][0]

    prompt = render([user], add_generation_prompt=True)
    whole = render([user, turn])
    assert whole.startswith(prompt.rstrip())
    output = whole[len(prompt):] if whole.startswith(prompt) else whole[len(prompt.rstrip()):]
    output = output[:output.rindex(end)]
    parsed = get_parser(parser).parse(output)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == wanted, output
    # Qwen3 writes an (empty) reasoning block first: content, as there is no reasoning parser.
    assert (parsed.content or "").strip() in ("", "<think>\n\n</think>"), output


@pytest.mark.parametrize("template", ["deepseek-r1", "deepseek-v3.1"])
@pytest.mark.parametrize("calls", [1, 2])
def test_deepseek_parser_reads_what_deepseek_templates_write(template, calls):
    """DeepSeek-R1's template (V3's format: TYPE<sep>NAME and a ```json block; with one
    call it writes no <｜tool▁calls▁end｜> nor end of sentence) and DeepSeek-V3.1's (NAME<sep>ARGUMENTS) write
    an assistant turn's calls, with its arguments as the JSON text a request carries:
    `deepseek_v3` gives them back, and nothing as content."""
    from transformers.utils.chat_template_utils import render_jinja_template

    wanted = [("get_weather", {"location": "Paris", "unit": "celsius"}),
              ("get_time", {"tz": "Europe/Paris"})][:calls]
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call{i}abcd", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}
        for i, (name, arguments) in enumerate(wanted)]}
    user = {"role": "user", "content": "What is the weather and the time in Paris?"}
    source = (TEMPLATES / f"{template}.jinja").read_text()

    def render(messages):
        return render_jinja_template([messages], chat_template=source,
                                     bos_token="<｜begin▁of▁sentence｜>")[0][0]

    asked, whole = render([user]), render([user, turn])
    assert whole.startswith(asked)
    # The turn after the user's: what follows <｜Assistant｜> (and V3.1's closed think block).
    output = whole[len(asked):].removeprefix("<｜Assistant｜>").removeprefix("</think>")
    output = output.split("<｜end▁of▁sentence｜>")[0]  # R1's: none after one call
    parsed = get_parser("deepseek_v3").parse(output)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == wanted, output
    assert parsed.content is None, output
