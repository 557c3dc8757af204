"""Prefill/decode disaggregation in one process: the decoding streams' time per output
token while long prompts keep arriving, one engine (colocated) against a prefill engine
on one device and a decode engine on another (engine/disaggregated.py), and the moved
K/V's bytes and time per transfer.

The model is SmolLM2-135M-shaped with random weights (benchmarks/peers.py's cached
checkpoint), float32, configs/engine/cpu.yaml's settings with one decode step per
program (so every token's time is its own) and no prefix cache. JAX gets two CPU
devices (XLA's host platform split in two): prefill on device 0, decode on device 1.
On a CPU both devices run on the same cores, so the disaggregated side's gain here is
only what no longer shares a step (a decoding stream never waits for a prompt's chunk in
its own step); on a TPU or GPU each side has chips of its own.

Workload per round: 4 streams of 96 new tokens start; every 3rd engine step a prompt of
768 tokens arrives (8 in all), each asking 8 new tokens. Reported per setup: the 4
streams' inter-token times (their first token excluded) p50 / p99 over the round, the
round's wall time; medians over --rounds with their spread. Transfer: one 768-token
prompt's pages (all layers, K and V) read out of the prefill cache, copied to the decode
device and ready there, timed alone (median of 10).

    python benchmarks/disaggregation.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this tree's code, not the installed one

from peers import checkpoint, spread  # noqa: E402

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.disaggregated import DisaggregatedEngine  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.engine.kv_transfer import Prefilled  # noqa: E402
from server.kv_transfer import KVPuller, KVSender  # noqa: E402

STREAMS, STREAM_TOKENS = 4, 96
LONG_PROMPTS, LONG_TOKENS, LONG_NEW, EVERY = 8, 768, 8, 3


def config(model: Path, **extra) -> EngineConfig:
    settings = yaml.safe_load((ROOT / "configs/engine/cpu.yaml").read_text())
    settings.update(num_scheduler_steps=1, enable_prefix_caching=False,
                    kv_cache_memory_gib=0.5)
    return EngineConfig(model=str(model), **{**settings, **extra})


def run_round(engine, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    stream = SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=0)
    long = SamplingParams(max_tokens=LONG_NEW, ignore_eos=True, temperature=0)
    for i in range(STREAMS):
        engine.add_request(f"s{seed}-{i}", rng.integers(3, vocab, 32).tolist(), stream)
    times: dict[str, list[float]] = {f"s{seed}-{i}": [] for i in range(STREAMS)}
    added, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        if added < LONG_PROMPTS and steps % EVERY == 0 and steps > 0:
            engine.add_request(f"l{seed}-{added}", rng.integers(3, vocab, LONG_TOKENS).tolist(),
                               long)
            added += 1
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outs:
            if out.request_id in times:
                times[out.request_id] += [now] * len(out.new_token_ids)
    wall = time.perf_counter() - start
    gaps = np.concatenate([np.diff(t[1:]) for t in times.values()]) * 1e3
    return {"tpot_p50_ms": float(np.percentile(gaps, 50)),
            "tpot_p99_ms": float(np.percentile(gaps, 99)), "wall_s": wall}


def transfer_time(engine: DisaggregatedEngine) -> dict:
    """One long prompt's pages: read out, copied to the decode device, ready there."""
    prefill, decode = engine.prefill, engine.decode
    n = -(-LONG_TOKENS // prefill.config.page_size)
    times, nbytes = [], 0
    for _ in range(11):
        t = time.perf_counter()
        kv = decode.runner.pages.placed(prefill.runner.read_pages(0, list(range(n)),
                                                                  LONG_TOKENS))
        jax.block_until_ready(kv.entries)
        times.append(time.perf_counter() - t)
        nbytes = kv.nbytes
    ms = statistics.median(times[1:]) * 1e3
    return {"bytes": nbytes, "ms": ms, "gb_per_s": nbytes / ms / 1e6,
            "pages_moved": kv.entries[0].shape[2], "pages_used": n}


def server_transfer_time(engine: DisaggregatedEngine, connector: str) -> dict:
    """The servers' paths for the same K/V (server/kv_transfer.py), on localhost: "grpc"
    reads them out, copies them to the host, streams them over gRPC and lands them in
    host arrays (the decode server then copies them to its device, not timed here);
    "jax" gathers them to one device and pulls them with jax.experimental.transfer onto
    the decode device (the header still over gRPC)."""
    prefill = engine.prefill
    n = -(-LONG_TOKENS // prefill.config.page_size)
    sender = KVSender("127.0.0.1", 0, None, 60.0, 4 << 20, connector)
    puller = KVPuller(engine.decode.mesh.devices.flat[0])
    times, nbytes = [], 0
    try:
        for _ in range(6):
            t = time.perf_counter()
            kv = prefill.runner.read_pages(0, list(range(n)), LONG_TOKENS)
            prefilled, _ = puller.pull(sender.hold(Prefilled(
                0, kv, prefill.model_digest, None, list(range(LONG_TOKENS)), [])), 60.0)
            jax.block_until_ready(prefilled.kv.entries)
            times.append(time.perf_counter() - t)
            nbytes = prefilled.kv.nbytes
    finally:
        sender.stop()
    ms = statistics.median(times[1:]) * 1e3
    return {"bytes": nbytes, "ms": ms, "gb_per_s": nbytes / ms / 1e6, "pages": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = checkpoint(ROOT / "configs/models/smollm2-135m.yaml", dtype="float32")
    colocated = Engine.from_config(config(model, devices=(0,)))
    colocated.warmup(progress=False)
    pd = DisaggregatedEngine.from_config(config(model, devices=(0,)),
                                         config(model, devices=(1,)))
    pd.warmup(progress=False)
    run_round(colocated, 999), run_round(pd, 999)  # first runs: caches, allocator warm
    rounds = {"colocated": [], "disaggregated": []}
    for r in range(args.rounds):
        for name, engine in (("colocated", colocated), ("disaggregated", pd)):
            rounds[name].append(run_round(engine, r))
    moved = transfer_time(pd)
    wire = {c: server_transfer_time(pd, c) for c in ("grpc", "jax")}
    result = {
        "date": datetime.date.today().isoformat(), "machine": platform.processor()
        or platform.machine(), "cpus": os.cpu_count(), "rounds": args.rounds,
        "setups": {name: {k: spread([x[k] for x in rs]) for k in rs[0]}
                   for name, rs in rounds.items()},
        "handoffs": pd.num_handoffs, "bytes_per_handoff": pd.handoff_bytes / pd.num_handoffs,
        "transfer": moved, "server_transfer": wire}
    print(f"\n{STREAMS} streams x {STREAM_TOKENS} tokens; a {LONG_TOKENS}-token prompt every "
          f"{EVERY} steps ({LONG_PROMPTS}); medians of {args.rounds} rounds [min-max]\n")
    print("| setup | TPOT p50 ms | TPOT p99 ms | round s |")
    print("|---|---|---|---|")
    for name, s in result["setups"].items():
        cells = [f"{s[k]['median']:.1f} [{s[k]['min']:.1f}-{s[k]['max']:.1f}]"
                 for k in ("tpot_p50_ms", "tpot_p99_ms", "wall_s")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nhandoffs: {pd.num_handoffs}, {result['bytes_per_handoff'] / 2**20:.2f} MiB each "
          f"(pages padded to a bucket); one {LONG_TOKENS}-token prompt's K/V alone: "
          f"{moved['bytes'] / 2**20:.2f} MiB ({moved['pages_used']} pages, "
          f"{moved['pages_moved']} moved) in {moved['ms']:.1f} ms = {moved['gb_per_s']:.2f} GB/s")
    for connector, w in wire.items():
        print(f"servers' path, kv_connector {connector} (localhost): {w['bytes'] / 2**20:.2f} "
              f"MiB in {w['ms']:.1f} ms = {w['gb_per_s']:.2f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    pd.close()


if __name__ == "__main__":
    main()
