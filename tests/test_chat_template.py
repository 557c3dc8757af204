"""Chat templates render and tokenize exactly as transformers' `apply_chat_template`.

The templates in tests/chat_templates/ are the public ones of Llama 3.1 / 3.2, Qwen2.5,
Qwen3, Mistral 7B Instruct v0.3, Gemma 2 / 3, DeepSeek-R1 and DeepSeek-V3.1. Each family gets a small byte-level BPE
tokenizer with its control tokens as special tokens, saved as a Hugging Face checkpoint
directory that both transformers and jaxserve load.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from jaxserve.loading.chat_template import ChatTemplate, ChatTemplateError
from jaxserve.loading.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
TEXT = ("You are a helpful assistant. What is the weather in Paris today? It is sunny and "
        "warm, about 24 degrees. Thanks! Tell me a joke about tools and functions. "
        "get_weather location unit celsius call_id result {\"temperature\": 24}")

# family: (templates, bos, eos, control tokens)
FAMILIES = {
    "llama3": (("llama3.1", "llama3.2"), "<|begin_of_text|>", "<|eot_id|>",
               ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]),
    "qwen": (("qwen2.5", "qwen3"), None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "mistral": (("mistral-v0.3",), "<s>", "</s>",
                ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "gemma": (("gemma2", "gemma3"), "<bos>", "<eos>",
              ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"]),
    "deepseek": (("deepseek-r1", "deepseek-v3.1"), "<｜begin▁of▁sentence｜>",
                 "<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                                          "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                                          "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                                          "<｜tool▁calls▁end｜>"]),
}
TEMPLATE_FAMILY = {t: f for f, (ts, *_) in FAMILIES.items() for t in ts}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is the weather in Paris today?"}
ASSISTANT = {"role": "assistant", "content": "It is sunny and warm. "}
USER2 = {"role": "user", "content": " Thanks! Tell me a joke.\n"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city, in °C or °F",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "City, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]}}}]
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call12345", "type": "function",
    "function": {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}}]}
RESULT = {"role": "tool", "tool_call_id": "call12345", "content": '{"temperature": 24}'}

CONVERSATIONS = {
    "user": [USER],
    "system+user": [SYSTEM, USER],
    "multi-turn": [USER, ASSISTANT, USER2],
    "system+multi-turn": [SYSTEM, USER, ASSISTANT, USER2],
}
# Templates that take tools, and the tool round trip each can render.
TOOL_TEMPLATES = ("llama3.1", "llama3.2", "qwen2.5", "qwen3", "mistral-v0.3")
NO_SYSTEM = ("gemma2",)


def _build(directory: Path, template: str) -> Path:
    _, bos, eos, control = FAMILIES[TEMPLATE_FAMILY[template]]
    specials = [t for t in (bos, eos) if t] + control
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "clean_up_tokenization_spaces": False,
              "chat_template": (TEMPLATES / f"{template}.jinja").read_text()}
    if bos:
        config["bos_token"] = bos
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tokenizers_by_template(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for template in TEMPLATE_FAMILY:
        directory = _build(root / template, template)
        out[template] = (Tokenizer.from_pretrained(directory),
                         AutoTokenizer.from_pretrained(directory))
    return out


def _both(pair, messages, **kwargs):
    ours, hf = pair
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(messages, **kwargs)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return text, ids


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("template, conversation", [
    (t, c) for t in TEMPLATE_FAMILY for c in CONVERSATIONS
    # Gemma 2 refuses system messages: test_template_errors_are_chat_template_errors.
    if not (t in NO_SYSTEM and CONVERSATIONS[c][0]["role"] == "system")])
def test_renders_as_transformers(tokenizers_by_template, template, conversation,
                                 generation_prompt):
    messages = CONVERSATIONS[conversation]
    text, ids = _both(tokenizers_by_template[template], messages,
                      add_generation_prompt=generation_prompt)
    assert USER["content"].strip() in text
    assert len(ids) > 10


@pytest.mark.parametrize("template", TOOL_TEMPLATES)
def test_tools_and_tool_round_trip_render_as_transformers(tokenizers_by_template, template):
    pair = tokenizers_by_template[template]
    text, _ = _both(pair, [SYSTEM, USER], tools=TOOLS, add_generation_prompt=True)
    assert "get_weather" in text and "celsius" in text
    text, _ = _both(pair, [SYSTEM, USER, CALL, RESULT], tools=TOOLS, add_generation_prompt=True)
    assert "Paris" in text and "24" in text


def test_template_keyword_arguments_reach_the_template(tokenizers_by_template):
    text, _ = _both(tokenizers_by_template["qwen3"], [USER], add_generation_prompt=True,
                    enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    text, _ = _both(tokenizers_by_template["llama3.1"], [USER], date_string="1 Jan 2030")
    assert "Today Date: 1 Jan 2030" in text
    text, _ = _both(tokenizers_by_template["deepseek-v3.1"], [USER], add_generation_prompt=True,
                    thinking=True)
    assert text.endswith("<｜Assistant｜><think>")


def test_strftime_now_gives_todays_date(tokenizers_by_template):
    from datetime import datetime
    text, _ = _both(tokenizers_by_template["llama3.2"], [USER])
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in text


@pytest.mark.parametrize("template", ["llama3.1", "qwen2.5", "mistral-v0.3", "gemma3"])
def test_continue_final_message_as_transformers(tokenizers_by_template, template):
    messages = [USER, {"role": "assistant", "content": "It is sunny and"}]
    text, _ = _both(tokenizers_by_template[template], messages, continue_final_message=True)
    assert text.endswith("It is sunny and")


def test_content_parts(tokenizers_by_template):
    parts = {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                         {"type": "text", "text": "in Paris today?"}]}
    # Gemma 3 loops over parts: the list reaches the template, as in transformers.
    _both(tokenizers_by_template["gemma3"], [SYSTEM, parts, ASSISTANT, parts])
    # String-only templates get the text parts joined by newlines (vLLM's rule).
    ours, hf = tokenizers_by_template["llama3.1"]
    joined = {"role": "user", "content": "What is the weather\nin Paris today?"}
    assert ours.apply_chat_template([parts]) == hf.apply_chat_template(
        [joined], tokenize=True, return_dict=False)
    with pytest.raises(ChatTemplateError, match="content parts"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


@pytest.mark.parametrize("template, messages, message", [
    ("gemma2", [SYSTEM, USER], "System role not supported"),
    ("gemma3", [USER, USER], "roles must alternate"),
    ("mistral-v0.3", [USER, ASSISTANT, ASSISTANT], "roles must alternate"),
    ("mistral-v0.3", [USER, {"role": "tool", "tool_call_id": "short", "content": "x"}],
     "length 9"),
    ("llama3.1", [SYSTEM, {**CALL, "tool_calls": CALL["tool_calls"] * 2}], "single tool-calls"),
])
def test_template_errors_are_chat_template_errors(tokenizers_by_template, template, messages,
                                                  message):
    ours, hf = tokenizers_by_template[template]
    with pytest.raises(jinja2.TemplateError, match=message):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError, match=message):
        ours.apply_chat_template(messages)


def test_bad_requests_fail_clearly(tokenizers_by_template, tmp_path):
    ours, _ = tokenizers_by_template["qwen2.5"]
    for messages, match in [([], "at least one message"), ([{"content": "hi"}], "role"),
                            ([{"role": "user", "content": 3}], "content"),
                            (["hi"], "must be an object")]:
        with pytest.raises(ChatTemplateError, match=match):
            ours.apply_chat_template(messages)
    with pytest.raises(ChatTemplateError, match="exclusive"):
        ours.apply_chat_template([USER], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")
    ours.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.apply_chat_template([USER])
    assert ours.apply_chat_template([USER], chat_template="{{ messages[0].content }}",
                                    tokenize=False) == USER["content"]


def test_the_sandbox_holds(tokenizers_by_template):
    ours, _ = tokenizers_by_template["qwen2.5"]
    for source in ("{{ messages.__class__.__mro__ }}",
                   "{{ ''.__class__.__subclasses__() }}",
                   "{% set ns = namespace() %}{% set ns._x = 1 %}",
                   "{{ messages.append(1) }}"):
        with pytest.raises(ChatTemplateError):
            ours.apply_chat_template([USER], chat_template=source)
