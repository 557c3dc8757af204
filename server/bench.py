"""Serving benchmark: random token prompts against a running jaxserve, over its gRPC API,
JetStream's API, or the OpenAI-compatible HTTP API (streaming /v1/completions).

Requests arrive all at once (`--request-rate inf`) or as a Poisson process at the given
rate, with at most `--max-concurrency` in flight. Reports request throughput, output
tokens/s, TTFT and TPOT (mean, median, p99), and, from the jaxserve API's status, the
engine's mean step time and the host gap between steps. Writes JSON with `--json`. The
model facts and the engine status come from the gRPC port (`--target`) whatever `--api`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import random
import time
import urllib.parse

import grpc
import numpy as np

from server.protos.jaxserve.v1 import inference_pb2 as pb
from server.protos.jaxserve.v1 import inference_pb2_grpc as pb_grpc
from server.protos.jetstream_proto import jetstream_pb2 as js
from server.protos.jetstream_proto import jetstream_pb2_grpc as js_grpc


@dataclasses.dataclass
class Result:
    ok: bool
    output_tokens: int = 0
    ttft: float = math.nan
    latency: float = math.nan
    error: str = ""

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def _one_http(host: str, port: int, prompt: list[int], output_len: int) -> Result:
    """One streaming /v1/completions request over a plain asyncio connection (httpx's
    async client delivered SSE events late under 64 streams, which hid the server's real
    TTFT). The count comes from the usage event at the end."""
    body = json.dumps({"prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % (host.encode(), len(body)) + body)
        status = (await reader.readline()).split(b" ", 2)
        if len(status) < 2 or status[1] != b"200":
            return Result(False, error=f"HTTP {b' '.join(status[1:]).decode().strip()}: "
                                       f"{(await reader.read()).decode(errors='replace')}")
        first, last = None, b""
        while line := await reader.readline():  # chunk-size lines never start with "data"
            if line.startswith(b"data: {"):
                first = first or time.perf_counter()
                last = line
    finally:
        writer.close()
    end = time.perf_counter()
    n = json.loads(last[6:])["usage"]["completion_tokens"] if last else 0
    return Result(True, n, (first or end) - start, end - start)


async def _one(channel, api: str, prompt: list[int], output_len: int) -> Result:
    start = time.perf_counter()
    first, n = None, 0
    try:
        if api == "jetstream":
            stream = js_grpc.OrchestratorStub(channel).Decode(js.DecodeRequest(
                token_content=js.DecodeRequest.TokenContent(token_ids=prompt),
                max_tokens=output_len, has_bos=True))
            async for msg in stream:
                n += sum(len(s.token_ids) for s in msg.stream_content.samples)
                first = first or time.perf_counter()
        else:
            stream = pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=output_len,
                                           ignore_eos=True)))
            async for msg in stream:
                if msg.HasField("chunk") and msg.chunk.token_ids:
                    n += len(msg.chunk.token_ids)
                    first = first or time.perf_counter()
    except grpc.aio.AioRpcError as e:
        return Result(False, error=f"{e.code().name}: {e.details()}")
    end = time.perf_counter()
    return Result(True, n, (first or end) - start, end - start)


async def run(target: str, api: str, num_prompts: int, input_len: int, output_len: int,
              request_rate: float, max_concurrency: int | None, seed: int,
              http_url: str = "http://127.0.0.1:8000") -> dict:
    channel = grpc.aio.insecure_channel(target)
    http = urllib.parse.urlsplit(http_url) if api == "openai" else None
    info_stub = pb_grpc.InferenceStub(channel)
    info = await info_stub.GetModelInfo(pb.GetModelInfoRequest())
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, info.vocab_size) for _ in range(input_len)]
               for _ in range(num_prompts)]
    gate = asyncio.Semaphore(max_concurrency or num_prompts)

    async def limited(prompt):
        async with gate:
            if http is not None:
                return await _one_http(http.hostname, http.port or 80, prompt, output_len)
            return await _one(channel, api, prompt, output_len)

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    status = await info_stub.GetServerStatus(pb.GetServerStatusRequest())
    await channel.close()

    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft for r in ok]) * 1e3
    tpot = np.array([r.tpot for r in ok if not math.isnan(r.tpot)]) * 1e3
    stats = lambda a: {"mean": float(np.mean(a)), "median": float(np.median(a)),  # noqa: E731
                       "p99": float(np.percentile(a, 99))} if len(a) else {}
    return {
        "date": datetime.date.today().isoformat(), "target": target, "api": api,
        "model": info.model, "num_prompts": num_prompts, "input_len": input_len,
        "output_len": output_len, "request_rate": request_rate,
        "max_concurrency": max_concurrency, "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if not r.ok}),
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
        "ttft_ms": stats(ttft), "tpot_ms": stats(tpot),
        "server_mean_step_ms": status.mean_step_ms,
        "server_mean_step_gap_ms": status.mean_step_gap_ms,
        "server_steps": status.steps, "server_overlapped_steps": status.overlapped_steps,
    }


def print_table(r: dict) -> None:
    rate = "all at once" if not math.isfinite(r["request_rate"]) else f"{r['request_rate']:g} req/s"
    rows = [
        ("setup", f"{r['api']} API, {r['num_prompts']} requests, {r['input_len']} in / "
                  f"{r['output_len']} out, {rate}"),
        ("completed / failed", f"{r['completed']} / {r['failed']}"),
        ("duration", f"{r['duration_s']:.2f} s"),
        ("request throughput", f"{r['request_throughput']:.2f} req/s"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
    ]
    for key in ("ttft_ms", "tpot_ms"):
        s = r[key]
        if s:
            rows.append((key.replace("_ms", "").upper() + " mean / median / p99",
                         f"{s['mean']:.1f} / {s['median']:.1f} / {s['p99']:.1f} ms"))
    rows += [("engine step (mean)", f"{r['server_mean_step_ms']:.1f} ms"),
             ("gap between steps (mean)", f"{r['server_mean_step_gap_ms']:.2f} ms"),
             ("steps queued behind a running step", f"{r['server_overlapped_steps']} of "
                                                    f"{r['server_steps']} (since server start)")]
    width = max(len(k) for k, _ in rows)
    print(f"| {'metric'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")
    if r["errors"]:
        print("errors:", "; ".join(r["errors"]))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--api", choices=["jaxserve", "jetstream", "openai"], default="jaxserve",
                   help="jaxserve / jetstream: gRPC at --target; openai: HTTP at --http-url")
    p.add_argument("--http-url", default="http://127.0.0.1:8000",
                   help="the OpenAI API's base URL (--api openai)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in req/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args.target, args.api, args.num_prompts, args.input_len,
                             args.output_len, args.request_rate, args.max_concurrency, args.seed,
                             args.http_url))
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["completed"] else 1
