"""One engine, two front doors: gRPC (Inference, JetStream's Orchestrator, health,
reflection) and OpenAI-compatible HTTP (server/http_server.py), with warm-up and a
graceful drain for both. The engine loop runs in a process of its own (or on a thread of
this one: server/engine_core.py).

Start-up: once the model is loaded, both ports open, not ready (gRPC health NOT_SERVING,
HTTP /health 503, so probes see a live process), the step buckets compile, then both turn
ready.
SIGTERM/SIGINT: both stop accepting (UNAVAILABLE / 503), in-flight requests get `grace_s`
seconds to finish, the rest are aborted, and the process exits 0; during warm-up, both
close and the engine is stopped (killed if it does not answer in 5 s), exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.engine.multimodal.inputs import ImagePreparer
from jaxserve.loading.media import MediaPolicy
from server.async_engine import AsyncEngine
from server.engine_core import EngineProcess, EngineThread, freeze_heap_now
from server.http_server import HTTPServer
from server.jetstream import OrchestratorServicer
from server.metrics import Metrics
from server.protos.jaxserve.v1 import inference_pb2 as pb
from server.protos.jaxserve.v1 import inference_pb2_grpc as pb_grpc
from server.protos.jetstream_proto import jetstream_pb2 as js
from server.protos.jetstream_proto import jetstream_pb2_grpc as js_grpc
from server.security import Security
from server.servicer import InferenceServicer
from server.tool_parsers import get_parser
from server.undecodable import add_servicer

log = logging.getLogger(__name__)

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
JETSTREAM_SERVICE = js.DESCRIPTOR.services_by_name["Orchestrator"].full_name
MAX_SEND_BYTES = 64 * 2**20
MAX_PENDING_CALLS = 65536
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_SEND_BYTES),
    # Calls gRPC holds before a handler takes them: past a soft limit (default 1,000) gRPC
    # cancels some at random (CANCELLED, indistinguishable from the client's own), past the
    # hard one it refuses. One limit, set high, so a burst reaches our admission, which
    # answers RESOURCE_EXHAUSTED past --max-waiting.
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    # Keep idle streams (a long prefill sends nothing for a while) alive, and let clients
    # ping as often as every 10 s without being cut off.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def request_bytes_limit(max_prompt_bytes: int) -> int:
    """The largest gRPC message / HTTP body taken: a prompt at the limit, twice over (JSON
    escapes, chat message framing, tools), plus 1 MiB for the rest of the request."""
    return 2 * max_prompt_bytes + 2**20


def image_bytes_limit(images: ImagePreparer | None, media: MediaPolicy) -> int:
    """What a request's images may add to it: as many as a prompt may carry (4 when
    unlimited), each of the most bytes an image may have, in base64; 0 for a text model."""
    if images is None:
        return 0
    count = images.max_per_prompt if images.max_per_prompt is not None else 4
    return count * (media.max_bytes * 4 // 3 + 4)


async def serve(core: EngineProcess | EngineThread, host: str = "127.0.0.1", port: int = 50051,
                grace_s: float = 30.0, model_name: str = "",
                http_port: int | None = 8000, max_prompt_bytes: int | None = None,
                security: Security | None = None, tool_call_parser: str | None = None,
                media: MediaPolicy = MediaPolicy(), reasoning_parser: str | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code. `core`: the engine loop,
    loaded and not started (it warms up when started). `http_port` None: gRPC only.
    `max_prompt_bytes` (default from max_model_len) bounds prompt text before tokenizing,
    and gRPC messages and HTTP bodies to what such a prompt needs. `security`: TLS and API
    keys for both servers (server/security.py). `tool_call_parser`: the format tool calls
    are read in for tool_choice "auto" (server/tool_parsers.py); `reasoning_parser`: the
    reasoning block split from chat answers (server/reasoning.py). `media`: where chat
    messages' images may be read from (loading/media.py); a vision-language model's
    requests may also be larger by its images (`image_bytes_limit`)."""
    security = security or Security()
    stop = _stop_on_signals()  # SIGTERM / SIGINT from now on, warm-up included
    try:
        security.check_bind(host)
        metrics = Metrics(model_name)
        async_engine = AsyncEngine(core, metrics=metrics, max_prompt_bytes=max_prompt_bytes,
                                   media=media)
        request_limit = request_bytes_limit(async_engine.max_prompt_bytes) + image_bytes_limit(
            async_engine.info.images, media)
        grpc_server = GrpcServer(async_engine, model_name, security, request_limit, host, port)
        await grpc_server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await grpc_server.server.start()
        log.info("listening on %s%s%s (NOT_SERVING until warm-up ends)", grpc_server.address,
                 " with TLS" if security.tls else "",
                 ", API keys required" if security.auth else "")
        http = http_task = None
        if http_port is not None:
            parser = get_parser(tool_call_parser) if tool_call_parser else None
            http = HTTPServer(async_engine, model_name, metrics, max_body_bytes=request_limit,
                              security=security, tool_parser=parser,
                              reasoning_parser=reasoning_parser)
            http_task = await _start_http(http, host, http_port, grpc_server.server)
            log.info("HTTP (OpenAI API) on %s://%s:%d (503 until warm-up ends)",
                     "https" if security.tls else "http", host, http_port)
        async_engine.start()
        # Warm-up (compiling the step's programs), unless a signal ends it first.
        ready = asyncio.create_task(async_engine.wait_ready())
        await asyncio.wait([ready, asyncio.create_task(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            log.info("signalled during warm-up: stopping")
            await grpc_server.server.stop(grace=None)
            if http is not None:
                http.shutdown()
                await http_task
            core.stop(5.0)
            return 0
        ready.result()  # raises what failed
        await grpc_server.set_health(health_pb2.HealthCheckResponse.SERVING)
        if http is not None:
            http.ready = True
    except BaseException:
        # The engine's child process ignores SIGTERM once loaded: stop it here, or this
        # process would wait on it forever at exit (a port in use, a failed warm-up).
        core.stop(5.0)
        raise
    log.info("ready: serving %s on %s%s", model_name or "model", grpc_server.address,
             f" and http://{host}:{http_port}" if http is not None else "")
    freeze_heap_now()
    await _serve_until_signalled(async_engine, grpc_server, stop)
    await _drain(async_engine, grpc_server, http, http_task, grace_s)
    log.info("stopped")
    return 0 if async_engine.error is None else 1


class GrpcServer:
    """The gRPC front door, bound and not started: our Inference service and JetStream's
    Orchestrator, health (NOT_SERVING until `set_health` says otherwise) and reflection."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, security: Security,
                 request_limit: int, host: str, port: int):
        self.servicer = InferenceServicer(async_engine, model_name,
                                          async_engine.info.mesh_shape, security)
        server = grpc.aio.server(
            interceptors=security.grpc_interceptors(),
            options=SERVER_OPTIONS + [("grpc.max_receive_message_length", request_limit)])
        add_servicer(pb_grpc.add_InferenceServicer_to_server, self.servicer, server)
        serving = lambda: self.servicer.accepting and async_engine.is_alive  # noqa: E731
        add_servicer(js_grpc.add_OrchestratorServicer_to_server,
                     OrchestratorServicer(async_engine, serving), server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if security.serve_reflection:
            reflection.enable_server_reflection(
                (INFERENCE_SERVICE, JETSTREAM_SERVICE, health.SERVICE_NAME,
                 reflection.SERVICE_NAME), server)
        self.address = f"{host}:{port}"
        credentials = security.grpc_credentials()
        bound_port = (server.add_secure_port(self.address, credentials)
                      if credentials is not None else server.add_insecure_port(self.address))
        if bound_port == 0:
            raise ValueError(f"cannot bind {self.address}")
        self.server = server

    async def set_health(self, status) -> None:
        for name in ("", INFERENCE_SERVICE, JETSTREAM_SERVICE):
            await self.health.set(name, status)


async def _start_http(http: HTTPServer, host: str, port: int, grpc_server) -> asyncio.Task:
    """Start the HTTP server; if its port cannot be bound, stop gRPC and raise why."""
    bound = asyncio.Event()
    task = asyncio.create_task(http.serve(host, port, bound))
    await asyncio.wait([task, asyncio.create_task(bound.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        await grpc_server.stop(grace=None)
        task.result()  # raises the bind error
    return task


def _stop_on_signals() -> asyncio.Event:
    """An event SIGTERM and SIGINT set (in place of asyncio's own Ctrl-C handling)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve_until_signalled(async_engine: AsyncEngine, grpc_server: GrpcServer,
                                 stop: asyncio.Event) -> None:
    """Wait for `stop` (a signal); if the engine loop dies meanwhile, turn NOT_SERVING."""
    stop_task = asyncio.create_task(stop.wait())
    while not stop.is_set():
        await asyncio.wait([stop_task], timeout=1.0)
        if not async_engine.is_alive:
            log.error("the engine loop died (%r)%s: NOT_SERVING", async_engine.error,
                      " - a follower process is gone or unreachable"
                      if async_engine.info.multi_host else "")
            await grpc_server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            await stop.wait()


async def _drain(async_engine: AsyncEngine, grpc_server: GrpcServer, http: HTTPServer | None,
                 http_task: asyncio.Task | None, grace_s: float) -> None:
    """Stop accepting on both doors, give the requests in flight `grace_s` seconds, abort
    the rest, and stop both servers and the engine loop."""
    log.info("draining: NOT_SERVING, %d requests in flight, %.0f s grace",
             async_engine.num_streams(), grace_s)
    grpc_server.servicer.accepting = False
    if http is not None:
        http.accepting = False
    await grpc_server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while async_engine.num_streams() and loop.time() < deadline:
        await asyncio.sleep(0.1)
    async_engine.abort_all()
    await asyncio.sleep(0.2)  # let the aborts reach their streams
    await grpc_server.server.stop(grace=2.0)
    if http is not None:
        http.shutdown()
        await http_task
    async_engine.stop()
