"""A streamed request's CPU, process by process: jaxserve's servers against the libraries
under them serving the same messages alone, and the offline LLM.

    python benchmarks/front_cost.py [--requests 1024] [--concurrency 256] [--output-len 128]
        [--stream-interval 16] [--model DIR]

Every row serves `--requests` streamed requests, `--concurrency` at once, of a 16-token
prompt and `--output-len` tokens out, over one front, and reports the CPU (user + system,
/proc) each process spent per request:

- grpc.aio alone: a servicer of jaxserve.v1's Generate that sends what jaxserve sends (the
  first token, then groups of `--stream-interval` tokens with their text, then Complete)
  and nothing else; the client is server/bench.py's.
- uvicorn alone (a plain ASGI app) and FastAPI + StreamingResponse: the same as
  /v1/completions' server-sent events, and server/bench.py's HTTP client.
- jaxserve's gRPC and HTTP servers (`jaxserve serve`, the engine in a process of its own)
  on `--model` (default: host_overhead.py's tiny Llama, whose math costs next to nothing).
- the offline LLM on the same model and requests (its one process).
- with `--vllm`, vLLM's CPU build (benchmarks/peers.py) on the same checkpoint: its
  OpenAI-compatible server at the same `--stream-interval` (the engine column: its engine
  core's processes) and its offline LLM.

The library rows pace their messages as an engine would: one ticker wakes every stream
due each `--step-ms`. What the servers cost above the libraries' rows is jaxserve's own
work (validation, the engine's round trip, text, the events); on a machine whose cores
the three processes share, the sum of a row's columns bounds its requests a second:
cores / (ms of CPU a request).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from fastapi import Request  # a route's annotation: resolved in this module's globals

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import http_vs_grpc as hvg  # noqa: E402
import peers  # noqa: E402
from server.bench import _one, _one_http  # noqa: E402

PROMPT_LEN = 16
VOCAB = 2048  # prompt ids below it: valid for the tiny model and any real vocabulary


def prompts(n: int) -> list[list[int]]:
    """The same random prompts for every row (none shares a prefix page with another)."""
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)] for _ in range(n)]


def message_sizes(output_len: int, interval: int) -> list[int]:
    """The tokens each chunk carries: the first alone, then groups of `interval`."""
    rest = output_len - 1
    return [1] + [interval] * (rest // interval) + ([rest % interval] if rest % interval else [])


class Ticker:
    """Wakes the streams waiting for a step every `step_s`, all at once (as the engine's
    outputs arrive once a step)."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.waiting: list[tuple[int, asyncio.Future]] = []
        self.step = 0
        self.task = None

    async def wait(self, steps: int) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((self.step + steps, fut))
        await fut

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self.step += 1
            due = [f for s, f in self.waiting if s <= self.step]
            self.waiting = [(s, f) for s, f in self.waiting if s > self.step]
            for f in due:
                f.set_result(None)


def _grpc_stub_server(port: int, sizes: list[int], step_s: float) -> None:
    from server.protos.jaxserve.v1 import inference_pb2 as pb
    from server.protos.jaxserve.v1 import inference_pb2_grpc as pb_grpc

    class Servicer(pb_grpc.InferenceServicer):
        def __init__(self):
            self.ticker = Ticker(step_s)

        async def Generate(self, request, context):
            for n in sizes:
                await self.ticker.wait(n)
                yield pb.GenerateResponse(request_id="x", chunk=pb.Chunk(
                    token_ids=list(range(n)), text=" word" * n))
            yield pb.GenerateResponse(request_id="x", complete=pb.Complete(
                finish_reason="length", usage=pb.Usage(prompt_tokens=PROMPT_LEN,
                                                       completion_tokens=sum(sizes))))

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _http_stub_server(port: int, sizes: list[int], step_s: float, kind: str) -> None:
    import uvicorn

    ticker = Ticker(step_s)

    def event(payload: dict) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    async def events():
        for n in sizes:
            await ticker.wait(n)
            yield event({"id": "cmpl-x", "object": "text_completion", "created": 0,
                         "model": "m", "choices": [{"index": 0, "text": " word" * n,
                                                    "logprobs": None, "finish_reason": None}]})
        yield event({"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [], "usage": {"prompt_tokens": PROMPT_LEN,
                                              "completion_tokens": sum(sizes),
                                              "total_tokens": PROMPT_LEN + sum(sizes)}})
        yield b"data: [DONE]\n\n"

    async def plain(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        async for e in events():
            await send({"type": "http.response.body", "body": e, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app = plain
    if kind == "fastapi":
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request):
            await request.json()
            return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _serve(target, *args) -> multiprocessing.Process:
    process = multiprocessing.get_context("spawn").Process(target=target, args=args,
                                                           daemon=True)
    process.start()
    return process


async def drive(api: str, port: int, requests: int, concurrency: int, output_len: int
                ) -> int:
    """server/bench.py's clients (gRPC: jaxserve.v1's Generate; HTTP: streaming
    /v1/completions), `requests` of them, `concurrency` at once; the output tokens."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with gate:
            if api == "openai":
                return await _one_http("127.0.0.1", port, prompt, output_len)
            return await _one(channel, api, prompt, output_len)

    results = await asyncio.gather(*[one(p) for p in prompts(requests)])
    await channel.close()
    failed = [r.error for r in results if not r.ok]
    assert not failed, failed[:3]
    return sum(r.output_tokens for r in results)


def measure(api: str, port: int, args, pids: dict[str, list[int]]) -> dict:
    """A warm-up, then one timed run: requests/s, output tokens/s and each role's ms of
    CPU a request, over its processes (None where it has none)."""
    asyncio.run(drive(api, port, args.concurrency, args.concurrency, args.output_len))

    def cpu() -> dict:
        return {k: sum(hvg.cpu_seconds(p) for p in ps) for k, ps in pids.items()}

    before, start = cpu(), time.perf_counter()
    tokens = asyncio.run(drive(api, port, args.requests, args.concurrency, args.output_len))
    elapsed, after = time.perf_counter() - start, cpu()
    ms = {k: 1e3 * (after[k] - before[k]) / args.requests if pids[k] else None for k in pids}
    return {"rps": args.requests / elapsed, "tok_s": tokens / elapsed, **ms}


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in open(f"/proc/{pid}/task/{task}/children").read().split():
            out += [int(child), *descendants(int(child))]
    return out


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port}")


def stub_rows(args, sizes: list[int]) -> list[tuple[str, dict]]:
    """The libraries alone, each served by a process of its own."""
    step_s = args.step_ms / 1e3
    rows = []
    for name, api, make in (
            ("grpc.aio alone", "jaxserve", lambda port: _serve(_grpc_stub_server, port, sizes,
                                                                step_s)),
            ("uvicorn alone (a plain ASGI app)", "openai",
             lambda port: _serve(_http_stub_server, port, sizes, step_s, "plain")),
            ("FastAPI + StreamingResponse", "openai",
             lambda port: _serve(_http_stub_server, port, sizes, step_s, "fastapi"))):
        port = hvg.free_port()
        process = make(port)
        try:
            wait_port(port)
            pids = {"server": [process.pid], "engine": [], "client": [os.getpid()]}
            rows.append((name, measure(api, port, args, pids)))
        finally:
            process.kill()
            process.join()
    return rows


def jaxserve_rows(args) -> list[tuple[str, dict]]:
    server_args = argparse.Namespace(model=str(args.model), dtype="float32",
                                     concurrency=args.concurrency,
                                     stream_interval=args.stream_interval, engine_thread=False)
    grpc_port, http_port = hvg.free_port(), hvg.free_port()
    with open(os.devnull, "w") as log:
        proc = hvg.start_server(server_args, grpc_port, http_port, log)
    rows = []
    try:
        hvg.wait_ready(f"http://127.0.0.1:{http_port}", proc)
        pids = {"server": [proc.pid], "engine": [hvg.engine_child(proc.pid)],
                "client": [os.getpid()]}
        for name, api, port in (("jaxserve gRPC", "jaxserve", grpc_port),
                                ("jaxserve HTTP (SSE)", "openai", http_port)):
            rows.append((name, measure(api, port, args, pids)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def offline_row(args) -> tuple[str, dict]:
    code = f"""
import resource, sys, time
sys.path.insert(0, "benchmarks")
from front_cost import prompts
from jaxserve import LLM, SamplingParams
llm = LLM({str(args.model)!r}, dtype="float32", max_num_seqs={args.concurrency},
          max_model_len=512, max_num_batched_tokens=512, page_size=16)
prompts = prompts({args.requests})
params = SamplingParams(temperature=0.0, max_tokens={args.output_len}, ignore_eos=True)
llm.generate(prompts[:8], params)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c, t = cpu(), time.perf_counter()
outs = llm.generate(prompts, params)
elapsed, used = time.perf_counter() - t, cpu() - c
n = sum(len(o.outputs[0].token_ids) for o in outs)
print("OFFLINE", len(prompts) / elapsed, n / elapsed, 1e3 * used / len(prompts))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
    rps, tok_s, ms = map(float, out.stdout.split("OFFLINE")[-1].split())
    return "offline LLM", {"rps": rps, "tok_s": tok_s, "server": None, "engine": ms,
                           "client": None}


def vllm_rows(args) -> list[tuple[str, dict]]:
    """vLLM's OpenAI server and offline LLM on the same checkpoint, requests and settings."""
    rows = []
    port = hvg.free_port()
    try:
        with peers.vllm_server(Path(args.model), "float32", port, args.concurrency,
                               args.stream_interval, os.cpu_count()) as proc:
            pids = {"server": [proc.pid], "engine": descendants(proc.pid),
                    "client": [os.getpid()]}
            rows.append(("vLLM OpenAI server", measure("openai", port, args, pids)))
    except peers.PeerError as e:
        print(f"vLLM's server: not run ({e})")
    offline, reason = peers.run_vllm_offline(Path(args.model), "float32",
                                             prompts(args.requests), args.output_len,
                                             args.concurrency, os.cpu_count())
    if offline is None:
        print(f"vLLM offline: not run ({reason})")
    else:
        rows.append(("vLLM offline LLM", {"rps": offline["requests_per_s"],
                                          "tok_s": offline["tokens_per_s"], "server": None,
                                          "engine": None, "client": None}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--stream-interval", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=4.0,
                    help="the library rows' engine step (jaxserve's at 256 streams: ~4 ms)")
    ap.add_argument("--model", help="the checkpoint jaxserve serves (default: the tiny "
                    "Llama of host_overhead.py)")
    ap.add_argument("--vllm", action="store_true",
                    help="also vLLM's OpenAI server and offline LLM (its CPU build, installed "
                         "once by benchmarks/peers.py)")
    args = ap.parse_args()
    if args.model is None:
        args.model = peers.checkpoint("configs/models/tiny-llama.yaml", dtype="float32")
    sizes = message_sizes(args.output_len, args.stream_interval)
    rows = stub_rows(args, sizes) + jaxserve_rows(args) + [offline_row(args)]
    if args.vllm:
        rows += vllm_rows(args)

    print(f"\n{datetime.date.today().isoformat()}, {hvg.cpu_name()}, {os.cpu_count()} cores; "
          f"{args.requests} requests, {args.concurrency} at once, {PROMPT_LEN} tokens in / "
          f"{args.output_len} out, {len(sizes)} chunks a stream (--stream-interval "
          f"{args.stream_interval}); ms of CPU a request\n")
    print("| front | server | engine | client | all | requests/s | output tok/s | "
          "most requests/s on all cores |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        parts = [r[k] for k in ("server", "engine", "client")]
        total = sum(p for p in parts if p is not None)
        cells = " | ".join("-" if p is None else f"{p:.3f}" for p in parts)
        whole, most = ((f"{total:.3f}", f"{1e3 * os.cpu_count() / total:.0f}") if total
                       else ("-", "-"))
        print(f"| {name} | {cells} | {whole} | {r['rps']:.0f} | {r['tok_s']:.0f} | {most} |")
    by_name = dict(rows)
    for server, offline in (("jaxserve gRPC", "offline LLM"),
                            ("jaxserve HTTP (SSE)", "offline LLM"),
                            ("vLLM OpenAI server", "vLLM offline LLM")):
        if server in by_name and offline in by_name:
            r, o = by_name[server], by_name[offline]
            total = r["server"] + r["engine"] + r["client"]
            print(f"\n{server}: {r['tok_s'] / o['tok_s']:.2f} of its offline LLM's output "
                  f"tokens/s; with every core busy at most "
                  f"{1e3 * os.cpu_count() / total / o['rps']:.2f}", end="")
    print()

if __name__ == "__main__":
    main()
