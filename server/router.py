"""`jaxserve router`: one OpenAI-compatible HTTP endpoint in front of prefill servers and
decode servers (docs/disaggregation.md).

Each request to /v1/completions or /v1/chat/completions goes first to a prefill server
(`jaxserve serve --kv-transfer-config '{"kv_role": "kv_producer"}'`), unstreamed, with
`kv_transfer_params: {"do_remote_decode": true}`: it computes the prompt, samples the
first token and holds the prompt's K/V, named in its response's `kv_transfer_params`.
Unless that token ended the request (its response is then the answer), the request goes
on to a decode server (`kv_role: kv_consumer`) with those params: it pulls the K/V from
the prefill server and decodes from the second token on, streamed or not as the client
asked. The client gets one response: the first token's text, then the decode server's.

Picking servers: a prefill server by prefix-cache affinity (the one that last took a
request starting the same way, unless it has 2 more requests in flight than the least
busy), else the least busy; a decode server by the fewest requests in flight. A prefill
server that cannot be reached, answers 5xx, or fails while its K/V are pulled (the decode
server answers 503 for `kv_transfer_params`) is marked down for a while and the request
tried once more on another one; with none left the client gets 502 saying what failed.
Requests with `n` > 1 or tools are refused (400): the decode server would parse tool calls
from its part of the text only; so is beam search (each of its steps is a one-token
request of every beam).

POST /v1/responses (OpenAI's Responses API) goes the chat route's way: the router turns
it into a chat completion as a server does (server/responses.py), and the answer, or its
stream, into a response or its events; it keeps the newest responses for
previous_response_id and GET /v1/responses/{id} itself.

GET /health is 200 while a prefill and a decode server answer their /health; /metrics has
the requests, the time to first token split into queue and prefill (on the prefill
server), transfer (the decode server's pull and admission) and first decode, and the
retries; /v1/models, /v1/embeddings, /classify, /score, /rerank (and their /v1/, /v2/
paths), /tokenize, /detokenize and /version are a decode server's. Loading
or unloading a LoRA adapter (/v1/load_lora_adapter, /v1/unload_lora_adapter) goes to
every server: a load that fails on one is undone on those it succeeded on.

With `grpc_port` (and each server's gRPC target) the router also serves jaxserve.v1's
Inference service: Generate goes the same way over the servers' gRPC APIs
(`kv_transfer_params_json`), GetModelInfo, Tokenize, Embed, Classify and Score are a decode
server's, Abort goes
to every server, GetServerStatus sums theirs; gRPC health is SERVING while it runs.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import httpx
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from server import openai_protocol as oai
from server import responses
from server.http_server import PAGE_HEADER, QUEUE_HEADER
from server.metrics import CONTENT_TYPE, PREFIX, TTFT_BUCKETS
from server.protos.jaxserve.v1 import inference_pb2 as pb
from server.protos.jaxserve.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

AFFINITY_SLACK = 2  # in-flight requests a prefix's server may have over the least busy's
DOWN_SECONDS = 5.0  # a failed server is skipped this long (unless none is left)
AFFINITY_ENTRIES = 4096


@dataclasses.dataclass(eq=False)
class Upstream:
    url: str
    role: str  # "prefill" | "decode"
    grpc_target: str | None = None  # its gRPC API (host:port), for the router's gRPC face
    in_flight: int = 0
    down_until: float = 0.0
    page_size: int = 0  # a prefill server's prefix-cache page size (PAGE_HEADER), 0: off
    healthy: bool = True  # its last /health answer
    _stub: pb_grpc.InferenceStub | None = None

    @property
    def stub(self) -> pb_grpc.InferenceStub:
        if self._stub is None:
            self._stub = pb_grpc.InferenceStub(grpc.aio.insecure_channel(self.grpc_target))
        return self._stub

    @property
    def up(self) -> bool:
        return self.healthy and time.monotonic() >= self.down_until


class _RouterError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    @classmethod
    def of(cls, e: oai.APIError) -> _RouterError:
        return cls(e.status, e.message, e.param)

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": "router_error",
                                       "param": self.param, "code": self.status}},
                            status_code=self.status)


class Router:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0,
                 prefill_grpc: list[str] | None = None, decode_grpc: list[str] | None = None):
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode server")
        for urls, targets, name in ((prefill, prefill_grpc, "prefill"),
                                    (decode, decode_grpc, "decode")):
            if targets is not None and len(targets) != len(urls):
                raise ValueError(f"give each {name} server's gRPC target, in the order of "
                                 f"their URLs ({len(urls)}), got {len(targets)}")
        self.prefill = [Upstream(u.rstrip("/"), "prefill", g)
                        for u, g in zip(prefill, prefill_grpc or [None] * len(prefill))]
        self.decode = [Upstream(u.rstrip("/"), "decode", g)
                       for u, g in zip(decode, decode_grpc or [None] * len(decode))]
        self.timeout = timeout
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))
        self._affinity: collections.OrderedDict[bytes, Upstream] = collections.OrderedDict()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "router_requests", "requests by outcome",
                                ["outcome"], registry=r)
        self.retries = Counter(PREFIX + "router_prefill_retries",
                               "requests tried again on another prefill server", registry=r)
        self.handoffs = Counter(PREFIX + "router_handoffs",
                                "requests decoded on a decode server", registry=r)
        self.phase = Histogram(PREFIX + "router_ttft_phase_seconds",
                               "time to first token, by phase: queue (waiting on the "
                               "prefill server, HTTP only), prefill (the rest of its "
                               "answer), transfer (the decode server pulling the K/V and "
                               "admitting), first_decode (to its first token)",
                               ["phase"], buckets=TTFT_BUCKETS, registry=r)
        self.transfer_bytes = Histogram(PREFIX + "router_kv_transfer_bytes",
                                        "bytes of K/V each handed-off request moved",
                                        buckets=[2 ** k for k in range(10, 36, 2)],
                                        registry=r)
        self.ttft = Histogram(PREFIX + "router_time_to_first_token_seconds",
                              "from the request to its first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.up = Gauge(PREFIX + "router_upstream_up", "1 while a server answers /health",
                        ["role", "url"], registry=r)
        self.stored = responses.Store()  # the Responses API's stored responses
        self.app = self._app()
        self._health_task: asyncio.Task | None = None

    # ---------------------------------------------------------------- picking

    def _key(self, body: dict) -> bytes:
        """What requests that share a prefix have in common: the start of the prompt."""
        prompt = body.get("messages", body.get("prompt"))
        return hashlib.blake2b(json.dumps(prompt, sort_keys=True)[:1024].encode(),
                               digest_size=16).digest()

    def _next_prefill(self, key: bytes, tried: set) -> Upstream | None:
        """The prefill server to try next (added to `tried`; a second try counted), None
        when every one has been tried."""
        candidates = [u for u in self.prefill if u not in tried and u.up] or \
            [u for u in self.prefill if u not in tried]
        if not candidates:
            return None
        least = min(candidates, key=lambda u: u.in_flight)
        preferred = self._affinity.get(key)
        server = (preferred if preferred in candidates
                  and preferred.in_flight <= least.in_flight + AFFINITY_SLACK else least)
        tried.add(server)
        if len(tried) > 1:
            self.retries.inc()
        return server

    def _handed_off(self, kv: dict) -> None:
        """Count a request the decode server took, and the K/V bytes it moved."""
        self.handoffs.inc()
        self.transfer_bytes.observe(kv.get("num_bytes", 0))

    def _pick_decode(self) -> Upstream:
        candidates = [u for u in self.decode if u.up] or self.decode
        return min(candidates, key=lambda u: u.in_flight)

    def _remember(self, key: bytes, server: Upstream) -> None:
        self._affinity[key] = server
        self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)

    # --------------------------------------------------------------- requests

    async def handle(self, request: Request, path: str):
        start = time.monotonic()
        try:
            body = await request.json()
        except ValueError:
            return _RouterError(400, "the body is not JSON").response()
        if not isinstance(body, dict):
            return _RouterError(400, "the body must be a JSON object").response()
        if body.get("n", 1) != 1:
            return _RouterError(400, "the router serves n = 1 only", "n").response()
        if body.get("use_beam_search"):
            return _RouterError(400, "beam search is not served through the router",
                                "use_beam_search").response()
        if body.get("tools"):
            return _RouterError(400, "tools are not served through the router yet",
                                "tools").response()
        if body.get("kv_transfer_params"):
            return _RouterError(400, "kv_transfer_params is the router's to set",
                                "kv_transfer_params").response()
        headers = _auth(request)
        try:
            response = await self._route(body, path, headers, start)
        except _RouterError as e:
            self.requests.labels("error").inc()
            return e.response()
        return response

    async def _route(self, body: dict, path: str, headers: dict, start: float,
                     used: dict | None = None):
        """The answer (`used["prefill"]`: the prefill server that gave the first token)."""
        key, tried = self._key(body), set()
        stream = bool(body.get("stream"))
        while True:
            server = self._next_prefill(key, tried)
            if server is None:
                raise _RouterError(502, "no prefill server could take the request: "
                                   + "; ".join(sorted(self._failures)))
            answer = await self._prefill(server, body, path, headers)
            if answer is None:
                continue  # that server failed: the next one
            first, queued = answer
            self._remember(key, server)
            if used is not None:
                used["prefill"] = server
            self.phase.labels("queue").observe(queued)
            self.phase.labels("prefill").observe(max(time.monotonic() - start - queued, 0.0))
            kv = first.get("kv_transfer_params")
            if kv is None:  # the request ended on the prefill server
                self.requests.labels("prefill_only").inc()
                self.ttft.observe(time.monotonic() - start)
                return _as_stream(first, path, _include_usage(body)) if stream \
                    else JSONResponse(first)
            decode = self._pick_decode()
            result = await self._decode(decode, server, body, first, kv, path, headers,
                                        stream, start)
            if result is not None:
                self._handed_off(kv)
                return result

    @property
    def _failures(self) -> set[str]:
        return {f"{u.url} is down" for u in self.prefill if not u.up}

    async def _prefill(self, server: Upstream, body: dict, path: str, headers: dict
                       ) -> tuple[dict, float] | None:
        """The prefill server's answer and the seconds the request queued there (None: it
        failed, marked down), or the client's error from it (raised)."""
        req = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        req.pop("stream_options", None)
        server.in_flight += 1
        try:
            r = await self.client.post(server.url + path, json=req, headers=headers)
        except httpx.HTTPError as e:
            self._down(server, e)
            return None
        finally:
            server.in_flight -= 1
        if r.status_code >= 500:
            self._down(server, f"{r.status_code} {r.text[:200]}")
            return None
        if r.status_code != 200:  # the request's own fault: the client's answer
            raise _RouterError(r.status_code, _message(r), _param(r))
        server.page_size = int(r.headers.get(PAGE_HEADER, 0))
        return r.json(), float(r.headers.get(QUEUE_HEADER, 0.0))

    def _down(self, server: Upstream, why) -> None:
        log.warning("%s server %s failed (%s); skipped for %g s", server.role, server.url,
                    why, DOWN_SECONDS)
        server.down_until = time.monotonic() + DOWN_SECONDS

    async def _decode(self, decode: Upstream, prefill: Upstream, body: dict, first: dict,
                      kv: dict, path: str, headers: dict, stream: bool, start: float):
        """The decode server's answer joined to the first token (None: the K/V could not
        be pulled from `prefill`, now marked down: try another)."""
        req = {**body, "kv_transfer_params": {**kv, "do_remote_prefill": True}}
        # The prompt's echo and logprobs came with the first token (`_joined`).
        req.pop("prompt_logprobs", None)
        if req.get("echo"):
            req["echo"] = False
        sent = time.monotonic()
        decode.in_flight += 1
        released = False
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", decode.url + path, json=req,
                                          headers=headers), stream=True)
        except httpx.HTTPError as e:
            decode.in_flight -= 1
            self._down(decode, e)
            raise _RouterError(502, f"the decode server at {decode.url} failed: {e}") from e
        try:
            if upstream.status_code != 200:
                await upstream.aread()
                if upstream.status_code == 503 and _param(upstream) == "kv_transfer_params":
                    self._down(prefill, _message(upstream))
                    return None
                raise _RouterError(upstream.status_code, _message(upstream), _param(upstream))
            admitted = time.monotonic()
            self.phase.labels("transfer").observe(admitted - sent)
            if not stream:
                await upstream.aread()
                self.ttft.observe(time.monotonic() - start)
                self.requests.labels("ok").inc()
                return JSONResponse(_joined(first, upstream.json(), path))
            released = True
            return StreamingResponse(self._relay(first, upstream, decode, path, start,
                                                 admitted),
                                     media_type="text/event-stream")
        finally:
            if not released:
                decode.in_flight -= 1
                await upstream.aclose()

    async def _relay(self, first: dict, upstream: httpx.Response, decode: Upstream,
                     path: str, start: float, admitted: float) -> AsyncIterator[str]:
        """The first token's chunk, then the decode server's stream (its own opening
        role chunk dropped, its usage counting the first token). The first token goes
        once the decode server has its K/V (an error before then is still an HTTP status
        the router can act on)."""
        chat = path.endswith("chat/completions")
        got_first = False
        try:
            self.ttft.observe(time.monotonic() - start)
            yield from_chunks(_first_chunk(first, chat))
            async for line in upstream.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data != "[DONE]":
                    chunk = json.loads(data)
                    if chat and _role_only(chunk):
                        continue
                    chunk["id"] = first["id"]
                    for choice in chunk.get("choices") or ():  # in the first chunk
                        choice.pop("prompt_token_ids", None)
                    if chunk.get("usage"):
                        chunk["usage"] = _add_usage(chunk["usage"], first["usage"])
                    if not got_first and chunk.get("choices"):
                        got_first = True
                        self.phase.labels("first_decode").observe(time.monotonic() - admitted)
                    data = json.dumps(chunk)
                yield f"data: {data}\n\n"
            self.requests.labels("ok").inc()
        finally:
            decode.in_flight -= 1
            await upstream.aclose()

    # -------------------------------------------------------------- responses

    async def respond(self, request: Request):
        """OpenAI's Responses API over the chat route (the module docstring)."""
        start = time.monotonic()
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _RouterError(400, "the body is not JSON").response()
        try:
            if not isinstance(body, dict):
                raise oai.APIError(400, "the body must be a JSON object")
            req = responses.ResponsesRequest.model_validate(body).checked()
            if req.tools:
                raise oai.APIError(400, "tools are not served through the router yet",
                                   "tools")
            if req.background:
                raise oai.APIError(400, "background responses are not served through the "
                                        "router", "background")
            messages = []
            if req.previous_response_id is not None:
                previous = self.stored.get(req.previous_response_id)
                messages = previous.messages + responses.output_messages(
                    previous.body["output"])
            messages += responses.input_messages(req)
            system = [{"role": "system", "content": req.instructions}] \
                if req.instructions else []
            chat = responses.chat_body(req, system + messages)
        except pydantic.ValidationError as e:
            return _RouterError.of(oai.invalid(e)).response()
        except oai.APIError as e:
            return _RouterError.of(e).response()
        if req.stream:
            chat["stream_options"] = {"include_usage": True}
        headers = _auth(request)
        used: dict = {}
        try:
            answer = await self._route(chat, CHAT_PATH, headers, start, used)
        except _RouterError as e:
            self.requests.labels("error").inc()
            return e.response()
        rid, created = responses.new_id("resp"), float(int(time.time()))
        page_size = used["prefill"].page_size
        if req.stream:
            return StreamingResponse(self._response_events(answer, req, messages, rid,
                                                           created, page_size),
                                     media_type="text/event-stream")
        whole = json.loads(answer.body)
        choice = whole["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        status = responses.status_of(finish)[0]
        out = responses.body(
            req, rid, whole["model"], created,
            responses.output_items(message, "incomplete" if status == "failed" else status,
                                   (choice.get("logprobs") or {}).get("content") or []),
            finish, responses.usage(whole["usage"], 0, page_size))
        if req.store:
            self.stored.put(rid, responses.Stored(messages, out))
        return JSONResponse(out)

    async def _response_events(self, answer: StreamingResponse,
                               req: responses.ResponsesRequest, messages: list[dict],
                               rid: str, created: float, page_size: int
                               ) -> AsyncIterator[str]:
        """The chat stream `answer` as the Responses API's events (no reasoning: a server
        with a reasoning parser refuses kv_transfer_params)."""
        events, model, finish, usage, error = responses.Events(), req.model, None, None, None

        def sse(event: dict) -> str:
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        def opening() -> list[str]:
            start = responses.body(req, rid, model, created, [], None, None)
            return [sse(events.event("response.created", response=start)),
                    sse(events.event("response.in_progress", response=start))]

        chunks = _sse_data(answer.body_iterator)
        try:
            async for chunk in chunks:
                if events.seq == 0:
                    model = chunk.get("model", model)
                    for text in opening():
                        yield text
                if "error" in chunk:
                    error = chunk["error"]
                for choice in chunk.get("choices") or ():
                    events.add_logprobs((choice.get("logprobs") or {}).get("content") or [])
                    for event in events.feed(choice.get("delta") or {}):
                        yield sse(event)
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        finally:
            await chunks.aclose()
        if events.seq == 0:
            for text in opening():
                yield text
        finish = "error" if error else finish
        for event in events.finish(responses.status_of(finish)[0]):
            yield sse(event)
        out = responses.body(req, rid, model, created, events.output, finish,
                             responses.usage(usage, 0, page_size) if usage else None)
        if error:
            out["error"] = {"code": "server_error", "message": error.get("message", "")}
        if req.store:
            self.stored.put(rid, responses.Stored(messages, out))
        yield sse(events.event(f"response.{out['status']}", response=out))

    # ------------------------------------------------------- passed-on calls

    async def _call(self, server: Upstream, request: Request, body: bytes,
                    path: str | None = None) -> httpx.Response:
        """`request` (its method and API key, with `body`: read once by the caller, as
        concurrent reads of a request's body race) as `server` answers it, at `path`
        (default: the request's); a server that cannot be reached answers 502."""
        headers = {**_auth(request),
                   "content-type": request.headers.get("content-type", "application/json")}
        try:
            return await self.client.request(request.method,
                                             server.url + (path or request.url.path),
                                             content=body, headers=headers)
        except httpx.HTTPError as e:
            self._down(server, e)
            error = _RouterError(502, f"the {server.role} server at {server.url} failed: {e}")
            return httpx.Response(502, content=error.response().body)

    async def _load_everywhere(self, request: Request) -> Response:
        """An adapter loaded on every server (both sides compute under it); where one
        refuses or fails, unloaded again from those that took it, and that answer given
        (naming the server)."""
        servers, body = self.prefill + self.decode, await request.body()
        answers = await asyncio.gather(*(self._call(u, request, body) for u in servers))
        failed = [(u, a) for u, a in zip(servers, answers) if a.status_code != 200]
        if not failed:
            return _passed(answers[0])
        took = [u for u, a in zip(servers, answers) if a.status_code == 200]
        await asyncio.gather(*(self._call(u, request, body, "/v1/unload_lora_adapter")
                               for u in took))
        server, answer = failed[0]
        undone = " (undone on the servers that had loaded it)" if took else ""
        return _RouterError(answer.status_code, f"the {server.role} server at {server.url}: "
                            f"{_message(answer)}{undone}", _param(answer)).response()

    async def _unload_everywhere(self, request: Request) -> Response:
        """An adapter unloaded from every server: 200 when it is gone from all of them and
        one had it, 404 when none had it, else the first failure."""
        servers, body = self.prefill + self.decode, await request.body()
        answers = await asyncio.gather(*(self._call(u, request, body) for u in servers))
        for server, answer in zip(servers, answers):
            if answer.status_code not in (200, 404):
                return _RouterError(answer.status_code, f"the {server.role} server at "
                                    f"{server.url}: {_message(answer)}",
                                    _param(answer)).response()
        return _passed(next((a for a in answers if a.status_code == 200), answers[0]))

    # ------------------------------------------------------------------ app

    def _app(self) -> FastAPI:
        app = FastAPI(title="jaxserve router")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.handle(request, "/v1/completions")

        @app.post(CHAT_PATH)
        async def chat(request: Request):
            return await self.handle(request, CHAT_PATH)

        @app.post("/v1/responses")
        async def responses_(request: Request):
            return await self.respond(request)

        @app.get("/v1/responses/{response_id}")
        async def get_response(response_id: str):
            try:
                return JSONResponse(self.stored.get(response_id, "response_id").body)
            except oai.APIError as e:
                return _RouterError.of(e).response()

        @app.get("/v1/models")
        @app.get("/version")
        @app.post("/v1/embeddings")
        @app.post("/classify")
        @app.post("/v1/classify")
        @app.post("/score")
        @app.post("/v1/score")
        @app.post("/rerank")
        @app.post("/v1/rerank")
        @app.post("/v2/rerank")
        @app.post("/tokenize")
        @app.post("/detokenize")
        async def a_decode_servers(request: Request):
            return _passed(await self._call(self._pick_decode(), request,
                                            await request.body()))

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            return await self._load_everywhere(request)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return await self._unload_everywhere(request)

        @app.get("/health")
        async def health():
            ok = any(u.healthy for u in self.prefill) and any(u.healthy for u in self.decode)
            return Response(status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)

        return app

    async def check_health(self, interval: float = 2.0) -> None:
        """Ask every server's /health, forever."""
        while True:
            for u in self.prefill + self.decode:
                try:
                    r = await self.client.get(u.url + "/health", timeout=2.0)
                    u.healthy = r.status_code == 200
                except httpx.HTTPError:
                    u.healthy = False
                self.up.labels(u.role, u.url).set(int(u.healthy))
            await asyncio.sleep(interval)

    async def serve(self, host: str, port: int, grpc_port: int | None = None) -> None:
        self._health_task = asyncio.create_task(self.check_health())
        server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port,
                                              log_level="warning"))
        log.info("router on http://%s:%d: prefill %s, decode %s", host, port,
                 [u.url for u in self.prefill], [u.url for u in self.decode])
        grpc_server = None
        if grpc_port is not None:
            if any(u.grpc_target is None for u in self.prefill + self.decode):
                raise ValueError("the router's gRPC face needs every server's gRPC target "
                                 "(--prefill-grpc, --decode-grpc)")
            grpc_server = grpc.aio.server()
            pb_grpc.add_InferenceServicer_to_server(RouterServicer(self), grpc_server)
            checks = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(checks, grpc_server)
            grpc_server.add_insecure_port(f"{host}:{grpc_port}")
            await grpc_server.start()
            await checks.set("", health_pb2.HealthCheckResponse.SERVING)
            log.info("router's gRPC on %s:%d", host, grpc_port)
        try:
            await server.serve()
        finally:
            self._health_task.cancel()
            if grpc_server is not None:
                await grpc_server.stop(1)
            await self.client.aclose()


# Codes that say a server failed (not the request): the router tries another.
_SERVER_FAULTS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.UNKNOWN)


class RouterServicer(pb_grpc.InferenceServicer):
    """jaxserve.v1.Inference over the servers' gRPC APIs (see the module docstring)."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        r = self.router
        if request.kv_transfer_params_json:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "kv_transfer_params_json is the router's to set")
        start = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        which = request.WhichOneof("prompt")
        key = hashlib.blake2b(getattr(request, which).SerializeToString()[:1024]
                              if which in ("token_ids", "messages")
                              else request.text[:1024].encode(), digest_size=16).digest() \
            if which else b""
        tried: set[Upstream] = set()
        while True:
            server = r._next_prefill(key, tried)
            if server is None:
                r.requests.labels("error").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "no prefill server could take the request: "
                                    + "; ".join(sorted(r._failures)))
            first = pb.GenerateRequest()
            first.CopyFrom(request)
            first.request_id = rid
            first.kv_transfer_params_json = json.dumps({"do_remote_decode": True})
            server.in_flight += 1
            try:
                answer = [x async for x in server.stub.Generate(first, timeout=r.timeout)]
            except grpc.aio.AioRpcError as e:
                if e.code() in _SERVER_FAULTS:
                    r._down(server, f"{e.code().name}: {e.details()}")
                    continue
                r.requests.labels("error").inc()
                await context.abort(e.code(), e.details())
            finally:
                server.in_flight -= 1
            r._remember(key, server)
            r.phase.labels("prefill").observe(time.monotonic() - start)
            done = answer[-1].complete
            if not done.kv_transfer_params_json:  # the request ended on the prefill server
                r.requests.labels("prefill_only").inc()
                r.ttft.observe(time.monotonic() - start)
                for x in answer:
                    yield x
                return
            decode = r._pick_decode()
            rest = pb.GenerateRequest()
            rest.CopyFrom(first)
            kv = json.loads(done.kv_transfer_params_json)
            rest.kv_transfer_params_json = json.dumps({**kv, "do_remote_prefill": True})
            rest.sampling.ClearField("prompt_logprobs")  # the prefill server's first chunk had them
            sent = time.monotonic()
            decode.in_flight += 1
            call = decode.stub.Generate(rest, timeout=r.timeout)
            try:
                try:
                    head = await call.read()
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE and "K/V" in (e.details() or ""):
                        r._down(server, e.details())  # its prefill server failed: again
                        continue
                    r.requests.labels("error").inc()
                    await context.abort(e.code(), f"the decode server at {decode.url}: "
                                                  f"{e.details()}")
                r.phase.labels("transfer").observe(time.monotonic() - sent)
                r.ttft.observe(time.monotonic() - start)
                r._handed_off(kv)
                for x in answer[:-1]:  # the first token's chunk
                    yield x
                x = head
                while x is not grpc.aio.EOF:
                    if x.HasField("complete"):
                        usage = x.complete.usage
                        usage.completion_tokens += done.usage.completion_tokens
                    yield x
                    x = await call.read()
                r.requests.labels("ok").inc()
                return
            finally:
                decode.in_flight -= 1
                call.cancel()

    async def GetModelInfo(self, request, context):
        return await self.router._pick_decode().stub.GetModelInfo(request)

    async def _a_decode_servers(self, method: str, request, context):
        """A decode server's answer to `method` (its error as its status)."""
        try:
            return await getattr(self.router._pick_decode().stub, method)(request)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details())

    async def Tokenize(self, request, context):
        return await self._a_decode_servers("Tokenize", request, context)

    async def Embed(self, request, context):
        return await self._a_decode_servers("Embed", request, context)

    async def Classify(self, request, context):
        return await self._a_decode_servers("Classify", request, context)

    async def Score(self, request, context):
        return await self._a_decode_servers("Score", request, context)

    async def Abort(self, request, context):
        total = 0
        for u in self.router.prefill + self.router.decode:
            try:
                total += (await u.stub.Abort(request, timeout=5)).num_aborted
            except grpc.aio.AioRpcError:
                pass
        return pb.AbortResponse(num_aborted=total)

    async def GetServerStatus(self, request, context):
        out = pb.ServerStatus()
        for u in self.router.prefill + self.router.decode:
            try:
                s = await u.stub.GetServerStatus(request, timeout=5)
            except grpc.aio.AioRpcError:
                continue
            for name in ("running_requests", "waiting_requests", "kv_pages_used",
                         "kv_pages_total", "tokens_per_second", "total_generated_tokens",
                         "steps"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
        return out


CHAT_PATH = "/v1/chat/completions"


def from_chunks(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)


async def _sse_data(texts: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The JSON of each `data:` line of a stream the router answers with."""
    try:
        async for text in texts:
            for line in text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: "):])
    finally:
        await texts.aclose()


def _auth(request: Request) -> dict:
    """The request's headers the router passes on: its API key."""
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


def _include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:500]


def _param(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"].get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _passed(r: httpx.Response) -> Response:
    """A server's answer, as the router's."""
    return Response(r.content, status_code=r.status_code,
                    media_type=r.headers.get("content-type"))


def _role_only(chunk: dict) -> bool:
    """A chat stream's opening chunk: the role and no text."""
    choices = chunk.get("choices") or []
    return bool(choices) and choices[0].get("delta", {}).get("role") is not None and \
        not choices[0]["delta"].get("content") and choices[0].get("finish_reason") is None


def _add_usage(usage: dict, first: dict) -> dict:
    """The decode server's usage with the prefill server's first token counted (and its
    prompt's cached tokens: the prompt was computed there)."""
    done = usage["completion_tokens"] + first["completion_tokens"]
    return {**usage, "completion_tokens": done, "total_tokens": usage["prompt_tokens"] + done,
            "prompt_tokens_details": first["prompt_tokens_details"]}


def _joined(first: dict, rest: dict, path: str) -> dict:
    """One response from the prefill server's (the first token) and the decode server's
    (the others)."""
    a, b = first["choices"][0], rest["choices"][0]
    if path.endswith("chat/completions"):
        choice = {**b, "message": {**b["message"], "content": (a["message"]["content"] or "")
                                   + (b["message"]["content"] or "")}}
        if a.get("logprobs") and b.get("logprobs"):
            choice["logprobs"] = {"content": a["logprobs"]["content"]
                                  + b["logprobs"]["content"]}
    else:
        choice = {**b, "text": a["text"] + b["text"]}
        if a.get("logprobs") and b.get("logprobs"):
            shift = len(a["text"])
            choice["logprobs"] = {
                k: a["logprobs"][k] + ([o + shift for o in b["logprobs"][k]]
                                       if k == "text_offset" else b["logprobs"][k])
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    if "prompt_logprobs" in a:
        choice["prompt_logprobs"] = a["prompt_logprobs"]
    if "token_ids" in b:  # return_token_ids
        choice["token_ids"] = a["token_ids"] + b["token_ids"]
    out = {**rest, "id": first["id"], "choices": [choice],
           "usage": _add_usage(rest["usage"], first["usage"])}
    if "prompt_logprobs" in first:  # a chat response's
        out["prompt_logprobs"] = first["prompt_logprobs"]
    out.pop("kv_transfer_params", None)
    return out


def _first_chunk(first: dict, chat: bool) -> list[dict]:
    """The prefill server's answer (its first token) as stream chunks."""
    c = first["choices"][0]
    base = {"id": first["id"], "created": first["created"], "model": first["model"]}
    ids = {k: c[k] for k in ("prompt_token_ids", "token_ids") if k in c}  # return_token_ids
    if chat:
        prompt = {"prompt_token_ids": first["prompt_token_ids"]} if ids else {}
        return [{**base, "object": "chat.completion.chunk", **prompt, "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": c["message"]["content"]},
            "logprobs": c.get("logprobs"), "finish_reason": None, **ids}]}]
    return [{**base, "object": "text_completion", "choices": [{
        "index": 0, "text": c["text"], "logprobs": c.get("logprobs"),
        "finish_reason": None, **ids}]}]


def _as_stream(first: dict, path: str, include_usage: bool) -> StreamingResponse:
    """A request that ended on the prefill server, for a client that asked for a stream
    (`include_usage`: and its usage, in a last chunk)."""
    chat = path.endswith("chat/completions")
    chunks = _first_chunk(first, chat)
    c = first["choices"][0]
    last = {**chunks[0], "choices": [{**chunks[0]["choices"][0], "finish_reason":
                                      c["finish_reason"], "stop_reason": c.get("stop_reason")}]}
    if chat:
        last["choices"][0]["delta"] = {}
    else:
        last["choices"][0]["text"] = ""
    usage = [{**chunks[0], "choices": [], "usage": first["usage"]}] if include_usage else []
    text = from_chunks(chunks + [last] + usage) + "data: [DONE]\n\n"
    return StreamingResponse(iter([text]), media_type="text/event-stream")
