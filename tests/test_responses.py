"""The Responses API's translation (server/responses.py), without a server: input items
to chat messages, a chat message to output items, and chat deltas to stream events, each
event checked against the openai package's types (strict pydantic validation). The
servers' tests (test_http_server.py) run it end to end."""

from __future__ import annotations

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from server import openai_protocol as oai
from server import responses

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def _request(**kw) -> responses.ResponsesRequest:
    return responses.ResponsesRequest.model_validate({"input": "hi", **kw}).checked()


def test_input_items_become_chat_messages():
    req = _request(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is "}, {"type": "input_text", "text": "this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]}])
    assert responses.input_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is "}, {"type": "text", "text": "this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function",
             "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    chat = responses.chat_request(_request(
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"}, max_output_tokens=7,
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}),
        [{"role": "user", "content": "hi"}])
    assert chat.max_completion_tokens == 7 and chat.tool_choice_value() == {
        "type": "function", "function": {"name": "f"}}
    assert chat.tool_dicts() == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "file_search"}]), "tools"),
    (dict(background=True, store=False), "background"),
    (dict(background=True, stream=True), "background"),
    (dict(top_logprobs=3, tools=[{"type": "function", "name": "f"}]), "include"),
    (dict(input=[{"type": "message", "role": "tool", "content": "x"}]), "input"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file"}]}]), "input"),
    (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), "input"),
])
def test_what_is_not_served_is_a_400(kw, param):
    with pytest.raises(oai.APIError) as e:
        responses.input_messages(_request(**kw))
    assert (e.value.status, e.value.param) == (400, param)


def test_stream_events_add_up_to_the_whole_response():
    """Reasoning, text, a named call's streamed arguments and a whole second call: every
    event is of the openai package's types; each item's deltas come between its
    `output_item.added` and `.done`, add up to its text, and the output the events build
    is what a whole response carries for the same message."""
    events = responses.Events()
    deltas = [{"reasoning_content": "Let me "}, {"reasoning_content": "see."},
              {"content": "It is "}, {"content": "sunny."},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"ci"}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "ty\": \"Oslo\"}"}}]},
              {"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "get_time", "arguments": "{}"}}]}]
    out = [e for d in deltas for e in events.feed(d)] + events.finish("completed")
    for event in out:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    open_items, texts = {}, {}
    for e in out:
        if e["type"] == "response.output_item.added":
            open_items[e["item"]["id"]] = e["output_index"]
            texts[e["item"]["id"]] = ""
        elif e["type"].endswith(".delta"):
            assert open_items[e["item_id"]] == e["output_index"]
            texts[e["item_id"]] += e["delta"]
        elif e["type"].endswith("_text.done"):
            assert e["text"] == texts[e["item_id"]]
        elif e["type"] == "response.function_call_arguments.done":
            assert e["arguments"] == texts[e["item_id"]]
        elif e["type"] == "response.output_item.done":
            assert open_items.pop(e["item"]["id"]) == e["output_index"]
    assert not open_items
    message = {"role": "assistant", "content": "It is sunny.",
               "reasoning_content": "Let me see.", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                   {"id": "call_2", "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"}}]}
    whole = responses.output_items(message, "completed")

    def shape(items):
        return [{k: v for k, v in i.items() if k != "id"} for i in items]

    assert shape(events.output) == shape(whole)
    req = _request()
    chat_usage = oai.usage(10, 20, 4)
    body = responses.body(req, "resp_1", "m", 1.0, events.output, "tool_calls",
                          responses.usage(chat_usage, 3, 4))
    parsed = Response.model_validate(body)
    assert parsed.output_text == "It is sunny." and parsed.status == "completed"
    assert (parsed.usage.input_tokens_details.cached_tokens,
            parsed.usage.input_tokens_details.cache_write_tokens) == (4, 4)


def test_an_empty_output_is_one_empty_message():
    events = responses.Events()
    out = events.finish("incomplete")
    for event in out:
        EVENT.validate_python(event)
    assert [i["type"] for i in events.output] == ["message"]
    assert events.output[0]["status"] == "incomplete"
    assert events.output[0]["content"][0]["text"] == ""
