"""What the OpenAI-compatible HTTP layer costs: one `jaxserve serve` process, the same
serving workload over its gRPC API and over HTTP (streaming /v1/completions), in turns.

    python benchmarks/http_vs_grpc.py [--concurrency 64] [--rounds 2] [--model DIR --offline]

The server runs smollm2-135m's shape with random weights (bf16 where the CPU has
AVX512_BF16, else f32), or the checkpoint `--model`; every request is a random
`--input-len` token prompt with `--output-len` tokens out (ignore_eos), `--concurrency` in
flight at once. Each round runs gRPC then HTTP; the table reports each run and the
HTTP/gRPC ratio of output tokens/s over all rounds. The client runs on the same machine as
the server, so both front doors pay for their client too. `--offline` first runs the same
requests through the offline `LLM` (same engine settings, all submitted at once), the
ceiling the servers are compared with. Each run also reports the CPU cores (CPU seconds
per second, Linux /proc) the server's process, its engine process and the client used.

The host-loop check (issue 54): the tiny model of benchmarks/host_overhead.py, 256 streams:

    python benchmarks/http_vs_grpc.py --model "$(python -c 'import sys; sys.path.insert(0,
        "benchmarks"); import peers; print(peers.checkpoint("configs/models/tiny-llama.yaml",
        dtype="float32"))')" --dtype float32 --concurrency 256 --num-prompts 256 \
        --input-len 16 --output-len 128 --offline [--stream-interval 16] [--engine-thread]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.bench import run  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads) so far; None without /proc."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_child(pid: int) -> int | None:
    """The server's engine process (a multiprocessing spawn child), if it has one."""
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in open(f"/proc/{pid}/task/{task}/children").read().split():
                if b"spawn_main" in open(f"/proc/{child}/cmdline", "rb").read():
                    return int(child)
    except OSError:
        pass
    return None


def has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def start_server(args, grpc_port: int, http_port: int, log) -> subprocess.Popen:
    model = (["--model", args.model] if args.model else
             ["--random-weights", str(ROOT / "configs/models/smollm2-135m.yaml")])
    cmd = [sys.executable, "-m", "jaxserve", "serve", *model, "--dtype", args.dtype,
           "--max-num-seqs", str(args.concurrency), "--max-model-len", "512",
           "--max-num-batched-tokens", "512", "--page-size", "16",
           "--port", str(grpc_port), "--http-port", str(http_port),
           "--stream-interval", str(args.stream_interval),
           *(["--engine-thread"] if args.engine_thread else [])]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16" if has_avx512_bf16() else "float32")
    ap.add_argument("--model", help="a checkpoint directory to serve (default: random "
                    "weights of smollm2-135m's shape)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the server's --stream-interval (tokens a message holds at least)")
    ap.add_argument("--engine-thread", action="store_true",
                    help="the server's engine on a thread of its process (default: a process "
                         "of its own)")
    ap.add_argument("--offline", action="store_true",
                    help="also run the requests through the offline LLM (needs --model)")
    args = ap.parse_args()
    offline = offline_tokens_per_s(args) if args.offline else None

    grpc_port, http_port = free_port(), free_port()
    target, url = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        proc = start_server(args, grpc_port, http_port, log)
    try:
        wait_ready(url, proc)

        who = {"server": proc.pid, "engine": engine_child(proc.pid), "client": os.getpid()}

        def bench(api: str) -> dict:
            """One run, with the CPU cores each process used meanwhile (CPU s per s)."""
            before = {k: cpu_seconds(pid) if pid else None for k, pid in who.items()}
            start = time.perf_counter()
            result = asyncio.run(run(target, api, args.num_prompts, args.input_len,
                                     args.output_len, float("inf"), args.concurrency,
                                     seed=0, http_url=url))
            elapsed = time.perf_counter() - start
            result["cores"] = {k: (cpu_seconds(pid) - before[k]) / elapsed
                               if before[k] is not None else None for k, pid in who.items()}
            return result

        bench("jaxserve")  # warm both paths once before timing
        bench("openai")
        runs = []
        for r in range(args.rounds):
            for api in ("jaxserve", "openai"):
                result = bench(api)
                assert result["failed"] == 0, result["errors"]
                runs.append((r + 1, api, result))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    print(f"{datetime.date.today().isoformat()}, {cpu_name()}, {os.cpu_count()} cores, "
          f"{args.dtype}, {args.concurrency} concurrent streams, {args.num_prompts} requests "
          f"of {args.input_len} in / {args.output_len} out, --stream-interval "
          f"{args.stream_interval}, the engine "
          f"{'on a thread' if args.engine_thread else 'in a process of its own'}\n")
    print("| round | API | output tok/s | TTFT median ms | TPOT median ms | CPU cores: server "
          "/ engine / client |")
    print("|---|---|---|---|---|---|")
    for r, api, res in runs:
        name = "gRPC (jaxserve.v1)" if api == "jaxserve" else "HTTP (OpenAI, SSE)"
        cores = " / ".join("-" if c is None else f"{c:.2f}" for c in res["cores"].values())
        print(f"| {r} | {name} | {res['output_tokens_per_s']:.1f} | "
              f"{res['ttft_ms']['median']:.1f} | {res['tpot_ms']['median']:.1f} | {cores} |")
    total = {api: sum(res["output_tokens"] for _, a, res in runs if a == api)
             / sum(res["duration_s"] for _, a, res in runs if a == api)
             for api in ("jaxserve", "openai")}
    ratio = total["openai"] / total["jaxserve"]
    print(f"\nHTTP / gRPC output tokens/s over all rounds: {ratio:.3f} "
          f"(the HTTP layer costs {100 * (1 - ratio):.1f}%; target: under 5%)")
    if offline is not None:
        print(f"offline LLM: {offline:.1f} output tok/s; gRPC {total['jaxserve'] / offline:.3f} "
              f"and HTTP {total['openai'] / offline:.3f} of it")


def offline_tokens_per_s(args) -> float:
    """The same requests through the offline LLM in a process of its own (the best of
    `--rounds` runs), with the server's engine settings."""
    if not args.model:
        raise SystemExit("--offline needs --model")
    code = f"""
import random, time
from jaxserve import LLM, SamplingParams
llm = LLM({args.model!r}, dtype={args.dtype!r}, max_num_seqs={args.concurrency},
          max_model_len=512, max_num_batched_tokens=512, page_size=16)
vocab = llm.engine.model_config.vocab_size
rng = random.Random(0)
prompts = [[rng.randrange(3, vocab) for _ in range({args.input_len})]
           for _ in range({args.num_prompts})]
params = SamplingParams(temperature=0.0, max_tokens={args.output_len}, ignore_eos=True)
llm.generate(prompts[:8], params)
best = 0.0
for _ in range({args.rounds}):
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    best = max(best, sum(len(o.outputs[0].token_ids) for o in outs)
               / (time.perf_counter() - start))
print("OFFLINE", best)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
    return float(out.stdout.split("OFFLINE")[-1])


if __name__ == "__main__":
    main()
