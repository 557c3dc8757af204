"""OpenAI-compatible HTTP API (FastAPI on uvicorn), beside gRPC on the same engine.

Routes: POST /v1/chat/completions and /v1/completions (streaming as server-sent events with
OpenAI's chunk shapes and `data: [DONE]`), GET /v1/models, POST /tokenize and /detokenize,
GET /health (503 until warm and while draining), GET /version, GET /metrics (Prometheus).

Each HTTP request becomes one engine request per choice (`n`, and per prompt for a list of
prompts), admitted together: if one cannot be, the others are aborted and the client gets
the error. Prompts are rendered and tokenized in a worker thread, never on the event loop
or the engine thread. A client that disconnects has every request of its job aborted at
the next engine step (a watcher reads the ASGI disconnect message), so its pages return.

Errors are OpenAI's JSON shape: 400 for a bad field (named in `param`), 404 for an unknown
model, 413 for a body over the limit, 429 when the waiting queue is full, 503 while
warming up or draining.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import numpy as np
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import jaxserve
from jaxserve.beam_search import BeamSearch, BeamSearchParams, advance_all, live_beams
from jaxserve.engine.lora import LoRARequest
from jaxserve.outputs import StepOutput
from jaxserve.pooling_params import EMBEDDING_PARAMS, PoolingParams
from jaxserve.sampling_params import SamplingParams
from server import openai_protocol as oai
from server import harmony, reasoning, responses, tool_calling
from server.async_engine import AsyncEngine, QueueFullError
from server.chat_deltas import ChatDeltas
from server.kv_transfer import KVTransferError
from server.metrics import CONTENT_TYPE, Metrics
from server.security import Security
from server.tool_parsers import ToolParser

log = logging.getLogger(__name__)


def _constrained(req: oai.ChatCompletionRequest) -> bool:
    """Whether a chat request asks for an output constraint besides its tool_choice (a
    malformed one is refused later, naming its field)."""
    try:
        return req.structured() is not None
    except ValueError:
        return True


@dataclasses.dataclass
class _ChatRun:
    """A chat request admitted: its job, prompt ids, tool plan, how its output is read
    (`think`: where it starts, reasoning.prompt_state; harmony.MODE for gpt-oss's harmony;
    None: no reasoning parser) and its logprobs count."""

    job: Job
    ids: list[int]
    plan: tool_calling.ToolPlan | None
    think: bool | str | None
    logprobs: int | None


@dataclasses.dataclass
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # its prompt's tokens read from the prefix cache
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False
    offset: int = 0  # completions' text_offset of the next token (token texts, echo included)
    kv_transfer_params: dict | None = None  # a prefill's, for the decode server
    first_scheduled_at: float | None = None  # when the engine first ran it (monotonic)
    prompt_logprobs: list | None = None  # its prompt's (SamplingParams.prompt_logprobs)


class Job:
    """The engine requests behind one HTTP request, one per choice."""

    def __init__(self, async_engine: AsyncEngine, base_id: str,
                 requests: list[tuple[list[int], SamplingParams]],
                 lora: LoRARequest | None = None, images: list | None = None,
                 kv_transfer_params: dict | None = None, priority: int = 0,
                 cache_salt: str | None = None, pooling: PoolingParams | None = None):
        self.async_engine = async_engine
        self.lora, self.pooling = lora, pooling  # pooling: embeddings (Engine.add_request)
        self.priority, self.cache_salt = priority, cache_salt
        self.kv_transfer_params = kv_transfer_params  # (one request: oai.kv_transfer_params)
        self.created = time.monotonic()
        self.images = images or []  # every request's (their prompt's images)
        self.id = base_id
        self.requests = [(f"{base_id}-{i}", prompt, p) for i, (prompt, p) in enumerate(requests)]
        self.streams: list[AsyncIterator[StepOutput]] = []
        self.done: set[int] = set()

    async def start(self) -> None:
        """Admit every request, or none: ValueError / QueueFullError after aborting the
        ones that were admitted.

        Requests repeating a prompt (`n` > 1) share its KV pages: the first of each prompt
        is admitted alone, and the others once it has produced its first token, when its
        full prompt pages are in the prefix cache (a request admitted in the same step
        would compute them again)."""
        first_of: dict[tuple, int] = {}
        for i, (_, prompt, _) in enumerate(self.requests):
            first_of.setdefault(tuple(prompt), i)
        leaders = sorted(first_of.values())
        followers = [i for i in range(len(self.requests)) if i not in first_of.values()]
        streams: dict[int, AsyncIterator[StepOutput]] = {}
        try:
            streams.update(await self._admit(leaders))
            if followers:
                for i in {first_of[tuple(self.requests[j][1])] for j in followers}:
                    streams[i] = _prepend(await anext(streams[i]), streams[i])
                streams.update(await self._admit(followers))
        except BaseException:  # refused, or cancelled (the client left) meanwhile
            self.abort()
            raise
        self.streams = [streams[i] for i in range(len(self.requests))]

    async def _admit(self, indices: list[int]) -> dict[int, AsyncIterator[StepOutput]]:
        """Queue these requests at once (the engine thread admits them between the same
        two steps); the first error is raised after all have answered."""
        results = await asyncio.gather(
            *(self.async_engine.add(*self.requests[i], self.lora, self.images,
                                    self.kv_transfer_params, self.priority, self.cache_salt,
                                    self.pooling)
              for i in indices),
            return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return dict(zip(indices, results))

    def abort(self) -> None:
        for i, (rid, _, _) in enumerate(self.requests):
            if i not in self.done:
                self.async_engine.abort(rid)  # a no-op once the engine has finished it

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """(choice index, output) as they come, until every choice has finished."""
        try:
            if len(self.streams) == 1:  # one choice: its stream read directly
                async for out in self.streams[0]:
                    yield self._checked(0, out)
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, stream: AsyncIterator[StepOutput]) -> None:
                async for out in stream:
                    await queue.put((i, out))

            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
            try:
                while len(self.done) < len(self.streams):
                    yield self._checked(*await queue.get())
            finally:
                for task in tasks:
                    task.cancel()
        finally:
            self.abort()

    def _checked(self, i: int, out: StepOutput) -> tuple[int, StepOutput]:
        if out.finished:
            self.done.add(i)
        if out.finish_reason == "error":  # the engine step failed; the server goes on
            raise oai.APIError(500, f"the step failed: {out.error}", type_="internal_error")
        return i, out


async def _prepend(first: StepOutput, rest: AsyncIterator[StepOutput]
                   ) -> AsyncIterator[StepOutput]:
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def _abort_on_disconnect(request: Request, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.abort()
            return


@contextlib.asynccontextmanager
async def _watching(request: Request, job: Job):
    watcher = asyncio.create_task(_abort_on_disconnect(request, job))
    try:
        yield
    finally:
        watcher.cancel()


@contextlib.asynccontextmanager
async def _errors_as_events():
    """In a stream already answered 200: an APIError becomes an `{"error": ...}` event
    (sent before `[DONE]`, as vLLM does) instead of a dropped connection."""
    errors: list[dict] = []
    try:
        yield errors
    except oai.APIError as e:
        errors.append(e.body())


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before any route
    reads it (declared or chunked)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        error = oai.APIError(413, f"the request body is over {self.limit} bytes",
                             code="request_too_large")
        await JSONResponse(error.body(), status_code=413)(scope, receive, send)


class _ApiKeys:
    """ASGI middleware: every route but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, security: Security):
        self.app, self.security = app, security

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if self.security.key_of(authorization) is None:
                error = oai.APIError(401, "missing or unknown API key: send 'Authorization: "
                                          "Bearer <key>'", code="invalid_api_key")
                return await JSONResponse(error.body(), status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


class HTTPServer:
    """The FastAPI app and its uvicorn server. `ready` (warm) and `accepting` (not
    draining) are set by server/app.py."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, metrics: Metrics,
                 max_body_bytes: int, security: Security | None = None,
                 tool_parser: ToolParser | None = None, reasoning_parser: str | None = None):
        self.async_engine = async_engine
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser  # server/reasoning.py (None: off)
        self.info = async_engine.info
        self.model_name = model_name
        # LoRA adapters served under their own names (`model`), by name.
        self.adapters = async_engine.adapters
        self.metrics = metrics
        self.ready = False
        self.accepting = True
        self.created = int(time.time())
        self.stored = responses.Store()  # the Responses API's stored responses
        self._background: set[asyncio.Task] = set()  # background responses running
        app = FastAPI(title="jaxserve", version=jaxserve.__version__, docs_url=None,
                      redoc_url=None)
        app.add_exception_handler(oai.APIError, self._api_error)
        app.add_exception_handler(pydantic.ValidationError, self._validation_error)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/embeddings")(self.embeddings)
        for path in ("/classify", "/v1/classify"):  # vLLM's, SGLang's
            app.post(path)(self.classify)
        for path in ("/score", "/v1/score"):
            app.post(path)(self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.post(path)(self.rerank)
        app.post("/v1/responses")(self.responses)
        app.get("/v1/responses/{response_id}")(self.get_response)
        app.post("/v1/responses/{response_id}/cancel")(self.cancel_response)
        app.get("/v1/models")(self.models)
        app.post("/v1/load_lora_adapter")(self.load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(self.unload_lora_adapter)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/health")(self.health)
        app.get("/version")(self.version)
        app.get("/metrics")(self.scrape)
        self.security = security or Security()
        self.app = _BodyLimit(app, max_body_bytes)
        if self.security.auth:
            self.app = _ApiKeys(self.app, self.security)

    # ----------------------------------------------------------------- plumbing

    async def _api_error(self, request: Request, e: oai.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def _validation_error(self, request: Request, e: pydantic.ValidationError):
        return await self._api_error(request, oai.invalid(e))

    async def _body(self, request: Request, model: type[pydantic.BaseModel]):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise oai.APIError(400, f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise oai.APIError(400, "the body must be a JSON object")
        return model.model_validate(body)

    def _check_serving(self, model: str | None) -> LoRARequest | None:
        """503 unless serving; 404 for a `model` that is neither the base model nor an
        adapter; the adapter `model` names (None: the base model)."""
        if not self.ready:
            raise oai.APIError(503, "the server is warming up; retry shortly",
                               type_="service_unavailable")
        if not self.accepting or not self.async_engine.is_alive:
            raise oai.APIError(503, "the server is shutting down", type_="service_unavailable")
        if model is None or model == self.model_name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        served = ", ".join(f"`{m}`" for m in [self.model_name, *self.adapters])
        raise oai.APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"{served}", "model", code="model_not_found")

    def _tokenizer(self):
        if self.info.tokenizer is None:
            raise oai.APIError(400, "this model has no tokenizer: send token ids", "prompt")
        return self.info.tokenizer

    def _token_text(self, token: int) -> str:
        return self.info.tokenizer.decode([token], skip_special_tokens=False)

    @staticmethod
    def _request_id(request: Request, req: oai._Request) -> str | None:
        """The client's id for the request: its X-Request-Id header, else its
        request_id field (vLLM's)."""
        header = request.headers.get("x-request-id")
        if header is not None and not 0 < len(header) <= 256:
            raise oai.APIError(400, "X-Request-Id: must be 1 to 256 characters",
                               "request_id")
        return header or req.request_id

    def _token_names(self, req: oai._Request) -> Callable[[int], str]:
        """How logprobs name a token: its text, or "token_id:N" with vLLM's
        return_tokens_as_token_ids (for tokens whose text is not valid UTF-8 alone)."""
        return oai.token_id_name if req.return_tokens_as_token_ids else self._token_text

    async def _sampling_params(self, req: oai._Request, max_tokens: int | None,
                               logprobs: int | None, tools: tool_calling.ToolPlan | None = None,
                               reasoning_block: str | None = None) -> list[SamplingParams]:
        """Each choice's params, with the output constraint compiled (in the tokenizer
        pool) so a bad one is a 400 naming the field it came in. A parsed tool call's
        markers may be special tokens: they are kept in the text. `reasoning_block`
        (StructuredOutputsParams.reasoning): a block the constraint holds after."""
        try:
            keep_special = (tools is not None and tools.parser is not None) \
                or self.reasoning_parser == "openai_gptoss"  # harmony's markers
            params = [req.sampling_params(
                max_tokens, logprobs, i, tools.constraint() if tools else None,
                skip_special_tokens=False if keep_special else None)
                for i in range(req.n)]
        except ValueError as e:
            raise oai.bad_request(e) from e
        constraint = params[0].structured_outputs
        if constraint is not None and reasoning_block is not None:
            constraint = dataclasses.replace(constraint, reasoning=reasoning_block)
            params = [dataclasses.replace(p, structured_outputs=constraint) for p in params]
        if constraint is not None:
            try:
                await self.async_engine.compile_constraint(constraint)
            except ValueError as e:
                raise oai.APIError(400, str(e), req.constraint_field()) from e
        return params

    async def _start(self, request: Request, job: Job, field: str = "messages",
                     body: type[pydantic.BaseModel] | None = None) -> None:
        """Admit a job's requests; an error as the status that says what to fix (a
        ValueError a 400 naming its field of `body`'s (oai.bad_request), `field` when it
        names none)."""
        try:
            await job.start()
        except QueueFullError as e:
            raise oai.APIError(429, str(e), type_="rate_limit_exceeded") from e
        except KVTransferError as e:  # the prefill server went away, or its K/V expired
            raise oai.APIError(503, str(e), "kv_transfer_params",
                               type_="service_unavailable") from e
        except ValueError as e:
            raise oai.bad_request(e, field, body) from e

    @staticmethod
    def _sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    # ------------------------------------------------------------------- routes

    async def chat_completions(self, request: Request):
        req = await self._body(request, oai.ChatCompletionRequest)
        if req.use_beam_search:
            return await self._beam_chat(request, req)
        run = await self._start_chat(request, req, "chatcmpl")
        job, ids, plan, think, logprobs = run.job, run.ids, run.plan, run.think, run.logprobs
        rid = job.id
        if req.stream:
            return StreamingResponse(self._chat_stream(request, req, job, rid, ids, plan,
                                                       think),
                                     media_type="text/event-stream")
        choices = await self._collect(request, job, None if logprobs is None else (
            lambda o: oai.chat_logprobs(o, logprobs, self._token_names(req))))
        extra = {}
        if req.prompt_logprobs is not None:  # vLLM's: the prompt's, once for all choices
            extra["prompt_logprobs"] = oai.prompt_logprobs_json(choices[0].prompt_logprobs,
                                                                self._token_text)
        if req.return_token_ids:
            extra["prompt_token_ids"] = ids
        return _answer(job, choices, oai.envelope(rid, "chat.completion", self._model(job), [
            {"index": i, **self._chat_message(c, plan, think, req.include_reasoning,
                                              req.echoed()),
             "logprobs": {"content": [x for part in c.logprobs for x in part]}
             if logprobs is not None else None, "stop_reason": c.stop_reason,
             **({"token_ids": c.token_ids} if req.return_token_ids else {})}
            for i, c in enumerate(choices)],
            usage=_usage([ids], choices), **extra), self._cache_page_size)

    async def _start_chat(self, request: Request, req: oai.ChatCompletionRequest,
                          kind: str) -> _ChatRun:
        """Render, tokenize and admit a chat request's choices (APIError when it cannot
        be); `kind` prefixes its id."""
        lora, ids, images, plan, think, block = await self._chat_prompt(req)
        logprobs = req.logprob_count()
        params = await self._sampling_params(req, req.max_completion_tokens or req.max_tokens,
                                             logprobs, plan, block)
        job = Job(self.async_engine, oai.new_id(kind, self._request_id(request, req)),
                  [(ids, p) for p in params], lora,
                  images, oai.kv_transfer_params(req, 1), req.priority, req.cache_salt)
        await self._start(request, job)
        return _ChatRun(job, ids, plan, think, logprobs)

    async def _chat_prompt(self, req: oai.ChatCompletionRequest) -> tuple:
        """A chat request rendered and tokenized: (its adapter, prompt ids, images, tool
        plan, where its output starts (`think`: reasoning.prompt_state; None without a
        reasoning parser), and the reasoning block its constraint holds after)."""
        lora = self._check_serving(req.model)
        self._tokenizer()  # 400 when the model has none
        if self.reasoning_parser is not None and req.kv_transfer_params:
            # The router joins the prefill server's first token with the decode server's
            # text, and a marker may straddle them: neither server can split it alone.
            raise oai.APIError(400, "kv_transfer_params: a server started with "
                                    "--reasoning-parser does not serve prefill/decode "
                                    "disaggregation yet; start it without one",
                               "kv_transfer_params")
        tools = req.tool_dicts()
        try:
            plan = tool_calling.plan(tools, req.tool_choice_value(), req.parallel_tool_calls,
                                     self.tool_parser)
        except tool_calling.ToolChoiceError as e:
            raise oai.APIError(400, str(e), e.param) from e
        try:
            ids, images = await self.async_engine.encode_chat(
                req.messages, req.add_special_tokens, chat_template=req.chat_template,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, tools=tools,
                **({"documents": req.documents} if req.documents is not None else {}),
                **{**({"reasoning_effort": req.reasoning_effort} if req.reasoning_effort
                      else {}), **(req.chat_template_kwargs or {})})
        except ValueError as e:  # ChatTemplateError, a bad image, over --max-prompt-bytes
            raise oai.APIError(400, str(e), "messages") from e
        ids = req.truncated(ids, self.info.max_model_len, bool(images))
        think = block = None  # (no reasoning parser)
        if self.reasoning_parser == "openai_gptoss":
            think = harmony.MODE
            calls = plan is not None and plan.mode != "auto"
            field = "tool_choice" if calls else (
                req.constraint_field() if _constrained(req) else None)
            if field is not None and not harmony.opens_a_turn(
                    self.info.tokenizer.decode(ids[-16:], skip_special_tokens=False)):
                raise oai.APIError(400, f"{field}: with --reasoning-parser openai_gptoss an "
                                        "output constraint needs the prompt to end with "
                                        "the generation prompt's <|start|>assistant (a chat "
                                        "template for gpt-oss, add_generation_prompt)", field)
            if calls:  # its grammar says where the call goes
                plan = harmony.call_plan(plan, tools)
            else:  # a constraint holds as the final message's text
                block = "harmony"
        elif self.reasoning_parser is not None:
            state = reasoning.prompt_state(
                self.info.tokenizer.decode(ids[-16:], skip_special_tokens=False))
            think = state == "open"  # the output starts inside a block
            # An output constraint holds after the block, from the start if the prompt
            # closed one.
            block = {"open": "open", "closed": None, None: "optional"}[state]
        return lora, ids, images, plan, think, block

    async def _beam_chat(self, request: Request, req: oai.ChatCompletionRequest) -> dict:
        """A chat completion by beam search (`use_beam_search`): the n best beams as its
        choices."""
        params = req.beam_search_params(req.max_completion_tokens or req.max_tokens or 1)
        lora, ids, images, _, think, _ = await self._chat_prompt(req)
        if images:
            raise oai.APIError(400, "use_beam_search: not available with images", "messages")
        if req.max_completion_tokens is None and req.max_tokens is None:
            params = dataclasses.replace(params,
                                         max_tokens=self.info.max_model_len - len(ids))
        rid = oai.new_id("chatcmpl", self._request_id(request, req))
        choices = await self._beam_search(request, req, rid, [ids], lora, params)
        return oai.envelope(rid, "chat.completion", self._model_of(lora), [
            {"index": i, **self._chat_message(c, None, think, req.include_reasoning,
                                              req.echoed()),
             "logprobs": None, "stop_reason": c.stop_reason,
             **({"token_ids": c.token_ids} if req.return_token_ids else {})}
            for i, c in enumerate(choices)],
            usage=_usage([ids], choices),
            **({"prompt_token_ids": ids} if req.return_token_ids else {}))

    async def _beam_search(self, request: Request, req: oai._Request, rid: str,
                           prompts: list[list[int]], lora: LoRARequest | None,
                           params: BeamSearchParams) -> list[Choice]:
        """Each prompt's n best beams, as choices (prompt by prompt, best first): every
        step one job of each live beam's one-token request (jaxserve/beam_search.py)."""
        try:
            searches = [BeamSearch(ids, params, self.info.eos_token_ids,
                                   self.info.max_model_len) for ids in prompts]
        except ValueError as e:
            raise oai.APIError(400, str(e), "max_tokens") from e
        cached, step = [0] * len(prompts), params.step_params()
        while not all(s.done for s in searches):
            first = searches[0].steps == 0
            job = Job(self.async_engine, f"{rid}-step{max(s.steps for s in searches)}",
                      [(b.tokens, step) for _, b in live_beams(searches)], lora,
                      priority=req.priority, cache_salt=req.cache_salt)
            await self._start(request, job)
            outs = await self._collect(request, job, lambda o: o.new_logprobs[0])
            failed = next((c for c in outs if c.finish_reason in ("abort", "error")), None)
            if failed is not None:
                raise oai.APIError(500 if failed.finish_reason == "error" else 503,
                                   f"a beam search step ended with {failed.finish_reason}",
                                   type_="server_error")
            if first:
                cached = [c.num_cached_tokens for c in outs]
            advance_all(searches, [c.logprobs[0] for c in outs])
        tokenizer = self.info.tokenizer
        choices = []
        for search, hits in zip(searches, cached):
            for beam in search.best():
                own = search.generated(beam)
                choices.append(Choice(
                    text=tokenizer.decode(own, params.skip_special_tokens), num_tokens=len(own),
                    token_ids=own, num_cached_tokens=hits, finish_reason=beam.finish_reason,
                    stop_reason=beam.stop_reason))
        return choices

    async def _collect(self, request: Request | None, job: Job,
                       logprobs: Callable | None = None) -> list[Choice]:
        """Every choice of a job, run to its end (the job aborted if the client of
        `request` leaves; None: no client waits)."""
        choices = [Choice() for _ in job.requests]
        async with _watching(request, job) if request is not None else \
                contextlib.nullcontext():
            async for i, out in job.outputs():
                self._accumulate(choices[i], out, logprobs)
        return choices

    @staticmethod
    def _chat_message(c: Choice, plan: tool_calling.ToolPlan | None,
                      think: bool | str | None, include_reasoning: bool,
                      echoed: str = "") -> dict:
        """A finished choice's message and finish_reason (its reasoning split off when
        `think` is not None: server/reasoning.py, or server/harmony.py; tool calls read out
        of the rest; `echoed` put before its content)."""
        if think == harmony.MODE:
            thought, content = harmony.split(c.text, calls=plan is not None)
        else:
            thought, content = (None, c.text) if think is None else reasoning.split(c.text,
                                                                                    think)
        calls = []
        if plan is not None and content is not None:
            content, calls = tool_calling.message(plan, content)
        if echoed:
            content = echoed + (content or "")
        message = {"role": "assistant", "content": content}
        if thought is not None and include_reasoning:
            message["reasoning_content"] = message["reasoning"] = thought
        if calls:
            message["tool_calls"] = calls
        reason = (c.finish_reason if plan is None
                  else tool_calling.finish_reason(plan, c.finish_reason, calls))
        return {"message": message, "finish_reason": reason}

    async def _chat_stream(self, request: Request, req: oai.ChatCompletionRequest, job: Job,
                           rid: str, prompt_ids: list[int],
                           plan: tool_calling.ToolPlan | None,
                           think: bool | str | None) -> AsyncIterator[str]:
        created, logprobs, echoed = int(time.time()), req.logprob_count(), req.echoed()
        choices = [Choice() for _ in job.requests]
        streams = [ChatDeltas(plan, think, req.include_reasoning) for _ in choices]

        def chunk(i: int, delta: dict, out: StepOutput | None = None, finish=None,
                  first: bool = False) -> str:
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            if out is not None and logprobs is not None and out.new_token_ids:
                choice["logprobs"] = {"content": oai.chat_logprobs(out, logprobs,
                                                                   self._token_names(req))}
            if finish is not None:
                choice["stop_reason"] = choices[i].stop_reason
            ids = {}
            if req.return_token_ids:  # the prompt's in a choice's first chunk, then new ones
                choice["token_ids"] = list(out.new_token_ids) if out is not None else []
                if first:
                    ids["prompt_token_ids"] = prompt_ids
            return self._sse(oai.envelope(rid, "chat.completion.chunk", self._model(job),
                                          [choice], created,
                                          **_chunk_usage(req, [prompt_ids], choices), **ids))

        async with _watching(request, job), _errors_as_events() as errors:
            async for i, out in job.outputs():
                c, tools = choices[i], streams[i].tools
                if not c.started:
                    c.started = True
                    yield chunk(i, {"role": "assistant", "content": "" if tools is None
                                    or tools.plan.parser is not None else None}, first=True)
                    if echoed:
                        yield chunk(i, {"content": echoed})
                self._accumulate(c, out)
                if streams[i].plain:
                    # A chunk per step that made tokens, even when their text is held back
                    # (an unfinished UTF-8 character): clients see progress, as vLLM's do.
                    delta = ({"content": out.new_text} if out.new_text or out.new_token_ids
                             else {})
                    if out.finished or delta:
                        yield chunk(i, delta, out, c.finish_reason)
                    continue
                deltas = streams[i].feed(out)
                for j, delta in enumerate(deltas):
                    yield chunk(i, delta, out if j == 0 else None)
                if not deltas and not out.finished and (logprobs is not None
                                                        or req.return_token_ids):
                    yield chunk(i, {}, out)  # text held back; its tokens' logprobs go now
                if out.finished:
                    reason = c.finish_reason if tools is None else tool_calling.finish_reason(
                        plan, c.finish_reason, [None] * tools.num_calls)
                    yield chunk(i, {}, None if deltas else out, reason)
        for event in self._stream_end(job, "chat.completion.chunk", created, errors,
                                      req.include_usage, [prompt_ids], choices):
            yield event

    async def responses(self, request: Request):
        """OpenAI's Responses API over the chat pipeline (server/responses.py)."""
        body = (await self._body(request, responses.ResponsesRequest)).checked()
        if body.logprobs and self.reasoning_parser is not None:
            raise oai.APIError(400, f"include: {responses.LOGPROBS} is not served by a "
                                    "server started with --reasoning-parser", "include")
        messages = []
        if body.previous_response_id is not None:
            previous = self.stored.get(body.previous_response_id)
            if previous.job is not None:
                raise oai.APIError(400, "previous_response_id: that background response is "
                                        "still in progress", "previous_response_id")
            messages = previous.messages + responses.output_messages(previous.body["output"])
        messages += responses.input_messages(body)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        chat = responses.chat_request(body, system + messages)
        run = await self._start_chat(request, chat, "resp")
        logprobs = (lambda o: oai.chat_logprobs(o, run.logprobs, self._token_names(chat))) \
            if body.logprobs else None
        rid, created = responses.new_id("resp"), float(int(time.time()))
        if body.stream:
            return StreamingResponse(self._responses_stream(request, body, run, messages, rid,
                                                            created, logprobs),
                                     media_type="text/event-stream")
        finished = self._response_done(body, run, messages, rid, created, logprobs,
                                       None if body.background else request)
        if not body.background:
            return await finished
        # Background (OpenAI's): answered now, in progress; GET reads it, cancel aborts it.
        out = responses.body(body, rid, self._model(run.job), created, [], None, None)
        self.stored.put(rid, responses.Stored(messages, out, run.job))
        task = asyncio.create_task(self._in_background(finished, rid, messages, out))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return out

    async def _in_background(self, finished, rid: str, messages: list[dict],
                             started: dict) -> None:
        """A background response's run; one that fails is stored `failed`, saying why."""
        try:
            await finished
        except Exception as e:  # noqa: BLE001 - no client waits to be told
            log.exception("background response %s failed", rid)
            self.stored.put(rid, responses.Stored(messages, {
                **started, "status": "failed",
                "error": {"code": "server_error", "message": str(e)}}))

    async def _response_done(self, body: responses.ResponsesRequest, run: _ChatRun,
                             messages: list[dict], rid: str, created: float,
                             logprobs: Callable | None, request: Request | None) -> dict:
        """A response run to its end (with `request`: aborted if its client leaves; a
        background one runs whoever waits), stored if asked."""
        choices = await self._collect(request, run.job, logprobs)
        answer = self._chat_message(choices[0], run.plan, run.think, True)
        message, finish = answer["message"], answer["finish_reason"]
        status = responses.status_of(finish)[0]
        out = responses.body(
            body, rid, self._model(run.job), created,
            responses.output_items(message, "incomplete" if status == "failed" else status,
                                   [x for part in choices[0].logprobs for x in part]),
            finish, self._responses_usage(_usage([run.ids], choices),
                                          message.get("reasoning_content")))
        if body.background and self.stored.cancelled(rid):
            out["status"], out["incomplete_details"], out["error"] = "cancelled", None, None
        if body.store:
            self.stored.put(rid, responses.Stored(messages, out))
        return out

    async def cancel_response(self, response_id: str):
        """Cancel a background response: its request aborted, its status `cancelled`
        (one already finished is returned as it is)."""
        return self.stored.cancel(response_id)

    async def _responses_stream(self, request: Request, body: responses.ResponsesRequest,
                                run: _ChatRun, messages: list[dict], rid: str,
                                created: float, logprobs: Callable | None
                                ) -> AsyncIterator[str]:
        job, model, events = run.job, self._model(run.job), responses.Events()

        def sse(event: dict) -> str:
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        start = responses.body(body, rid, model, created, [], None, None)
        yield sse(events.event("response.created", response=start))
        yield sse(events.event("response.in_progress", response=start))
        deltas, c = ChatDeltas(run.plan, run.think), Choice()
        async with _watching(request, job), _errors_as_events() as errors:
            async for _, out in job.outputs():
                self._accumulate(c, out)
                if logprobs is not None:
                    events.add_logprobs(logprobs(out))
                for delta in deltas.feed(out):
                    for event in events.feed(delta):
                        yield sse(event)
        finish = "error" if errors else c.finish_reason
        for event in events.finish(responses.status_of(finish)[0]):
            yield sse(event)
        thought = "".join(part["text"] for item in events.output
                          if item["type"] == "reasoning" for part in item["content"])
        out = responses.body(body, rid, model, created, events.output, finish,
                             self._responses_usage(_usage([run.ids], [c]), thought))
        if errors:
            out["error"] = {"code": "server_error", "message": errors[0]["error"]["message"]}
        if body.store:
            self.stored.put(rid, responses.Stored(messages, out))
        yield sse(events.event(f"response.{out['status']}", response=out))

    def _responses_usage(self, chat_usage: dict, reasoning_text: str | None) -> dict:
        """The Responses API's usage: reasoning_tokens counts the reasoning's text in
        tokens."""
        return responses.usage(
            chat_usage, len(self.info.tokenizer.encode(reasoning_text, False))
            if reasoning_text else 0, self._cache_page_size)

    @property
    def _cache_page_size(self) -> int:
        """The page size, 0 when the prefix cache is off (responses.usage, PAGE_HEADER)."""
        config = self.info.config
        return config.page_size if config.enable_prefix_caching else 0

    async def get_response(self, response_id: str):
        return self.stored.get(response_id, "response_id").body

    async def completions(self, request: Request):
        req = await self._body(request, oai.CompletionRequest)
        lora = self._check_serving(req.model)
        prompts = req.prompts()
        tokenizer = self.info.tokenizer
        ids = await self._token_ids(prompts, req.add_special_tokens, "prompt")
        kept = [req.truncated(p, self.info.max_model_len, False) for p in ids]
        # An echo shows the prompt as run: a truncated one decoded from what was kept.
        prompts = [p if len(k) == len(i) else k for p, i, k in zip(prompts, ids, kept)]
        ids = kept
        if req.use_beam_search:
            return await self._beam_completion(request, req, prompts, ids, lora, tokenizer)
        params = await self._sampling_params(req, 1 if req.scores_only else req.max_tokens,
                                             req.logprobs)
        job = Job(self.async_engine, oai.new_id("cmpl", self._request_id(request, req)),
                  [(p, params[i]) for p in ids for i in range(req.n)], lora,
                  kv_transfer_params=oai.kv_transfer_params(req, len(ids)),
                  priority=req.priority, cache_salt=req.cache_salt)
        await self._start(request, job)
        rid = job.id
        echoes = [""] * len(job.requests)
        if req.echo:
            texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
            echoes = [t for t in texts for _ in range(req.n)]
        if req.stream:
            return StreamingResponse(
                self._completion_stream(request, req, job, rid, echoes, ids),
                media_type="text/event-stream")
        choices = [Choice(text=e, offset=len(e)) for e in echoes]
        async with _watching(request, job):
            async for i, out in job.outputs():
                out = _shown(req, out)
                self._accumulate(choices[i], out, None if req.logprobs is None else (
                    lambda o: self._completion_logprobs(req, choices[i], o)))

        def choice(i: int, c: Choice) -> dict:
            out = {"index": i, "text": c.text, "logprobs": None,
                   "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            prompt = job.requests[i][1]
            if req.logprobs is not None:
                out["logprobs"] = _merge(self._echoed(req, prompt, c) + c.logprobs)
            if req.prompt_logprobs is not None:
                out["prompt_logprobs"] = oai.prompt_logprobs_json(c.prompt_logprobs,
                                                                  self._token_text)
            if req.return_token_ids:
                out["prompt_token_ids"], out["token_ids"] = prompt, c.token_ids
            return out

        return _answer(job, choices, oai.envelope(
            rid, "text_completion", self._model(job), [choice(i, c) for i, c in
                                                       enumerate(choices)],
            usage=_usage(ids, choices)), self._cache_page_size)

    async def embeddings(self, request: Request):
        """OpenAI's embeddings: each input's embedding (pooling_params.py)."""
        req = await self._body(request, oai.EmbeddingRequest)
        job, ids, vectors = await self._pool(request, req, "embd", PoolingParams(
            req.dimensions, req.normalize))
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(v.astype("<f4").tobytes()).decode()
                               if req.encoding_format == "base64" else v.tolist())}
                for i, v in enumerate(vectors)]
        return {"id": job.id, "object": "list", "created": int(time.time()),
                "model": self._model(job), "data": data, "usage": _pooling_usage(ids)}

    async def classify(self, request: Request):
        """vLLM's /classify: each input's class probabilities (loading/classifier.py)."""
        req = await self._body(request, oai.ClassificationRequest)
        job, ids, vectors = await self._pool(request, req, "classify", PoolingParams(
            task="classify", use_activation=req.use_activation))
        labels = self.info.classifier.labels
        data = [{"index": i, "label": labels[int(np.argmax(v))], "probs": v.tolist(),
                 "num_classes": len(v)} for i, v in enumerate(vectors)]
        return {"id": job.id, "object": "list", "created": int(time.time()),
                "model": self._model(job), "data": data, "usage": _pooling_usage(ids)}

    async def score(self, request: Request):
        """vLLM's /score: a score for each (query, document) pair (jaxserve/scoring.py)."""
        req = await self._body(request, oai.ScoreRequest)
        job, ids, scores = await self._score(request, req, "score")
        return {"id": job.id, "object": "list", "created": int(time.time()),
                "model": self._model(job), "usage": _pooling_usage(ids),
                "data": [{"index": i, "object": "score", "score": x}
                         for i, x in enumerate(scores)]}

    async def rerank(self, request: Request):
        """vLLM's (Jina's, Cohere's) /rerank: the documents by their score for the query,
        best first, the best `top_n` (0: all)."""
        req = await self._body(request, oai.RerankRequest)
        job, ids, scores = await self._score(request, req, "rerank")
        documents = req.texts()[1]
        best = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        return {"id": job.id, "model": self._model(job), "usage": _pooling_usage(ids),
                "results": [{"index": i, "document": {"text": documents[i]},
                             "relevance_score": scores[i]} for i in best]}

    async def _pool(self, request: Request, req: oai._PoolingRequest, kind: str,
                    pooling: PoolingParams) -> tuple[Job, list[list[int]], list]:
        """Run an embeddings or classification request's inputs (or its messages): its
        job, prompts' token ids and pooled vectors, in order."""
        lora = self._check_serving(req.model)
        images = []
        if req.messages is not None:
            ids, images = await self._pooling_chat(req)
        else:
            ids = await self._token_ids(req.inputs(), req.add_special_tokens is not False,
                                        "input")
        ids = [req.truncated(p, self.info.max_model_len, bool(images)) for p in ids]
        return await self._run_pooling(request, req, kind, ids, pooling, lora, images)

    async def _run_pooling(self, request: Request, req, kind: str, ids: list[list[int]],
                           pooling: PoolingParams, lora: LoRARequest | None,
                           images: list = ()) -> tuple[Job, list[list[int]], list]:
        """Prompts run as pooling requests of one job (`kind` prefixes its id): the job,
        the prompts and their pooled vectors, in order."""
        job = Job(self.async_engine, oai.new_id(kind, self._request_id(request, req)),
                  [(p, EMBEDDING_PARAMS) for p in ids], lora, list(images),
                  priority=req.priority, cache_salt=req.cache_salt, pooling=pooling)
        await self._start(request, job, "input", type(req))
        vectors = [None] * len(ids)
        async with _watching(request, job):
            async for i, out in job.outputs():
                if out.finished:
                    vectors[i] = out.pooled
        return job, ids, vectors

    async def _score(self, request: Request, req: oai._ScoringRequest, kind: str
                     ) -> tuple[Job, list[list[int]], list[float]]:
        """A /score or /rerank request's pairs scored: by the model's classification head
        on each pair as one prompt, or as the cosine similarity of their embeddings."""
        lora = self._check_serving(req.model)
        queries, documents = req.texts()
        self._tokenizer()
        try:
            pooling, ids, to_scores = await self.async_engine.scoring_prompts(
                queries, documents, req.chat_template, req.template_kwargs(),
                req.use_activation, req.max_tokens_per_query, req.max_tokens_per_doc)
        except ValueError as e:  # the inputs' shape, the model's head, the template
            raise oai.bad_request(e, "chat_template" if req.chat_template else None,
                                  type(req)) from e
        ids = [req.truncated(p, self.info.max_model_len, False) for p in ids]
        job, ids, vectors = await self._run_pooling(request, req, kind, ids, pooling, lora)
        return job, ids, to_scores(vectors)

    async def _token_ids(self, prompts: list[str | list[int]], add_special_tokens: bool,
                         field: str) -> list[list[int]]:
        """Prompts (texts or token ids) as token ids: the texts tokenized in the worker
        pool (400 naming `field` when one cannot be, or the model has no tokenizer)."""
        if any(isinstance(p, str) for p in prompts):
            self._tokenizer()
        try:
            return [await self.async_engine.encode(p, add_special_tokens)
                    if isinstance(p, str) else p for p in prompts]
        except ValueError as e:
            raise oai.APIError(400, str(e), field) from e

    async def _pooling_chat(self, req: oai._PoolingRequest) -> tuple[list[list[int]], list]:
        """An embeddings or classification request's `messages` rendered and tokenized
        (one prompt), and its images."""
        if req.input is not None:
            raise oai.APIError(400, "input: set input or messages, not both", "input")
        self._tokenizer()
        try:
            ids, images = await self.async_engine.encode_chat(
                req.messages, bool(req.add_special_tokens), chat_template=req.chat_template,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                **(req.chat_template_kwargs or {}))
        except ValueError as e:  # ChatTemplateError, a bad image, over --max-prompt-bytes
            raise oai.APIError(400, str(e), "messages") from e
        return [ids], images

    async def _beam_completion(self, request: Request, req: oai.CompletionRequest,
                               prompts: list, ids: list[list[int]], lora: LoRARequest | None,
                               tokenizer) -> dict:
        """A completion by beam search (`use_beam_search`): each prompt's n best beams."""
        params = req.beam_search_params(
            req.max_tokens if req.max_tokens is not None
            else self.info.max_model_len - max(map(len, ids)))
        rid = oai.new_id("cmpl", self._request_id(request, req))
        choices = await self._beam_search(request, req, rid, ids, lora, params)
        n = params.beam_width

        def choice(i: int, c: Choice) -> dict:
            prompt = prompts[i // n]
            echo = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) \
                if req.echo else ""
            out = {"index": i, "text": echo + c.text, "logprobs": None,
                   "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                out["prompt_token_ids"], out["token_ids"] = ids[i // n], c.token_ids
            return out

        return oai.envelope(rid, "text_completion", self._model_of(lora),
                            [choice(i, c) for i, c in enumerate(choices)],
                            usage=_usage(ids, choices))

    def _echoed(self, req: oai.CompletionRequest, prompt: list[int], c: Choice) -> list[dict]:
        """An echoed prompt's part of a choice's completion logprobs (`echo` with
        `logprobs`; [] otherwise, or before its first output brings them)."""
        if not (req.echo and req.logprobs is not None and c.prompt_logprobs is not None):
            return []
        return [oai.echoed_logprobs(prompt, c.prompt_logprobs, req.logprobs,
                                    self._token_names(req))]

    async def _completion_stream(self, request: Request, req: oai.CompletionRequest, job: Job,
                                 rid: str, echoes: list[str], prompts: list[list[int]]
                                 ) -> AsyncIterator[str]:
        created = int(time.time())
        choices = [Choice(offset=len(e)) for e in echoes]
        async with _watching(request, job), _errors_as_events() as errors:
            async for i, out in job.outputs():
                out, c = _shown(req, out), choices[i]
                text, first = out.new_text, not c.started
                if first:
                    c.started = True
                    text = echoes[i] + text
                self._accumulate(c, out)
                if not (text or out.finished or out.new_token_ids
                        or first and req.return_token_ids):
                    continue
                choice = {"index": i, "text": text, "logprobs": None,
                          "finish_reason": c.finish_reason}
                if req.return_token_ids:  # the prompt's in a choice's first chunk
                    if first:
                        choice["prompt_token_ids"] = job.requests[i][1]
                    choice["token_ids"] = list(out.new_token_ids)
                if req.logprobs is not None:
                    parts = [self._completion_logprobs(req, c, out)]
                    if out.prompt_logprobs is not None:  # its first: the echoed prompt's lead
                        parts = self._echoed(req, job.requests[i][1], c) + parts
                    choice["logprobs"] = _merge(parts)
                if out.finished:
                    choice["stop_reason"] = c.stop_reason
                yield self._sse(oai.envelope(rid, "text_completion", self._model(job), [choice],
                                             created, **_chunk_usage(req, prompts, choices)))
        for event in self._stream_end(job, "text_completion", created, errors,
                                      req.include_usage, prompts, choices):
            yield event

    def _model(self, job: Job) -> str:
        return self._model_of(job.lora)

    def _model_of(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter the request asked for, else the base."""
        return lora.lora_name if lora is not None else self.model_name

    def _stream_end(self, job: Job, object_: str, created: int, errors: list[dict],
                    include_usage: bool, prompts: list[list[int]], choices: list[Choice]):
        """A stream's last events: its errors, or the usage chunk if asked; then [DONE]."""
        for error in errors:
            yield self._sse(error)
        if include_usage and not errors:
            yield self._sse(oai.envelope(
                job.id, object_, self._model(job), [], created,
                usage=_usage(prompts, choices)))
        yield self._sse("[DONE]")

    def _completion_logprobs(self, req: oai.CompletionRequest, c: Choice,
                             out: StepOutput) -> dict:
        part = oai.completion_logprobs(out, req.logprobs, self._token_names(req), c.offset)
        c.offset += sum(len(t) for t in part["tokens"])
        return part

    @staticmethod
    def _accumulate(c: Choice, out: StepOutput, logprobs: Callable | None = None) -> None:
        c.text += out.new_text
        c.num_tokens += len(out.new_token_ids)
        c.token_ids += out.new_token_ids
        c.num_cached_tokens = out.num_cached_tokens
        if logprobs is not None and out.new_logprobs:
            c.logprobs.append(logprobs(out))
        if out.finished:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        if out.kv_transfer_params is not None:
            c.kv_transfer_params = out.kv_transfer_params
        if c.first_scheduled_at is None:
            c.first_scheduled_at = out.first_scheduled_at
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs

    async def models(self):
        base = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "jaxserve", "root": self.model_name, "parent": None,
                "max_model_len": self.info.max_model_len}
        return {"object": "list", "data": [base] + [
            {**base, "id": name, "root": lora.lora_path, "parent": self.model_name}
            for name, lora in self.adapters.items()]}

    def _check_admin(self, request: Request) -> None:
        """Loading and unloading adapters needs an admin key when keys are on."""
        key = self.security.key_of(request.headers.get("authorization", ""))
        if self.security.auth and not self.security.is_admin(key):
            raise oai.APIError(403, "loading and unloading LoRA adapters needs an admin key",
                               type_="permission_denied")

    async def load_lora_adapter(self, request: Request):
        body = await self._body(request, _LoadLoraRequest)
        self._check_admin(request)
        if not self.info.lora_enabled:
            raise oai.APIError(400, "LoRA adapters are not enabled: start the server with "
                                    "--enable-lora", "lora_name")
        if body.lora_name == self.model_name or body.lora_name in self.adapters:
            raise oai.APIError(400, f"the name `{body.lora_name}` is taken: unload it first",
                               "lora_name")
        try:
            await self.async_engine.add_lora(body.lora_name, body.lora_path)
        except ValueError as e:
            raise oai.APIError(400, str(e), "lora_path") from e
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                        media_type="text/plain")

    async def unload_lora_adapter(self, request: Request):
        body = await self._body(request, _UnloadLoraRequest)
        self._check_admin(request)
        if not await self.async_engine.remove_lora(body.lora_name):
            raise oai.APIError(404, f"no LoRA adapter named `{body.lora_name}` is loaded",
                               "lora_name", code="model_not_found")
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                        media_type="text/plain")

    async def tokenize(self, request: Request):
        body = await self._body(request, _TokenizeRequest)
        self._check_serving(body.model)
        self._tokenizer()
        try:
            if body.messages is not None:
                ids, _ = await self.async_engine.encode_chat(
                    body.messages, add_generation_prompt=body.add_generation_prompt)
            elif body.prompt is not None:
                ids = await self.async_engine.encode(body.prompt, body.add_special_tokens)
            else:
                raise oai.APIError(400, "set prompt or messages", "prompt")
        except ValueError as e:
            raise oai.APIError(400, str(e), "messages" if body.messages is not None
                               else "prompt") from e
        return {"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request):
        body = await self._body(request, _DetokenizeRequest)
        self._check_serving(body.model)
        vocab = self.info.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise oai.APIError(400, f"tokens: id {bad[0]} is outside the vocabulary "
                                    f"[0, {vocab})", "tokens")
        return {"prompt": self._tokenizer().decode(body.tokens)}

    async def health(self):
        try:
            self._check_serving(None)
        except oai.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return Response(status_code=200)

    async def version(self):
        return {"version": jaxserve.__version__}

    async def scrape(self):
        return Response(self.metrics.scrape(await self.async_engine.snapshot()),
                        media_type=CONTENT_TYPE)

    # -------------------------------------------------------------------- serve

    async def serve(self, host: str, port: int, started: asyncio.Event) -> None:
        """Serve until `shutdown()`; sets `started` once the port is bound."""
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=2,
                                **self.security.uvicorn_ssl())
        self._server = _Uvicorn(config)

        async def run() -> None:
            try:
                await self._server.serve()
            except SystemExit:  # uvicorn exits the process when it cannot bind the port
                raise ValueError(f"HTTP: cannot bind {host}:{port} (in use?)") from None

        task = asyncio.create_task(run())
        while not self._server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            task.result()  # re-raise the bind error
            raise ValueError(f"HTTP: cannot bind {host}:{port}")
        started.set()
        await task

    def shutdown(self) -> None:
        self._server.should_exit = True


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: server/app.py drains both servers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


QUEUE_HEADER = "x-jaxserve-queue-seconds"
# A prefill server's page size when its prefix cache is on, else 0 (the router's Responses
# usage counts the prompt's pages written to the cache with it).
PAGE_HEADER = "x-jaxserve-prefix-cache-page-size"


def _pooling_usage(prompts: list[list[int]]) -> dict:
    tokens = sum(map(len, prompts))
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    """A response's usage: each prompt's tokens once (its choices share them), what its
    first choice read from the prefix cache (the others read the first's pages)."""
    n = len(choices) // len(prompts)
    return oai.usage(sum(map(len, prompts)), sum(c.num_tokens for c in choices),
                     sum(c.num_cached_tokens for c in choices[::n]))


def _chunk_usage(req: oai._Request, prompts: list[list[int]], choices: list[Choice]) -> dict:
    """A stream chunk's usage field: none, null (include_usage: the usage comes in a last
    chunk of its own), or the usage so far (vLLM's continuous_usage_stats)."""
    if not req.include_usage:
        return {}
    return {"usage": _usage(prompts, choices) if req.stream_options.continuous_usage_stats
            else None}


def _answer(job: Job, choices: list[Choice], body: dict, page_size: int
            ) -> dict | JSONResponse:
    """A whole response; a prefill server's (do_remote_decode) with `kv_transfer_params`
    (vLLM's field: where its decode server pulls its K/V, and its first token; none when
    the request ended here), the seconds it queued here (the router's TTFT phases) and
    `page_size` (PAGE_HEADER) in headers."""
    kv = job.kv_transfer_params
    if not (kv and kv.get("do_remote_decode")):
        return body
    c = choices[0]
    if c.kv_transfer_params is not None:
        body["kv_transfer_params"] = c.kv_transfer_params
    queued = (max(c.first_scheduled_at - job.created, 0.0)
              if c.first_scheduled_at is not None else 0.0)
    return JSONResponse(body, headers={QUEUE_HEADER: f"{queued:.6f}",
                                       PAGE_HEADER: str(page_size)})


def _shown(req: oai.CompletionRequest, out: StepOutput) -> StepOutput:
    """What a completion shows of an output: with `echo` and `max_tokens` 0 (vLLM's: the
    prompt scored, nothing generated), not the one token the engine made for it."""
    if not req.scores_only:
        return out
    return dataclasses.replace(out, new_token_ids=[], new_text="", new_logprobs=(
        None if out.new_logprobs is None else []))


def _merge(parts: list[dict]) -> dict:
    """Completion logprobs objects of consecutive outputs as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in parts for x in p[k]] for k in keys}


class _TokenizeRequest(pydantic.BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class _DetokenizeRequest(pydantic.BaseModel):
    model: str | None = None
    tokens: list[int]


class _LoadLoraRequest(pydantic.BaseModel):
    lora_name: str = pydantic.Field(min_length=1, max_length=256)
    lora_path: str = pydantic.Field(min_length=1)


class _UnloadLoraRequest(pydantic.BaseModel):
    lora_name: str = pydantic.Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's clients send it; the name decides
