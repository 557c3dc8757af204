"""Start a real `jaxserve serve` (or `jaxserve router`) process on a free localhost port for
end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Two token buckets (the default would compile five): servers start in fewer seconds.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--page-size", "4",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--token-buckets", "16,64"]
# The same engine settings for the offline API, to compare outputs.
ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ssl_context(tls: tuple[str, str, str] | None) -> ssl.SSLContext | bool:
    """For httpx: trust the CA and show the client certificate of `tls` (CA, cert, key)."""
    if tls is None:
        return True
    context = ssl.create_default_context(cafile=tls[0])
    context.load_cert_chain(tls[1], tls[2])
    return context


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 300,
                 cold: bool = False, http_url: str | None = None,
                 tls: tuple[str, str, str] | None = None) -> None:
    """Poll grpc.health.v1 until SERVING. A `cold` server (compiling every program, which
    takes seconds) must have said NOT_SERVING during its warm-up; one that reads them from
    the compilation cache may be ready before the first poll. With `http_url`, GET /health
    is polled too and its status codes kept in `proc.http_health` (None: no answer).
    `tls`: (CA, client certificate, client key) files to reach a TLS server with."""
    # Reconnect every 0.1-0.2 s: gRPC's default backoff after the refused connections of the
    # server's import time grows past a cold warm-up (~3 s), which the poll then misses.
    options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 200)]
    if tls is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        ca, cert, key = (open(p, "rb").read() for p in tls)
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(ca, key, cert),
                                      options=options)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    seen_not_serving = False
    proc.http_health = []
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "server exited during start-up"
            if http_url is not None:
                try:
                    proc.http_health.append(httpx.get(
                        f"{http_url}/health", timeout=0.5, verify=ssl_context(tls)).status_code)
                except httpx.HTTPError:
                    proc.http_health.append(None)
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    assert seen_not_serving or not cold, \
                        "health was never NOT_SERVING during warm-up"
                    return
                seen_not_serving = True
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise TimeoutError("server did not become SERVING")
    finally:
        channel.close()


@contextlib.contextmanager
def running_server(model_dir, log_path, *extra_flags: str, cold: bool = False,
                   tls: tuple[str, str, str] | None = None):
    """Yield (gRPC target, process); the process's `http_url` is its OpenAI API's base URL.
    Kill the process if a test left it running. `cold`: without the compilation cache (see
    wait_serving). `tls`: (CA, client cert, client key) for a server started with TLS."""
    if cold:
        extra_flags += ("--compilation-cache-dir", "off")
    port, http_port = free_port(), free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve", "serve", "--model", str(model_dir),
             "--port", str(port), "--http-port", str(http_port), *ENGINE_FLAGS, *extra_flags],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    proc.http_url = f"{'http' if tls is None else 'https'}://127.0.0.1:{http_port}"
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, proc, cold=cold, http_url=proc.http_url, tls=tls)
    except BaseException:
        proc.kill()
        print(open(log_path).read())
        raise
    try:
        yield target, proc
    finally:
        if proc.poll() is None:
            proc.kill()


def wait_idle(client, timeout: float = 10):
    """Poll the gRPC status until nothing runs or waits (or `timeout`); the last status."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.status()
        if (status.running_requests == 0 and status.waiting_requests == 0) or \
                time.monotonic() > deadline:
            return status
        time.sleep(0.05)


@contextlib.contextmanager
def running_router(prefill: list[str], decode: list[str], log_path, grpc_targets=None):
    """Start `jaxserve router` over prefill and decode servers' URLs; yield its URL (and
    with `grpc_targets`, (prefill, decode) gRPC targets, its gRPC face on `url.grpc`)."""
    port, grpc_port = free_port(), free_port()
    flags = []
    if grpc_targets is not None:
        flags = ["--prefill-grpc", *grpc_targets[0], "--decode-grpc", *grpc_targets[1],
                 "--grpc-port", str(grpc_port)]
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jaxserve", "router", "--prefill",
                                 *prefill, "--decode", *decode, "--port", str(port), *flags],
                                stdout=out, stderr=subprocess.STDOUT)
    url = RouterUrl(f"http://127.0.0.1:{port}")
    url.grpc = f"127.0.0.1:{grpc_port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise TimeoutError(open(log_path).read())
        yield url
    finally:
        proc.kill()


class RouterUrl(str):
    grpc: str


def accumulate_tool_calls(chunks) -> tuple[str, dict[int, dict], str]:
    """What a streaming client assembles: content, tool calls by index, finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content, calls, finish
