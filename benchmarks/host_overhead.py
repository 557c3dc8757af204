"""The engine's own work per decode step: a model whose math costs next to nothing, so that a
step's time is the host loop's (scheduling, the batch, dispatch, collecting tokens).

The model is configs/models/tiny-llama.yaml (hidden 64, 2 layers, vocab 2048), random
weights written once by benchmarks/peers.py (float32 safetensors and a tokenizer) and
loaded by every system. Each run: n requests of 16-token prompts, greedy, EOS ignored,
128 new tokens each, n = 1, 16, 64, 256 running together; rounds interleaved. The heap
is frozen once the engines are warm (`gc.freeze`), as the servers' engine process does.

Per system and n:
- ms per step: (wall(128 new tokens) - wall(1 new token)) / 127, the decode steps alone
  (for `num_scheduler_steps: 8`, per token-step: a program runs 8 of them);
- tokens/s: n x 128 / wall(128 new tokens);
- jaxserve only: the compiled step alone on the run's last decode batch, back to back
  (the ceiling: what the step costs with no host work), the host's parts of a step
  (schedule, build the batch, dispatch, collect less its wait for the device, the
  wait), and the share of steps dispatched while the one before still ran ("queued").

Peers in the same run (benchmarks/peers.py builds or installs them once): vLLM's CPU build
(LLM.generate, the same formula) and llama.cpp (llama-batched-bench: its text-generation
time per step, no sampling or detokenizing). --skip-peers leaves them out.

    python benchmarks/host_overhead.py [--rounds 3] [--counts 1,16,64,256] [--skip-peers]
        [--json out.json] [--pack auto|on|off] [--fuse on|off]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

# This tree's code, not whichever tree the virtualenv installed (a worktree of the code
# before runs its own: `python /tmp/old/benchmarks/...`).
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import peers  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.engine import engine as engine_module  # noqa: E402
from jaxserve.engine import runner as runner_module  # noqa: E402

PRESET = Path(__file__).resolve().parent.parent / "configs" / "models" / "tiny-llama.yaml"
PROMPT_LEN, NEW_TOKENS, VOCAB = 16, 128, 2048
MODES = {"default": 1, "multi-step 8": 8}
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=256,
              max_num_batched_tokens=4096, enable_prefix_caching=False)
PARTS = ("schedule", "build", "dispatch", "collect", "wait")


class Timed:
    """While entered: sums the time an engine spends in each step phase (its methods wrapped
    on the instances, and the engine module's `fetch`); `collect` excludes its wait for the
    device (`wait`). Keeps the last batch built."""

    def __init__(self, llm: LLM):
        self.total = collections.Counter()
        self.last_batch = None
        self._engine = llm.engine
        self._undo: list = []

    def __enter__(self) -> "Timed":
        e = self._engine
        self._wrap(e.scheduler, "schedule", "schedule")
        self._wrap(e.builder, "build", "build", keep=True)
        for name in ("dispatch", "dispatch_steps", "dispatch_forward", "dispatch_sample"):
            self._wrap(e.runner, name, "dispatch")
        self._wrap(e, "_collect", "collect")
        self._wrap(engine_module, "fetch", "wait")
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, original in self._undo:
            setattr(obj, name, original)
        self._undo.clear()

    def _wrap(self, obj, name: str, part: str, keep: bool = False) -> None:
        fn = getattr(obj, name)
        self._undo.append((obj, name, fn))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if keep:
                    self.last_batch = out
                return out
            finally:
                self.total[part] += time.perf_counter() - start
        setattr(obj, name, timed)

    def parts(self, steps: int) -> dict[str, float]:
        """ms per step of each part."""
        t = dict(self.total)
        t["collect"] = t.get("collect", 0.0) - t.get("wait", 0.0)
        return {p: 1e3 * t.get(p, 0.0) / steps for p in PARTS}


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, PROMPT_LEN).tolist() for _ in range(n)]


def wall(llm: LLM, batch: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return elapsed


def device_step_ms(llm: LLM, batch_and_key, iters: int = 20) -> float:
    """The compiled step alone on one batch, back to back (median ms); it writes K/V only
    into pages no request holds any more (prefix caching is off)."""
    runner = llm.engine.runner
    batch, key = batch_and_key
    times = []
    for _ in range(iters + 2):
        start = time.perf_counter()
        jax.block_until_ready(runner.dispatch(batch, key))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


def run_jaxserve(model_dir: Path, counts: list[int], rounds: int) -> dict:
    results: dict = {}
    llms = {}
    for mode, steps in MODES.items():
        llms[mode] = LLM(str(model_dir), num_scheduler_steps=steps, **ENGINE)
        wall(llms[mode], prompts(8), 4)  # warm
    # As the servers' engine process does once ready (server/engine_core.freeze_heap_now):
    # else a full collection of the ~400k objects of the startup heap (~235 ms) lands in
    # some runs, +1.8 ms on each of their 128 steps at 256 sequences.
    gc.collect()
    gc.freeze()
    for r in range(rounds):
        for n in counts:
            for mode, llm in llms.items():
                batch = prompts(n)
                one = wall(llm, batch, 1)
                e = llm.engine
                steps0, queued0 = e.num_steps, e.num_overlapped_steps
                with Timed(llm) as timed:
                    whole = wall(llm, batch, NEW_TOKENS)
                steps = e.num_steps - steps0
                row = results.setdefault(mode, {}).setdefault(n, collections.defaultdict(list))
                row["ms_per_step"].append(1e3 * (whole - one) / (NEW_TOKENS - 1))
                row["tokens_per_s"].append(n * NEW_TOKENS / whole)
                row["queued"].append((e.num_overlapped_steps - queued0) / max(steps - 1, 1))
                for part, ms in timed.parts(steps).items():
                    row[part].append(ms)
                if mode == "default":
                    row["device_ms"].append(device_step_ms(llm, timed.last_batch))
                print(f"round {r} {mode:>13} n={n:<4} {row['ms_per_step'][-1]:7.3f} ms/step "
                      f"{row['tokens_per_s'][-1]:9.0f} tok/s", flush=True)
    return results


def fmt(s: dict | None, digits: int = 2) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--counts", default="1,16,64,256")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--pack", choices=["auto", "on", "off"], default="auto",
                    help="step programs' host inputs in one transfer (jaxserve/engine/"
                         "packing.py; auto: on accelerators only)")
    ap.add_argument("--fuse", choices=["on", "off"], default="on",
                    help="a decode bucket's forward pass and sampling in one program "
                         "(runner.ModelRunner.fuses; off: two programs a step)")
    args = ap.parse_args()
    if args.pack != "auto":
        runner_module.packs_inputs = lambda: args.pack == "on"
    if args.fuse == "off":
        runner_module.ModelRunner.fuses = lambda self, key: False
    counts = [int(x) for x in args.counts.split(",")]
    model_dir = peers.checkpoint(PRESET, dtype="float32")
    spec = peers.Concurrency(prompts(max(counts)), counts, NEW_TOKENS, args.rounds)
    others = {}
    if not args.skip_peers:
        others["vLLM"] = peers.run_vllm_concurrency(model_dir, "float32", spec)
        others["llama.cpp"] = peers.run_llamacpp_concurrency(model_dir, "float32", spec)
    ours = run_jaxserve(model_dir, counts, args.rounds)
    table = {mode: {n: {k: peers.spread(v) for k, v in row.items()} for n, row in by_n.items()}
             for mode, by_n in ours.items()}
    for name, (result, reason) in others.items():
        if result is None:
            print(f"{name}: not run ({reason})")

    print(f"\nhost_overhead: {platform.node()}, {os.cpu_count()} CPUs, "
          f"{datetime.date.today()}, {args.rounds} rounds (median [min-max])")
    print("| running seqs | jaxserve default: ms/step | multi-step 8: ms/token-step | "
          "compiled step alone: ms | vLLM: ms/step | llama.cpp: ms/step | "
          "jaxserve tok/s | vLLM tok/s | llama.cpp tok/s | steps queued |")
    print("|---" * 10 + "|")
    def peer(name: str, n: int, what: str) -> dict | None:
        result = others.get(name, (None, None))[0]
        return result["counts"].get(str(n), {}).get(what) if result else None

    for n in counts:
        d, m = table["default"][n], table["multi-step 8"][n]
        print(f"| {n} | {fmt(d['ms_per_step'])} | {fmt(m['ms_per_step'])} | "
              f"{fmt(d['device_ms'])} | {fmt(peer('vLLM', n, 'ms_per_step'))} | "
              f"{fmt(peer('llama.cpp', n, 'ms_per_step'))} | {fmt(d['tokens_per_s'], 0)} | "
              f"{fmt(peer('vLLM', n, 'tokens_per_s'), 0)} | "
              f"{fmt(peer('llama.cpp', n, 'tokens_per_s'), 0)} | "
              f"{100 * d['queued']['median']:.0f}% |")
    print("\nThe host's parts of a jaxserve step (ms per step, medians; collect without its "
          "wait for the device):")
    print("| running seqs | mode | " + " | ".join(PARTS) + " |")
    print("|---|---|" + "---|" * len(PARTS))
    for n in counts:
        for mode in MODES:
            row = table[mode][n]
            print(f"| {n} | {mode} | " + " | ".join(f"{row[p]['median']:.3f}" for p in PARTS)
                  + " |")
    for name, (result, _) in others.items():
        if result is not None:
            print(f"{name}: {result['version']}; {result['flags']}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"date": str(datetime.date.today()), "host": platform.node(),
             "jaxserve": table, "peers": {k: r for k, (r, _) in others.items()}}, indent=1))


if __name__ == "__main__":
    main()
