"""Does a step's launch wait for the device? The engine's host time inside each compiled
call, and how many steps were dispatched while the one before still ran ("queued").

A jitted call should return once its work is queued on the device. On a GPU it returns
only when the device has run up to the program's last `lax.cond` or loop of unknown count
(XLA:GPU copies their predicates to the host and waits), and then no step is queued behind
another; `ModelRunner.branch_free` keeps both out of the step programs there. One engine
(offline_throughput.py's settings, num_scheduler_steps 8, a preset's random checkpoint,
bf16); workloads (a) 1 request x 256 new tokens, (b) 64 x (128-token prompt + 128), greedy,
and (c) as (b) sampled at temperature 0.7 with top-p 0.9 (on a GPU: a forward pass and
the FULL sampling, its sort, a step), each with one decode step per program (the
multi-step rule turned off) and with 8, twice.
Per kind of program: calls, median and largest host ms inside the call.

    JAX_PLATFORMS=cuda python benchmarks/gpu_dispatch.py [--preset configs/models/llama3-8b.yaml]
    python benchmarks/gpu_dispatch.py --preset configs/models/tiny-llama.yaml  # on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import numpy as np

import peers
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="configs/models/llama3-8b.yaml")
    args = ap.parse_args()
    model_dir = peers.checkpoint(args.preset)
    engine = Engine.from_config(EngineConfig(
        model=str(model_dir), dtype="bfloat16", max_model_len=512, page_size=16,
        max_num_seqs=64, max_num_batched_tokens=512, token_buckets=(1, 64, 512),
        enable_prefix_caching=False, num_scheduler_steps=8))
    start = time.perf_counter()
    engine.warmup()
    print(f"\n## step launches, {datetime.date.today().isoformat()}\n\n- "
          f"{jax.devices()[0].device_kind}; jax {jax.__version__}; {args.preset}, bf16; "
          f"warm-up {time.perf_counter() - start:.0f} s; branch_free "
          f"{engine.runner.branch_free}\n")
    calls: list[tuple[str, float]] = []
    run = engine.runner._run

    def timed(program, fn, call_args):
        t = time.perf_counter()
        out = run(program, fn, call_args)
        calls.append((program[0], time.perf_counter() - t))
        return out

    engine.runner._run = timed
    multi_step = engine._decode_steps
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompt_a = [rng.integers(100, vocab, 32).tolist()]
    prompts_b = [rng.integers(100, vocab, 128).tolist() for _ in range(64)]

    def workload(prompts: list[list[int]], new_tokens: int, top_p: float = 1.0
                 ) -> tuple[float, float, int, int]:
        calls.clear()
        steps, queued = engine.num_steps, engine.num_overlapped_steps
        params = SamplingParams(temperature=0.0 if top_p == 1.0 else 0.7, top_p=top_p,
                                seed=0, max_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"{t0}-{i}", p, params)
        first = None
        while engine.has_unfinished():
            if engine.step() and first is None:
                first = time.perf_counter()
        return (t0, first, engine.num_steps - steps, engine.num_overlapped_steps - queued)

    print("| workload | decode steps a program | result | steps queued | host ms in the "
          "call, by program: calls, median, max |\n|---|---|---|---|---|")
    for steps in (1, 8, 1, 8):
        engine._decode_steps = (lambda: 1) if steps == 1 else multi_step
        workload(prompt_a, 8)  # warm
        for name, prompts, new, top_p in (("(a) 1 x 256", prompt_a, 256, 1.0),
                                          ("(b) 64 x 128", prompts_b, 128, 1.0),
                                          ("(c) 64 x 128, top-p 0.9", prompts_b, 128, 0.9)):
            t0, first, n, queued = workload(prompts, new, top_p)
            end = time.perf_counter()
            result = (f"{1e3 * (end - first) / (new - 1):.2f} ms a token" if len(prompts) == 1
                      else f"{len(prompts) * new / (end - t0):.0f} tok/s")
            by: dict[str, list[float]] = {}
            for kind, seconds in calls:
                by.setdefault(kind, []).append(1e3 * seconds)
            text = "; ".join(f"{k} {len(v)}, {statistics.median(v):.2f}, {max(v):.2f}"
                             for k, v in by.items())
            print(f"| {name} | {steps} | {result} | {queued} of {n} | {text} |", flush=True)


if __name__ == "__main__":
    main()
