"""Soak test: one `jaxserve serve` (the demo model) under `--concurrency` clients for
`--duration` seconds, each doing one thing after another, drawn at random: a normal gRPC
stream (some with stop strings), a gRPC stream cancelled midway, one with a short deadline,
a bad gRPC request from the catalogue (docs/serving.md, invalid UTF-8 on the wire among
them), a normal HTTP stream, an HTTP client that drops midway, a bad HTTP request. Every
answer must be right or a documented status.

    python benchmarks/soak.py [--duration 600] [--concurrency 1000]

At the end: running, waiting and KV pages in use must be back to 0, and the server's RSS
within 10% of what it was after the first minute. Prints a table of outcomes per kind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from http_vs_grpc import cpu_name, free_port, wait_ready  # noqa: E402

from server.client import AsyncClient, Client, make_request  # noqa: E402

Code = grpc.StatusCode
BAD_GRPC = [  # (sampling, prompt) -> INVALID_ARGUMENT
    (dict(temperature=-1.0), [5, 6, 7]), (dict(temperature=float("inf")), [5, 6, 7]),
    (dict(top_p=1.5), [5, 6, 7]), (dict(max_tokens=10**6), [5, 6, 7]),
    (dict(), [5, 10**7]), (dict(), []), (dict(), "x" * 200_000),
    (dict(), "QQ"),  # sent with "QQ" replaced by bytes that are not UTF-8
]
BAD_HTTP = [b'{"prompt": "x", "temperature": -1}', b'{"prompt": []}', b"{not json",
            b'{"prompt": "x", "n": 0}', b'{"messages": "hi"}', b'{"prompt": "\xff\xfe"}']


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    def __init__(self, target: str, http_port: int, vocab: int):
        self.target, self.http_port, self.vocab = target, http_port, vocab
        self.outcomes: collections.Counter = collections.Counter()
        self.unexpected: list[str] = []  # the first 20
        self.num_unexpected = 0
        self.rng = random.Random(0)

    def record(self, kind: str, outcome: str, ok: bool) -> None:
        self.outcomes[(kind, outcome)] += 1
        if not ok:
            self.num_unexpected += 1
            if len(self.unexpected) < 20:
                self.unexpected.append(f"{kind}: {outcome}")

    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(1, 40))]

    async def grpc_stream(self, c: AsyncClient, kind: str) -> None:
        n = self.rng.randint(1, 32)
        cancel_after = self.rng.randint(1, n) if kind == "grpc cancel" else None
        timeout = self.rng.uniform(0.01, 0.5) if kind == "grpc deadline" else None
        stop = ["e", " t"] if kind == "grpc stop" else []
        got, text, done = 0, "", None
        try:
            async for msg in c.generate(self.prompt(), max_tokens=n, ignore_eos=True,
                                        timeout=timeout, stop=stop):
                if msg.HasField("chunk"):
                    got += len(msg.chunk.token_ids)
                    text += msg.chunk.text
                else:
                    done = msg.complete
                if cancel_after is not None and got >= cancel_after:
                    self.record(kind, "cancelled", True)
                    return  # leaving the iterator cancels the call
        except grpc.aio.AioRpcError as e:
            ok = e.code() in (Code.RESOURCE_EXHAUSTED,) or (
                kind == "grpc deadline" and e.code() == Code.DEADLINE_EXCEEDED)
            self.record(kind, e.code().name, ok)
            return
        if done is None or any(s in text for s in stop):
            right, outcome = False, f"wrong ({text!r}, {done})"
        elif done.finish_reason == "stop":  # a stop string ended it: no more tokens than n
            right, outcome = done.matched_stop in stop and got <= n, "stop"
        else:
            right, outcome = done.finish_reason == "length" and got == n, "OK"
        self.record(kind, outcome if right else f"wrong ({got}/{n}, {done})", right)

    async def grpc_bad(self, c: AsyncClient) -> None:
        sampling, prompt = self.rng.choice(BAD_GRPC)
        try:
            if prompt == "QQ":  # raw bytes out, raw bytes back
                data = make_request(prompt, **sampling).SerializeToString()
                call = c.channel.unary_stream("/jaxserve.v1.Inference/Generate")
                async for _ in call(data.replace(b"QQ", b"\xff\xfe")):
                    pass
            else:
                async for _ in c.generate(prompt, **sampling):
                    pass
        except grpc.aio.AioRpcError as e:
            self.record("grpc bad input", e.code().name, e.code() == Code.INVALID_ARGUMENT)
            return
        self.record("grpc bad input", "accepted", False)

    async def http(self, kind: str) -> None:
        if kind == "http bad input":
            body = self.rng.choice(BAD_HTTP)
        else:
            n = self.rng.randint(1, 32)
            body = json.dumps({"prompt": self.prompt(), "max_tokens": n, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}}
                              ).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.http_port)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % len(body) + body)
            status = int((await reader.readline()).split()[1])
            if kind == "http bad input":
                self.record(kind, str(status), status == 400)
                return
            if status != 200:
                self.record(kind, str(status), status == 429)
                return
            drop_after = self.rng.randint(1, 10) if kind == "http disconnect" else None
            events = []
            while line := await reader.readline():
                if line.startswith(b"data: "):
                    events.append(line)
                    if drop_after is not None and len(events) >= drop_after:
                        self.record(kind, "dropped", True)
                        return
            right = (len(events) >= 2 and events[-1].startswith(b"data: [DONE]")
                     and json.loads(events[-2][6:])["usage"]["completion_tokens"] == n)
            self.record(kind, "200" if right else f"200, wrong: {events[-2:]!r}"[:160], right)
        finally:
            writer.close()

    async def client(self, c: AsyncClient, deadline: float) -> None:
        kinds = ["grpc ok"] * 3 + ["grpc stop", "grpc cancel", "grpc deadline", "grpc bad input",
                                   "http ok", "http ok", "http disconnect", "http bad input"]
        while time.monotonic() < deadline:
            kind = self.rng.choice(kinds)
            try:
                if kind == "grpc bad input":
                    await self.grpc_bad(c)
                elif kind.startswith("grpc"):
                    await self.grpc_stream(c, kind)
                else:
                    await self.http(kind)
            except Exception as e:  # noqa: BLE001 - counted, not fatal
                self.record(kind, f"client error {type(e).__name__}: {e}", False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=1000)
    args = ap.parse_args()

    grpc_port, http_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve", "serve", "--config",
         str(ROOT / "configs/engine/cpu.yaml"), "--max-num-seqs", "64",
         "--max-num-batched-tokens", "512", "--max-waiting", "2000",
         "--port", str(grpc_port), "--http-port", str(http_port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        wait_ready(f"http://127.0.0.1:{http_port}", proc)
        target = f"127.0.0.1:{grpc_port}"
        sync = Client(target)
        soak = Soak(target, http_port, sync.info().vocab_size)

        async def run() -> tuple[float, float]:
            clients = [AsyncClient(target) for _ in range(8)]
            start = time.monotonic()
            deadline = start + args.duration
            tasks = [asyncio.create_task(soak.client(clients[i % 8], deadline))
                     for i in range(args.concurrency)]
            await asyncio.sleep(min(60.0, args.duration / 4))
            rss_start = rss_mib(proc.pid)
            await asyncio.gather(*tasks)
            for c in clients:
                await c.close()
            return rss_start, time.monotonic() - start

        rss_start, elapsed = asyncio.run(run())
        for _ in range(200):
            status = sync.status()
            if status.running_requests == 0 and status.waiting_requests == 0:
                break
            time.sleep(0.05)
        rss_end = rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=120)

    total = sum(soak.outcomes.values())
    print(f"{datetime.date.today().isoformat()}, {cpu_name()}, {os.cpu_count()} cores: "
          f"{args.concurrency} clients for {elapsed:.0f} s, {total} calls "
          f"({total / elapsed:.0f}/s)\n")
    print("| kind | outcome | count |\n|---|---|---|")
    for (kind, outcome), n in sorted(soak.outcomes.items()):
        print(f"| {kind} | {outcome} | {n} |")
    print(f"\nafter: {status.running_requests} running, {status.waiting_requests} waiting, "
          f"{status.kv_pages_used} KV pages in use; server RSS {rss_start:.0f} MiB after the "
          f"first minute, {rss_end:.0f} MiB at the end ({100 * (rss_end / rss_start - 1):+.1f}%)")
    print(f"unexpected answers: {soak.num_unexpected}"
          + (": " + "; ".join(soak.unexpected) if soak.unexpected else ""))
    bad = (soak.unexpected or status.running_requests or status.waiting_requests
           or status.kv_pages_used or rss_end > 1.1 * rss_start)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
