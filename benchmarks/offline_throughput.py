"""Offline throughput of the engine against this machine's ceilings and against peers.

One random-weight checkpoint of a model preset's shape (default smollm2-135m; written once
by benchmarks/peers.py as an ordinary Hugging Face directory: bf16 safetensors and a
tokenizer) is loaded by jaxserve and by every peer. Greedy, ignore_eos:
  (a) 1 request, 32-token prompt, 256 new tokens: ms per output token; TTFT, the median
      of three 1-token requests on that prompt after a warm-up request (whose own TTFT,
      the engine's first request, is reported too);
  (b) 64 requests, 128-token prompts, 128 new tokens each: output tokens/s.
The engine runs as configs/engine/cpu.yaml has it: up to 8 decode steps per program while
every request decodes (--num-scheduler-steps; 1 for one step per program).
The run is --rounds rounds (default 3), one after the other, each: transformers, then
jaxserve's (b), then its (a), then llama.cpp and vLLM. This VM's speed drifts by 10-20%
within minutes (batch-1 decode 6.6 to 9.9 ms per token in one hour), so a single pass
compared systems measured minutes apart; in a round each comparison a target rests on is
between runs seconds apart ((b) against transformers, (a) against llama.cpp), each ratio
is computed within its round, and the table gives the median over the rounds with every
round's value after it.
Ceilings: memory bandwidth (a jitted reduction over 1 GiB, read in each round before and
after (a); the larger reading) gives the floor on batch-1 decode time (weights read once
per token); matmul rate (once, at the start: a square matmul, the faster of XLA's dot and
the engine's own matmul) gives the floors on compute time, of (b) and of (a)'s TTFT.
Beside each bandwidth probe, where the VM's two vCPUs sat (`vcpu_placement`): the round
trip of a cache line between two threads (pallas_kernels.cpu.round_trip_ns) and two
threads' floating-point rate over one's (pair_flops_ratio). On the 2-core Zen 4 EPYC VM
the placement changes every few seconds under load, between three: SMT, one core's two
threads (ratio ~1.0, 58-63 ns: compute-bound work gets one core's rate, the TTFT up to
1.6x slower); L3, two cores of one L3 (ratio ~1.9, 85-125 ns); CCDs, two cores on two of
the host's CCDs (ratio ~1.9, 300-400 ns: memory reads 46-55 GB/s instead of 28-35, the
decode faster, the TTFT slower).
Peers, on the same checkpoint and dtype (benchmarks/peers.py): transformers `generate`
(all 64 prompts of (b) in one static batch), llama.cpp's llama-batched-bench (built from
the llama-cpp-python sdist, on a GGUF conversion of the checkpoint) and vLLM's CPU build
(in a virtualenv of its own). Their first run builds and installs them (minutes; cached
under $JAXSERVE_CACHE/peers). A peer that is skipped or cannot run is reported as such.
Also timed, once after the rounds: `jaxserve serve` with these engine settings, from
launch to health SERVING, with an empty compilation cache and again with the one the
first start filled (warm restart). At the end the script prints issue 17's targets
against the medians. Like the `jaxserve` command, the script first restarts itself with
glibc's malloc asking for transparent huge pages (jaxserve/huge_pages.py); the peers
inherit that environment.

    python benchmarks/offline_throughput.py [--preset configs/models/smollm2-135m.yaml]
        [--dtype float32|bfloat16] [--skip-hf] [--skip-llamacpp] [--skip-vllm]
        [--skip-restarts] [--sync] [--num-scheduler-steps N] [--rounds N] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

# This tree's code, not whichever tree the virtualenv installed (a worktree of the code
# before runs its own; kernel_speed.py imports this first).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import peers  # noqa: E402
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import Engine
from jaxserve.huge_pages import THP_MODE, restart_with_huge_pages
from jaxserve.sampling_params import SamplingParams
from pallas_kernels import cpu as native
from pallas_kernels.matmul import default_impl as matmul_impl
from pallas_kernels.matmul import matmul, packed

# (name, flag that skips it, function of benchmarks/peers.py)
PEERS = [("transformers", "--skip-hf", peers.run_hf),
         ("llama.cpp", "--skip-llamacpp", peers.run_llamacpp),
         ("vLLM", "--skip-vllm", peers.run_vllm)]
PEERS_BEFORE = ("transformers",)  # run before jaxserve in each round; the others after


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s read by a jitted sum over a large float32 array (best of `repeats`); on an
    accelerator the larger of that and a jitted copy's bytes read plus written (XLA's sum
    reads an H100's memory at ~1.9 TB/s, a copy moves ~3 TB/s: the copy is the ceiling)."""
    n = int(gib * 2**30 / 4)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = n * 4 / min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
    if jax.default_backend() != "cpu":
        copy = jax.jit(lambda a: a + 1)
        copy(x).block_until_ready()
        best = max(best, 2 * n * 4 / min(_timed(lambda: copy(x).block_until_ready())
                                         for _ in range(repeats)))
    return best


def measure_matmul(dtype, n: int = 2048, repeats: int = 5) -> tuple[float, str]:
    """FLOP/s of an n x n matmul in `dtype` (best of `repeats`), the faster of XLA's jitted
    dot and, on a CPU with the native kernels, the engine's own matmul (its [N, K] weight,
    packed where the engine packs it); and both rates, for the table. XLA:CPU's bf16 dot
    runs at about 40% of an AVX512_BF16 CPU's peak, and the engine's prefill ran faster
    than that "floor"."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    candidates = {"XLA's dot": (jax.jit(lambda x, w: x @ w), a)}
    if matmul_impl() == "cpu":  # the engine's [N, K] weights, packed where it packs them
        pack = packed.worth_packing(dtype) and packed.packable(n, n, dtype)
        candidates["the engine's matmul"] = (
            jax.jit(lambda x, w: matmul(x, w, transpose_w=True, packed_w=pack)),
            packed.pack(a) if pack else a)
    rates = {}
    for name, (f, w) in candidates.items():
        f(a, w).block_until_ready()
        rates[name] = 2 * n**3 / min(_timed(lambda: f(a, w).block_until_ready())
                                     for _ in range(repeats))
    best = max(rates, key=rates.get)
    return rates[best], ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in rates.items())


def huge_page_mode() -> str:
    """The kernel's transparent huge page mode, as /sys shows it (or why not)."""
    try:
        return THP_MODE.read_text().strip()
    except OSError:
        return "unknown"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    first: dict[str, float] = {}
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now - start)
            produced += len(out.new_token_ids)
    total = time.perf_counter() - start
    ttft = float(np.mean(list(first.values())))
    return {"total_s": total, "ttft_s": ttft, "output_tokens": produced,
            "tokens_per_s": produced / total,
            "tpot_ms": 1e3 * (total - max(first.values())) / max(new_tokens - 1, 1)}


def measure_restarts(engine_cfg: EngineConfig) -> tuple[float, float]:
    """Seconds from `jaxserve serve` (these engine settings) to health SERVING, with an
    empty compilation cache and again with the cache the first start filled."""
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "engine.yaml"
        settings = {k: v for k, v in dataclasses.asdict(engine_cfg).items() if v is not None}
        settings["token_buckets"] = list(settings["token_buckets"])
        config.write_text(yaml.safe_dump({**settings, "compilation_cache_dir": tmp}))
        for _ in range(2):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            start = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxserve", "serve", "--config", str(config),
                 "--port", str(port), "--no-http"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # Retry the connection every 50 ms: gRPC's default backoff (1 s, growing) would
            # add up to a second between SERVING and the check that sees it.
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 50)])
            health = health_pb2_grpc.HealthStub(channel)
            try:
                while proc.poll() is None:
                    try:
                        if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status \
                                == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    time.sleep(0.05)
                times.append(time.perf_counter() - start)
            finally:
                channel.close()
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    return times[0], times[1]


def run_peers(args, model_dir, workloads: peers.Workloads, names: tuple[str, ...],
              skip: dict[str, str]) -> dict[str, tuple[dict | None, str | None]]:
    """name -> (result, None) or (None, why not), for the peers in `names`; a peer named
    in `skip` (name -> why) is not run."""
    results = {}
    for name, flag, run in PEERS:
        if name not in names:
            continue
        if getattr(args, flag.removeprefix("--").replace("-", "_")):
            results[name] = (None, f"skipped ({flag})")
        elif name in skip:
            results[name] = (None, skip[name])
        else:
            start = time.perf_counter()
            results[name] = run(model_dir, args.dtype, workloads)
            print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    return results


def vcpu_placement() -> dict:
    """Where the two vCPUs sit now: the round trip, the pair's floating-point rate over
    one thread's, and a label: 'SMT' (rate ratio under 1.4: one core's two threads), 'L3'
    (two cores, round trip under 200 ns) or 'CCDs' (two cores farther apart); None values
    and 'n/a' without the native kernels."""
    ns, pair = native.round_trip_ns(), native.pair_flops_ratio()
    label = ("n/a" if ns is None or pair is None else
             "SMT" if pair < 1.4 else "L3" if ns < 200 else "CCDs")
    return {"round_trip_ns": ns, "pair_flops_ratio": pair, "label": label}


def placement_text(p: dict) -> str:
    return p["label"] if p["round_trip_ns"] is None else (
        f"{p['label']} ({p['round_trip_ns']:.0f} ns, {p['pair_flops_ratio']:.2f}x)")


def run_round(engine: Engine, prompt_a: list[int], prompts_b: list[list[int]]) -> dict:
    """jaxserve's part of one round: (b), then (a) between two bandwidth probes."""
    steps, overlapped = engine.num_steps, engine.num_overlapped_steps
    b = run_engine(engine, prompts_b, 128)
    b_steps, b_overlapped = engine.num_steps - steps, engine.num_overlapped_steps - overlapped
    placement_before = vcpu_placement()
    bandwidth_before = measure_bandwidth()
    # TTFT as the peers measure it (each warms up first; vLLM takes the median of three).
    ttft = statistics.median(run_engine(engine, [prompt_a], 1)["ttft_s"] for _ in range(3))
    a = run_engine(engine, [prompt_a], 256)
    a["ttft_s"] = ttft
    # This VM's bandwidth drifts (it read 45 and 80 GB/s minutes apart on a Zen 5 EPYC):
    # probe it again right after (a)'s decode, and take the larger reading as the floor's.
    bandwidths = (bandwidth_before, measure_bandwidth())
    return {"a": a, "b": b, "bandwidths": bandwidths, "bandwidth": max(bandwidths),
            "placements": (placement_before, vcpu_placement()),
            "b_steps": b_steps, "b_overlapped": b_overlapped}


# Per-round ratios, each within its round: the table and the targets read the same ones.
def floor_ratios(rounds: list[dict]) -> list[float]:
    return [r["a"]["tpot_ms"] / r["decode_floor_ms"] for r in rounds]


def ttft_ratios(rounds: list[dict]) -> list[float]:
    return [r["a"]["ttft_s"] * 1e3 / r["a"]["tpot_ms"] for r in rounds]


def decode_speedups(runs: list[dict], rounds: list[dict]) -> list[float]:
    """jaxserve's batch-1 decode speed over a peer's (>1: faster)."""
    return [p["ms_per_token"] / r["a"]["tpot_ms"] for p, r in zip(runs, rounds)]


def throughput_ratios(runs: list[dict], rounds: list[dict]) -> list[float]:
    """jaxserve's (b) tokens/s over a peer's."""
    return [r["b"]["tokens_per_s"] / p["tokens_per_s"] for p, r in zip(runs, rounds)]


def spread(values: list[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """The median of per-round values, then each round's value: '1.25x (1.22 / 1.25 / 1.31)'."""
    med = fmt.format(statistics.median(values)) + unit
    return med if len(values) == 1 else f"{med} ({' / '.join(fmt.format(v) for v in values)})"


def peer_rows(name: str, runs: list[dict], reason: str | None, rounds: list[dict]
              ) -> list[tuple[str, str]]:
    """The rows of one peer: its numbers, and jaxserve's speed relative to them (>1: faster),
    each ratio within its round."""
    if not runs:
        return [(name, reason if reason.startswith("skipped") else f"not run: {reason}")]
    first = runs[0]
    col = lambda key: [p[key] for p in runs]  # noqa: E731
    floors = [r["decode_floor_ms"] for r in rounds]
    return [
        (name, f"{first['version']}; {first['flags']}; setup {first['setup_s']:.0f} s, "
               f"run {spread(col('run_s'), '{:.0f}', ' s')}"),
        (f"(a) {name} TTFT", spread(col("ttft_ms"), "{:.1f}", " ms")),
        (f"(a) {name} ms per output token",
         spread(col("ms_per_token"), unit=" ms") + "; "
         + spread([p["ms_per_token"] / f for p, f in zip(runs, floors)], unit="x floor")
         + (f"; {first['note_a']} (round 1)" if "note_a" in first else "")),
        (f"(a) jaxserve / {name} decode speed", spread(decode_speedups(runs, rounds), unit="x")),
        (f"(a) jaxserve / {name} TTFT speed",
         spread([p["ttft_ms"] / (r["a"]["ttft_s"] * 1e3) for p, r in zip(runs, rounds)], unit="x")),
        (f"(b) {name}", spread(col("total_s"), unit=" s") + ", "
                        + spread(col("tokens_per_s"), "{:.1f}", " tokens/s")),
        (f"(b) jaxserve / {name} throughput", spread(throughput_ratios(runs, rounds), unit="x")),
    ]


def target_lines(rounds: list[dict], peer_runs: dict[str, list[dict]],
                 restarts: tuple[float, float] | None) -> list[str]:
    """Issue 17's targets against the medians of the per-round ratios."""
    lines = []

    def check(what: str, ratios, ok, unit: str = "x") -> None:
        value = statistics.median(ratios)
        lines.append(f"- {what}: {value:.2f}{unit} {'MET' if ok(value) else 'MISSED'}")

    check("(a) decode <= 1.3x the bandwidth floor", floor_ratios(rounds), lambda v: v <= 1.3)
    check("(a) TTFT <= 3x one decode step", ttft_ratios(rounds), lambda v: v <= 3.0)
    if peer_runs["llama.cpp"]:
        check("(a) decode faster than llama.cpp (its time / ours)",
              decode_speedups(peer_runs["llama.cpp"], rounds), lambda v: v > 1.0)
    for name, need in (("transformers", 2.0), ("llama.cpp", 1.0)):
        if peer_runs[name]:
            check(f"(b) tokens/s >= {need:g}x {name}", throughput_ratios(peer_runs[name], rounds),
                  lambda v, need=need: v >= need)
    if restarts is not None:
        check("warm restart < 10 s", [restarts[1]], lambda v: v < 10.0, " s")
    return lines


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="configs/models/smollm2-135m.yaml")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-hf", action="store_true", help="no transformers peer")
    ap.add_argument("--skip-llamacpp", action="store_true", help="no llama.cpp peer")
    ap.add_argument("--skip-vllm", action="store_true", help="no vLLM peer")
    ap.add_argument("--skip-restarts", action="store_true",
                    help="do not time `jaxserve serve` starting cold and warm")
    ap.add_argument("--sync", action="store_true",
                    help="no async scheduling: the host waits for each step's tokens before "
                         "building the next batch")
    ap.add_argument("--num-scheduler-steps", type=int, default=8,
                    help="decode steps per program while every request decodes (as "
                         "configs/engine/cpu.yaml; 1: one step per program)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every system in turn (transformers, jaxserve, llama.cpp, "
                         "vLLM); the table gives medians of the per-round values")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


@dataclasses.dataclass
class Run:
    """Everything one run of the benchmark measured (the table reads it)."""

    cfg: ModelConfig
    model_dir: Path
    load_avg: float
    warmup_s: float
    num_compiled: int
    flops: float
    flops_by: str
    weight_bytes: int
    first_ttft: float
    rounds: list[dict]
    peer_runs: dict[str, list[dict]]
    reasons: dict[str, str]
    restarts: tuple[float, float] | None
    b_floor_s: float
    ttft_floor_ms: float


def measure(args: argparse.Namespace) -> Run:
    """Warm the engine up, then run the rounds (every peer and jaxserve's (a) and (b)),
    then the restarts, and the floors at the measured rates."""
    model_dir = peers.checkpoint(args.preset)
    cfg = ModelConfig.from_file(model_dir)
    engine_cfg = EngineConfig(model=str(model_dir), dtype=args.dtype, max_model_len=512,
                              page_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                              token_buckets=(1, 64, 512), enable_prefix_caching=False,
                              async_scheduling=not args.sync,
                              num_scheduler_steps=args.num_scheduler_steps)
    t0 = time.perf_counter()
    engine = Engine.from_config(engine_cfg)
    engine.warmup()
    warmup_s = time.perf_counter() - t0

    flops, flops_by = measure_matmul(jnp.float32 if args.dtype == "float32" else jnp.bfloat16)
    # Per decoded token every weight is read once, except that only one embedding row is
    # gathered (with tied embeddings the lm_head reads the whole table anyway).
    matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    weight_bytes = matmul_params * jnp.dtype(args.dtype).itemsize

    load_avg = os.getloadavg()[0]  # other work on the machine skews every number below
    rng = np.random.default_rng(0)
    prompt_a = rng.integers(0, cfg.vocab_size, 32).tolist()
    # The engine's first request is a warm-up of its own, reported apart.
    first_ttft = run_engine(engine, [rng.integers(0, cfg.vocab_size, 32).tolist()], 8)["ttft_s"]
    prompts_b = [rng.integers(0, cfg.vocab_size, 128).tolist() for _ in range(64)]
    workloads = peers.Workloads(prompt_a, prompts_b, 256, 128)
    rounds: list[dict] = []
    peer_runs: dict[str, list[dict]] = {name: [] for name, _, _ in PEERS}
    reasons: dict[str, str] = {}

    def peers_now(names: tuple[str, ...]) -> None:
        # A peer that failed or was skipped is not tried again in later rounds, and its
        # earlier rounds are dropped (every ratio pairs a peer's run with jaxserve's round).
        for name, (result, reason) in run_peers(args, model_dir, workloads, names, reasons).items():
            if result is None:
                reasons[name] = reason
                peer_runs[name] = []
            else:
                peer_runs[name].append(result)

    for r in range(args.rounds):
        # transformers (whose (b) the throughput target is 2x) runs right before jaxserve's
        # (b), llama.cpp (whose batch-1 decode the target is to beat) right after its (a).
        peers_now(PEERS_BEFORE)
        start = time.perf_counter()
        rounds.append(run_round(engine, prompt_a, prompts_b))
        rounds[-1]["decode_floor_ms"] = 1e3 * weight_bytes / rounds[-1]["bandwidth"]
        print(f"round {r + 1}/{args.rounds}, jaxserve: {time.perf_counter() - start:.0f} s", flush=True)
        peers_now(tuple(name for name, _, _ in PEERS if name not in PEERS_BEFORE))
    assert engine.runner.compiles_after_warmup == 0
    num_compiled = engine.runner.num_compiled
    del engine  # its KV cache and weights, before `jaxserve serve` starts beside this process
    restarts = None if args.skip_restarts else measure_restarts(engine_cfg)

    # Compute floor for (b): 2 FLOPs per weight per token, prefill + decode (attention
    # adds < 5% at these lengths and is left out, which makes the floor lower, not higher).
    b_floor_s = 2 * matmul_params * 64 * (128 + 128) / flops
    # Compute floor for (a)'s TTFT: every prompt token through the layers, the LM head on
    # the last one only. Against one decode step it says whether "TTFT <= 3x a step" is
    # reachable at this machine's matmul rate.
    head_params = cfg.vocab_size * cfg.hidden_size
    ttft_floor_ms = 1e3 * 2 * ((matmul_params - head_params) * len(prompt_a) + head_params) / flops
    return Run(cfg, model_dir, load_avg, warmup_s, num_compiled, flops, flops_by, weight_bytes,
               first_ttft, rounds, peer_runs, reasons, restarts, b_floor_s, ttft_floor_ms)


def table_rows(args: argparse.Namespace, m: Run) -> list[tuple[str, str]]:
    rounds, cfg = m.rounds, m.cfg
    a_col = lambda key, scale=1.0: [r["a"][key] * scale for r in rounds]  # noqa: E731
    b_col = lambda key: [r["b"][key] for r in rounds]  # noqa: E731
    rows = [
        ("machine", f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, {jax.devices()[0].platform}, load average {m.load_avg:.1f} at start"),
        ("model", f"{os.path.basename(args.preset)} shape, random weights, {cfg.num_params() / 1e6:.1f}M params, {args.dtype}"),
        ("checkpoint (all systems)", str(m.model_dir)),
        ("memory (all systems)", f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r} "
                                 f"(huge pages: {huge_page_mode()})"),
        ("warm-up (load + compile all buckets)", f"{m.warmup_s:.1f} s, {m.num_compiled} programs"),
        ("decode steps per program (num_scheduler_steps)", str(args.num_scheduler_steps)),
        ("rounds (transformers, jaxserve (b), (a), llama.cpp, vLLM)",
         f"{args.rounds}: medians, then each round's value"),
        ("measured memory bandwidth", spread([r["bandwidth"] / 1e9 for r in rounds], "{:.1f}", " GB/s")
         + " (the larger of the probes before and after (a))"),
        ("vCPU placement before / after (a) (round trip, 2 threads' FP rate / 1's)",
         " | ".join(" / ".join(map(placement_text, r["placements"])) for r in rounds)
         + " by round"),
        ("measured matmul rate", f"{m.flops / 1e9:.1f} GFLOP/s ({args.dtype}; the faster of "
                                 f"{m.flops_by} GFLOP/s)"),
        ("(a) TTFT (median of 3 per round)", spread(a_col("ttft_s", 1e3), "{:.1f}", " ms")),
        ("(a) TTFT / one decode step", spread(ttft_ratios(rounds), unit="x")),
        ("(a) TTFT compute floor", f"{m.ttft_floor_ms:.1f} ms at the measured matmul rate; TTFT "
         + spread([r["a"]["ttft_s"] * 1e3 / m.ttft_floor_ms for r in rounds], unit="x") + " it"),
        ("(a) TTFT of the first request after warm-up", f"{m.first_ttft * 1e3:.1f} ms"),
        ("(a) ms per output token", spread(a_col("tpot_ms"), unit=" ms")),
        ("(a) bandwidth floor per token", spread([r["decode_floor_ms"] for r in rounds], unit=" ms")
         + f" ({m.weight_bytes / 1e6:.0f} MB of weights)"),
        ("(a) ratio to floor", spread(floor_ratios(rounds), unit="x")),
        ("(a) output tokens/s", spread(a_col("tokens_per_s"), "{:.1f}")),
        ("(b) mean TTFT", spread(b_col("ttft_s"), unit=" s")),
        ("(b) total time", spread(b_col("total_s"), unit=" s")),
        ("(b) output tokens/s", spread(b_col("tokens_per_s"), "{:.1f}")),
        ("(b) compute floor", f"{m.b_floor_s:.2f} s, ratio "
         + spread([t / m.b_floor_s for t in b_col("total_s")], unit="x")),
        ("(b) steps queued behind a running step",
         " / ".join(f"{r['b_overlapped']} of {r['b_steps']}" for r in rounds)
         + (" (--sync)" if args.sync else "")),
    ]
    if m.restarts is not None:
        rows.append(("`jaxserve serve` to SERVING, cold / warm cache",
                     f"{m.restarts[0]:.1f} s / {m.restarts[1]:.1f} s"))
    for name, _, _ in PEERS:
        rows += peer_rows(name, m.peer_runs[name], m.reasons.get(name), rounds)
    return rows


def main() -> None:
    args = parse_args()
    # Malloc on transparent huge pages, as under the `jaxserve` command (restarts this
    # process once; jaxserve/huge_pages.py). The peers, started from here, inherit it.
    restart_with_huge_pages()
    m = measure(args)
    rows = table_rows(args, m)
    width = max(len(k) for k, _ in rows)
    print(f"\noffline throughput, {datetime.date.today().isoformat()}")
    print(f"| {'metric'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")
    print(f"\nissue 17's targets ({args.dtype}; medians of the per-round ratios):")
    print("\n".join(target_lines(m.rounds, m.peer_runs, m.restarts)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": m.rounds, "first_request_ttft_s": m.first_ttft,
                       "peers": {k: {"runs": v, "reason": m.reasons.get(k)}
                                 for k, v in m.peer_runs.items()},
                       "flops": m.flops, "b_floor_s": m.b_floor_s,
                       "ttft_floor_ms": m.ttft_floor_ms, "restarts_s": m.restarts}, f, indent=2)

if __name__ == "__main__":
    main()
