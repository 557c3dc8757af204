"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) over the chat
pipeline.

A request's `instructions` and `input` items (messages with text and image parts, the
function calls a model made and their outputs) become chat messages, after the stored
conversation of its `previous_response_id`; its function `tools`, `tool_choice` and
`text.format` the chat's tools, tool choice and response_format. The finished choice
becomes output items: a `reasoning` item (its reasoning block, with --reasoning-parser),
a `message` with its `output_text`, and a `function_call` per tool call. Streamed, the
chat deltas (server/chat_deltas.py) become the API's events: `response.created`, each
item's `output_item.added`, its text's deltas and `.done` events, `output_item.done`,
then `response.completed` (or `response.incomplete` at max_output_tokens). With
`include: ["message.output_text.logprobs"]` the text carries chat's logprobs. A response
with `store` (the default) is kept in memory, the newest MAX_STORED, for
`previous_response_id` and GET; a `background` one is stored at once, in progress, with
its job, which `POST /v1/responses/{id}/cancel` aborts.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from server import openai_protocol as oai

MAX_STORED = 1024  # responses kept for previous_response_id and GET (oldest dropped)
LOGPROBS = "message.output_text.logprobs"  # what `include` names for the text's logprobs


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's `POST /v1/responses` this server serves (others ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    # "message.output_text.logprobs" puts each output token's logprob (and the
    # top_logprobs most likely there, 0..20; more than 0 asks for them too) in the output
    # text; other values are ignored.
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None

    @property
    def logprobs(self) -> bool:
        """Whether the text's logprobs are asked for (top_logprobs > 0 asks too)."""
        return LOGPROBS in (self.include or ()) or bool(self.top_logprobs)

    def checked(self) -> ResponsesRequest:
        """APIError 400 for what this server does not serve."""
        if self.background and not self.store:
            raise oai.APIError(400, "background: needs store true (the response is read back "
                                    "with GET /v1/responses/{id})", "background")
        if self.background and self.stream:
            raise oai.APIError(400, "background: not served streamed; poll GET "
                                    "/v1/responses/{id} instead", "background")
        if self.logprobs and self.tools:
            raise oai.APIError(400, "include: message.output_text.logprobs is not served "
                                    "with tools (a call's tokens are not the text's)",
                               "include")
        for tool in self.tools:
            if tool.get("type") != "function":
                raise oai.APIError(400, f"tools: only function tools are served (got "
                                        f"{tool.get('type')!r})", "tools")
        return self


@dataclasses.dataclass
class Stored:
    """A stored response: the conversation that led to it (without instructions, which
    do not carry over) and its body."""

    messages: list[dict]
    body: dict
    job: Any = None  # a background response's while it runs (server/http_server.Job)


class Store:
    """The newest MAX_STORED responses, by id."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()

    def get(self, response_id: str, param: str = "previous_response_id") -> Stored:
        """The stored response (APIError 404 naming `param` if none)."""
        stored = self._items.get(response_id)
        if stored is None:
            raise oai.APIError(404, f"no stored response with id {response_id!r} (only "
                                    f"responses made with store true are kept, the newest "
                                    f"{self.capacity})", param, code="not_found")
        return stored

    def cancel(self, response_id: str) -> dict:
        """Cancel a background response that runs (its job aborted; its body says
        `cancelled` from now on, and once it ends); one that ended is left as it is."""
        stored = self.get(response_id, "response_id")
        if not stored.body.get("background"):
            raise oai.APIError(400, "only a response made with background true can be "
                                    "cancelled", "response_id")
        if stored.job is not None:
            stored.job.abort()
            stored.job = None
            stored.body = {**stored.body, "status": "cancelled"}
        return stored.body

    def cancelled(self, response_id: str) -> bool:
        stored = self._items.get(response_id)
        return stored is not None and stored.body["status"] == "cancelled"

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's input items as chat messages (APIError 400 for an unknown one)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    messages: list[dict] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise oai.APIError(400, f"input: a message's role is system, developer, user "
                                        f"or assistant (got {item.get('role')!r})", "input")
            messages.append({"role": role, "content": _content(item.get("content"))})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id"), "type": "function",
                    "function": {"name": _text(item, "name"),
                                 "arguments": _text(item, "arguments")}}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id"),
                             "content": output if isinstance(output, str) else _content(output)})
        elif kind != "reasoning":  # (a model's earlier reasoning is not shown to it again)
            raise oai.APIError(400, f"input: items of type {kind!r} are not served (message, "
                                    "function_call, function_call_output, reasoning are)",
                               "input")
    return messages


def _text(item: dict, field: str) -> str:
    """An input item's string field (APIError 400 if it has none)."""
    value = item.get(field)
    if not isinstance(value, str):
        raise oai.APIError(400, f"input: a {item.get('type')} item needs a string "
                                f"{field!r}", "input")
    return value


def _content(content: Any) -> Any:
    """A message's content as chat content: text, or parts (text and image_url)."""
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise oai.APIError(400, "input: a message's content is a string or a list of parts",
                           "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        else:
            raise oai.APIError(400, f"input: content parts of type {kind!r} are not served "
                                    "(input_text, output_text, input_image with an "
                                    "image_url are)", "input")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a later turn shows the model."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text or None}
    return [{**message, "tool_calls": calls} if calls else message]


def chat_request(req: ResponsesRequest, messages: list[dict]) -> oai.ChatCompletionRequest:
    """The chat completion request that answers `req` over `messages`."""
    return oai.ChatCompletionRequest.model_validate(chat_body(req, messages))


def chat_body(req: ResponsesRequest, messages: list[dict]) -> dict:
    """`chat_request`'s JSON body (what the PD router sends on)."""
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p, "seed": req.seed,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "user": req.user,
        "priority": req.priority, "cache_salt": req.cache_salt, "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "structured_outputs": req.structured_outputs,
        "reasoning_effort": (req.reasoning or {}).get("effort")}
    if req.logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}}
            for t in req.tools]
        body["parallel_tool_calls"] = req.parallel_tool_calls
        choice = req.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not choice.get("name"):
                raise oai.APIError(400, "tool_choice: auto, none, required or "
                                        "{\"type\": \"function\", \"name\": ...}",
                                   "tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        body["tool_choice"] = choice
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema", {}),
            "strict": fmt.get("strict")}}
    elif fmt.get("type") != "text":
        raise oai.APIError(400, "text.format: text, json_object or json_schema", "text")
    return {k: v for k, v in body.items() if v is not None}


def output_items(message: dict, status: str, logprobs: list[dict] = ()) -> list[dict]:
    """A finished chat message as output items: reasoning, message (its text's `logprobs`,
    chat's entries), function calls."""
    items = []
    if message.get("reasoning_content") is not None:
        items.append(_reasoning_item(new_id("rs"), message["reasoning_content"], status))
    if message.get("content") is not None or not message.get("tool_calls"):
        items.append(_message_item(new_id("msg"), message.get("content") or "", status))
        items[-1]["content"][0]["logprobs"] = list(logprobs)
    for call in message.get("tool_calls") or ():
        items.append(_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                call["function"]["arguments"], "completed"))
    return items


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def usage(chat_usage: dict, reasoning_tokens: int, page_size: int) -> dict:
    """A chat usage as the Responses API's; `page_size` 0: no prefix cache (else the
    prompt's full pages that were not read from it were written to it)."""
    prompt, cached = chat_usage["prompt_tokens"], chat_usage["prompt_tokens_details"][
        "cached_tokens"]
    written = max(0, prompt // page_size * page_size - cached) if page_size else 0
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}


def status_of(finish_reason: str | None) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a response whose choice ended so."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish_reason in ("abort", "error"):
        return "failed", None, {"code": "server_error",
                                "message": "the request was aborted" if finish_reason ==
                                "abort" else "the engine failed the request"}
    return "completed", None, None


def body(req: ResponsesRequest, response_id: str, model: str, created: float,
         output: list[dict], finish_reason: str | None, usage_: dict | None) -> dict:
    """A response object (`finish_reason` None: still in progress)."""
    status, incomplete, error = (("in_progress", None, None) if finish_reason is None
                                 else status_of(finish_reason))
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "status": status, "output": output, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": req.tool_choice, "tools": req.tools,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning,
            "store": req.store, "truncation": "disabled", "usage": usage_, "user": req.user,
            "background": req.background}


class Events:
    """A streamed response's events, from its chat deltas: each output item opened when
    its first delta comes (`output_item.added`, and a content part), its deltas, and
    closed (`.done` events) when another kind of delta or the end comes."""

    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []  # items so far, as they are now
        self._open: str | None = None  # "reasoning" | "message" | "call": the last item's
        self._logprobs: list[dict] = []  # the text's, not yet sent with a delta

    def add_logprobs(self, entries: list[dict]) -> None:
        """Logprobs of output tokens (chat's entries): sent with the next text delta (the
        text of a token may come a step later, held back), the rest when the text ends."""
        self._logprobs += entries

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def feed(self, delta: dict) -> list[dict]:
        """The events of one chat delta."""
        events: list[dict] = []
        if "reasoning_content" in delta:
            events += self._text("reasoning", delta["reasoning_content"])
        elif "content" in delta and delta["content"]:
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            fn = call.get("function", {})
            if "id" in call:  # a new call
                events += self.close()
                self.output.append(_call_item(new_id("fc"), call["id"], fn.get("name", ""),
                                              "", "in_progress"))
                self._open = "call"
                events.append(self.event("response.output_item.added",
                                         output_index=len(self.output) - 1,
                                         item=dict(self.output[-1])))
            if fn.get("arguments"):
                item = self.output[-1]
                item["arguments"] += fn["arguments"]
                events.append(self.event("response.function_call_arguments.delta",
                                         item_id=item["id"], output_index=len(self.output) - 1,
                                         delta=fn["arguments"]))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = self._start(kind) if self._open != kind else []
        item, index = self.output[-1], len(self.output) - 1
        item["content"][0]["text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        fields = {} if kind == "reasoning" else {"logprobs": self._take_logprobs(item)}
        events.append(self.event(f"response.{name}.delta", item_id=item["id"],
                                 output_index=index, content_index=0, delta=text, **fields))
        return events

    def _take_logprobs(self, item: dict) -> list[dict]:
        """The pending logprobs, now the message `item`'s too."""
        taken, self._logprobs = self._logprobs, []
        part = item["content"][0]
        part["logprobs"] = part["logprobs"] + taken  # (earlier events keep theirs)
        return taken

    def _start(self, kind: str) -> list[dict]:
        """Close the open item and open a reasoning item or a message, with its one
        content part."""
        events = self.close()
        item = (_reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning"
                else _message_item(new_id("msg"), "", "in_progress"))
        part = item["content"][0]
        self.output.append({**item, "content": [dict(part)]})
        self._open = kind
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index,
                                 item={**item, "content": []}))
        events.append(self.event("response.content_part.added", item_id=item["id"],
                                 output_index=index, content_index=0, part=part))
        return events

    def finish(self, status: str) -> list[dict]:
        """The events that close the output (an empty message if it had nothing, as
        a whole response's output has)."""
        events = [] if self.output else self._start("message")
        return events + self.close(status)

    def close(self, status: str = "completed") -> list[dict]:
        """The events that finish the open item (none if none is)."""
        if self._open is None:
            return []
        item, index = self.output[-1], len(self.output) - 1
        item["status"] = "completed" if self._open == "call" else status
        events = []
        if self._open == "call":
            events.append(self.event("response.function_call_arguments.done",
                                     item_id=item["id"], output_index=index,
                                     arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "reasoning_text" if self._open == "reasoning" else "output_text"
            if self._open == "message":
                self._take_logprobs(item)
            fields = {} if self._open == "reasoning" else {"logprobs": part["logprobs"]}
            events.append(self.event(f"response.{name}.done", item_id=item["id"],
                                     output_index=index, content_index=0,
                                     text=part["text"], **fields))
            events.append(self.event("response.content_part.done", item_id=item["id"],
                                     output_index=index, content_index=0, part=dict(part)))
        events.append(self.event("response.output_item.done", output_index=index,
                                 item=dict(item)))
        self._open = None
        return events

