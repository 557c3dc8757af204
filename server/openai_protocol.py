"""OpenAI's request bodies (with vLLM's extra fields) and the response shapes built from
engine outputs. Pure data: the routes live in server/http_server.py.

Validation happens in two places and both name the field: pydantic checks types here
(`ValidationError` -> 400), SamplingParams and the engine check values (`ValueError`
-> 400). Unknown fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxserve.beam_search import BeamSearchParams
from jaxserve.outputs import Logprob, StepOutput, top_logprobs
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from server.kv_transfer import check_params

MAX_N = 128


class APIError(Exception):
    """An error answered in OpenAI's JSON shape with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(e: ValidationError) -> APIError:
    """A body that does not validate, as a 400 naming its first fault's field."""
    first = e.errors()[0]
    where = ".".join(str(x) for x in first["loc"])
    return APIError(400, f"{where}: {first['msg']}" if where else first["msg"],
                    str(first["loc"][0]) if first["loc"] else None)


def bad_request(e: Exception, default_param: str | None = None,
                body: type[BaseModel] | None = None) -> APIError:
    """A ValueError from SamplingParams / the engine / the chat template as a 400 naming the
    field it is about (of `body`'s fields; None: chat's and completions')."""
    message = str(e)
    match = re.match(r"SamplingParams\.(\w+)", message)
    if match is None and "max_tokens" in message and body is None:
        return APIError(400, message, "max_tokens")
    match = match or re.match(r"(\w+)[.:\s]", message)
    fields = (set(body.model_fields) if body is not None else
              set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields))
    param = match.group(1) if match and match.group(1) in fields else default_param
    return APIError(400, message, param)


# Fields beam search does not honour (a request setting one is refused).
_NOT_WITH_BEAMS = (
    "stream", "logprobs", "top_logprobs", "prompt_logprobs", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop",
    "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "kv_transfer_params", "tools", "prompt_embeds")


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not null).
    continuous_usage_stats: bool = False


class JSONSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` field (StructuredOutputsParams)."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True


class _Truncation(BaseModel):
    """vLLM's prompt truncation fields (completions, chat, embeddings)."""

    model_config = ConfigDict(extra="ignore")

    # Keep only the prompt's last N tokens (-1: as many as max_model_len allows).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] = "left"

    def truncated(self, ids: list[int], max_model_len: int, has_images: bool) -> list[int]:
        """The prompt's token ids after `truncate_prompt_tokens` (vLLM's: the last N by
        default, `truncation_side` "right" the first N). Not with images (their tokens
        are counted only when the engine places them)."""
        n = self.truncate_prompt_tokens
        if n is None:
            return ids
        field = "truncate_prompt_tokens"
        if has_images:
            raise APIError(400, f"{field}: not available for a prompt with images", field)
        if n == 0 or n >= max_model_len:
            raise APIError(400, f"{field}: must be -1 or in [1, {max_model_len - 1}] (the "
                                f"prompt must leave room for an output in max_model_len "
                                f"{max_model_len}), got {n}", field)
        n = max_model_len - 1 if n == -1 else n
        if len(ids) <= n:
            return ids
        return ids[-n:] if self.truncation_side == "left" else ids[:n]


class _Request(_Truncation):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    # Prefill/decode disaggregation (docs/disaggregation.md): {"do_remote_decode": true}
    # to a prefill server; a prefill response's, with "do_remote_prefill": true, to a
    # decode server.
    kv_transfer_params: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    speculative: bool = True  # ours: false keeps the request from speculative decoding
    # Each prompt token's logprob and the N most likely there (none for the first token).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words the output never writes
    # Lower is served first; anything but 0 needs --scheduling-policy priority.
    priority: int = 0
    # The prefix cache shares this request's K/V pages only with requests of this salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # The prompt's and each choice's token ids in the response (streamed: the prompt's in
    # the first chunk, each chunk's new ones).
    return_token_ids: bool = False
    # Logprobs name tokens "token_id:N" instead of their text.
    return_tokens_as_token_ids: bool = False
    # The response's id (after its "chatcmpl-" / "cmpl-"; the X-Request-Id header too).
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's beam search (jaxserve/beam_search.py): `n` beams, the n best returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def constraint_field(self) -> str | None:
        """The field the output constraint came in."""
        return next((f for f in ("response_format", "structured_outputs", "guided_json",
                                 "guided_regex", "guided_choice", "guided_grammar",
                                 "tool_choice") if getattr(self, f, None) is not None), None)

    def structured(self, tool_constraint: StructuredOutputsParams | None = None
                   ) -> StructuredOutputsParams | None:
        """The one output constraint asked for, from whichever field gave it."""
        given: dict[str, Any] = {}
        if tool_constraint is not None:
            given["tool_choice"] = tool_constraint
        if self.response_format is not None and self.response_format.type != "text":
            rf = self.response_format
            if rf.type == "json_object":
                given["response_format"] = dict(json_object=True)
            elif rf.json_schema is None:
                raise APIError(400, "response_format: type json_schema needs a json_schema "
                               "object with a schema", "response_format")
            else:
                given["response_format"] = dict(json=rf.json_schema.schema_)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given["structured_outputs"] = dict(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object),
                disable_any_whitespace=so.disable_any_whitespace)
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                given[field] = {key: getattr(self, field)}
        if len(given) > 1:
            raise APIError(400, f"{', '.join(given)}: give one output constraint, not "
                           f"{len(given)}", next(iter(given)))
        if not given:
            return None
        field, args = given.popitem()
        if isinstance(args, StructuredOutputsParams):
            return args
        try:
            return StructuredOutputsParams(**args)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", field) from None

    def prompt_logprob_count(self) -> int | None:
        """The prompt logprobs to compute (SamplingParams.prompt_logprobs): vLLM's
        `prompt_logprobs`, which a stream does not carry (as vLLM)."""
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs: not available when streaming",
                           "prompt_logprobs")
        return self.prompt_logprobs

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """`use_beam_search`'s params (`n` beams, greedy unless `temperature`); an
        APIError naming a field that beam search would not honour (vLLM's ignores them)."""
        fields = type(self).model_fields
        for name in _NOT_WITH_BEAMS:
            if name in fields and getattr(self, name) != fields[name].default:
                raise APIError(400, f"{name}: not available with use_beam_search", name)
        try:
            return BeamSearchParams(
                beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens)
        except ValueError as e:
            name = "n" if "beam_width" in str(e) else bad_request(e).param
            raise APIError(400, str(e).replace("beam_width", "n (the beam width)"),
                           name) from e

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, index: int,
                        tool_constraint: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        """The params of choice `index` (a seeded request's choices use seed + index, so
        they differ and each is reproducible). `tool_constraint`: what tool_choice asks
        the output to be; `skip_special_tokens` overrides the request's."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise APIError(400, f"logit_bias: keys must be token ids, got {key!r}",
                               "logit_bias")
            bias[int(key)] = value
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            seed=None if self.seed is None else (self.seed + index) % 2**32,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprob_count(), logit_bias=bias,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            skip_special_tokens=(self.skip_special_tokens if skip_special_tokens is None
                                 else skip_special_tokens),
            structured_outputs=self.structured(tool_constraint), speculative=self.speculative)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: False drops the reasoning (server/reasoning.py)
    # OpenAI's; the chat template reads it (gpt-oss's writes "Reasoning: low" ...), as vLLM
    # passes it (a chat_template_kwargs' own reasoning_effort wins).
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: the new message starts with the last one's content when both are the
    # assistant's (with continue_final_message: the whole message comes back).
    echo: bool = False
    add_special_tokens: bool = False  # BOS etc. on top of what the template writes
    documents: list[dict[str, str]] | None = None  # for a RAG chat template

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the tool plan read them."""
        return None if self.tools is None else [t.model_dump(exclude_none=True)
                                                for t in self.tools]

    def tool_choice_value(self) -> str | dict | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def echoed(self) -> str:
        """What `echo` puts before each choice's content: the last message's text when it
        is the assistant's ("" otherwise)."""
        last = self.messages[-1] if self.echo and self.messages else {}
        if last.get("role") != "assistant":
            return ""
        content = last.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and p.get("type") == "text")
        return content if isinstance(content, str) else ""

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: BOS etc. before a text prompt

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise APIError(400, "prompt: must not be empty", "prompt")
        if self.suffix:
            raise APIError(400, "suffix: this server does not do fill-in-the-middle", "suffix")
        return prompts

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens` 0 (vLLM's): the prompt comes back, with its logprobs
        if asked, and nothing generated (the engine makes one token, not shown)."""
        return self.echo and self.max_tokens == 0

    def prompt_logprob_count(self) -> int | None:
        """`echo` with `logprobs` N: the prompt's tokens' logprobs with N alternatives
        lead the choice's (OpenAI's legacy completions); vLLM's `prompt_logprobs` too."""
        counts = [c for c in (super().prompt_logprob_count(),
                              self.logprobs if self.echo else None) if c is not None]
        return max(counts) if counts else None


MAX_POOLING_INPUTS = 2048  # OpenAI's limit on an embeddings request's inputs (ours on all)


class _PoolingRequest(_Truncation):
    """What embeddings and classification requests share (vLLM's): texts or token ids in
    `input`, or `messages` instead: one conversation, rendered with the chat template,
    images included."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False  # (messages) as chat completions' fields
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    # BOS etc. before a text input (None: true), or on top of what the template writes
    # for messages (None: false).
    add_special_tokens: bool | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    request_id: str | None = Field(None, min_length=1, max_length=256)

    def inputs(self) -> list[str | list[int]]:
        """The texts and token-id lists of `input` (APIError 400 for none)."""
        if self.input is None:
            raise APIError(400, "input: required (or messages)", "input")
        p = self.input
        inputs = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not inputs or any(len(x) == 0 for x in inputs):
            raise APIError(400, "input: must not be empty", "input")
        if len(inputs) > MAX_POOLING_INPUTS:
            raise APIError(400, f"input: at most {MAX_POOLING_INPUTS} inputs, got "
                                f"{len(inputs)}", "input")
        return inputs


class EmbeddingRequest(_PoolingRequest):
    """OpenAI's embeddings request, with vLLM's extra fields."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka models: the first N entries
    normalize: bool | None = None  # L2 norm 1 (None: as the model says; True without)


class ClassificationRequest(_PoolingRequest):
    """vLLM's /classify: each input's class probabilities from the model's head."""

    use_activation: bool | None = None  # False: the head's raw logits


class _ScoringRequest(_Truncation):
    """What /score and /rerank share (vLLM's fields; `chat_template` is ours: vLLM
    takes it from the server's --chat-template). Texts only."""

    model: str | None = None
    user: str | None = None
    use_activation: bool | None = None  # a cross-encoder's: False for its raw logit
    chat_template: str | None = None  # renders [query, document] messages (scoring.py)
    chat_template_kwargs: dict[str, Any] | None = None
    instruction: str | None = None  # chat_template_kwargs' "instruction" (vLLM's)
    # Each query / document cut to its first N tokens before pairing (0: whole).
    max_tokens_per_query: int = Field(0, ge=0)
    max_tokens_per_doc: int = Field(0, ge=0)
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    request_id: str | None = Field(None, min_length=1, max_length=256)

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.instruction is not None:
            kwargs.setdefault("instruction", self.instruction)
        return kwargs


def _texts(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if len(texts) > MAX_POOLING_INPUTS:
        raise APIError(400, f"{field}: at most {MAX_POOLING_INPUTS} texts, got {len(texts)}",
                       field)
    if any(not t for t in texts):
        raise APIError(400, f"{field}: a text must not be empty", field)
    return texts


class ScoreRequest(_ScoringRequest):
    """vLLM's /score: a score for each (query, document) pair, 1:1, 1:N or N:N; the pair
    named text_1 / text_2, queries / documents, queries / items or data_1 / data_2."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None

    def texts(self) -> tuple[list[str], list[str]]:
        """(queries, documents); APIError 400 unless exactly one pair of fields is set."""
        given = [(a, b) for a, b in (("text_1", "text_2"), ("queries", "documents"),
                                     ("queries", "items"), ("data_1", "data_2"))
                 if getattr(self, a) is not None and getattr(self, b) is not None]
        if len(given) != 1:
            raise APIError(400, "text_1 and text_2 (or queries and documents): give one pair "
                                "of inputs", "text_1")
        a, b = given[0]
        return _texts(getattr(self, a), a), _texts(getattr(self, b), b)


class RerankRequest(_ScoringRequest):
    """vLLM's (Jina's, Cohere's) /rerank: the documents by their score for the query,
    best first."""

    query: str
    documents: str | list[str]
    top_n: int = Field(0, ge=0)  # the best N (0: all)

    def texts(self) -> tuple[list[str], list[str]]:
        return _texts(self.query, "query"), _texts(self.documents, "documents")


# ----------------------------------------------------------------------- responses

def kv_transfer_params(req: _Request, num_prompts: int) -> dict | None:
    """The request's kv_transfer_params, checked (APIError 400 naming what is wrong)."""
    kv = req.kv_transfer_params
    if not kv:
        return None
    field = "kv_transfer_params"
    if req.n != 1 or num_prompts != 1:
        raise APIError(400, "kv_transfer_params: a disaggregated request has one prompt "
                            "and n = 1", field)
    try:
        check_params(kv)
    except ValueError as e:
        raise APIError(400, str(e), field) from e
    if kv.get("do_remote_decode") and req.stream:
        raise APIError(400, "kv_transfer_params: a prefill (do_remote_decode) request is "
                            "not streamed", field)
    return kv


def new_id(prefix: str, request_id: str | None = None) -> str:
    """A response's id: the client's request_id (vLLM's field, or its X-Request-Id
    header) after the prefix, else a random one."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def token_id_name(token: int) -> str:
    """A token as return_tokens_as_token_ids names it in logprobs (vLLM's form)."""
    return f"token_id:{token}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; `cached_tokens`: the prompt tokens read from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(id_: str, object_: str, model: str, choices: list, created: int | None = None,
             **extra) -> dict:
    return {"id": id_, "object": object_, "created": created or int(time.time()),
            "model": model, "choices": choices, **extra}


def chat_logprobs(out: StepOutput, n: int, token_text) -> list[dict]:
    """OpenAI's `logprobs.content` entries for the new tokens of `out`."""
    def entry(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**entry(t, e[t].logprob),
             "top_logprobs": [entry(i, lp) for i, lp in top_logprobs(e, n)]}
            for t, e in zip(out.new_token_ids, out.new_logprobs or [])]


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None], token_text) -> list:
    """vLLM's `prompt_logprobs` of a response: null for the first prompt token, then each
    token's entries by id (its own and the most likely), with logprob, rank and text."""
    return [None if e is None else {
        str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token_text(t)}
        for t, lp in e.items()} for e in entries]


def echoed_logprobs(prompt: list[int], entries: list[dict[int, Logprob] | None], n: int,
                    token_text) -> dict:
    """The legacy completions `logprobs` object of an echoed prompt (`echo` with
    `logprobs`): its tokens with their logprobs and top `n`, null for the first."""
    tokens, offsets, offset = [], [], 0
    for t in prompt:
        tokens.append(token_text(t))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e[t].logprob
                               for t, e in zip(prompt, entries)],
            "top_logprobs": [None if e is None else
                             {token_text(i): lp for i, lp in top_logprobs(e, n)}
                             for e in entries],
            "text_offset": offsets}


def completion_logprobs(out: StepOutput, n: int, token_text, offset: int) -> dict:
    """The legacy completions `logprobs` object for the new tokens of `out`; `offset` is
    where their text starts in the choice's text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for t, e in zip(out.new_token_ids, out.new_logprobs or []):
        text = token_text(t)
        tokens.append(text)
        token_logprobs.append(e[t].logprob)
        top.append({token_text(i): lp for i, lp in top_logprobs(e, n)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}

