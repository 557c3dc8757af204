"""Where a step's time goes: the whole step against its parts, timed alone on the same shapes.

Runs workload (b) of offline_throughput.py (64 requests, 128-token prompts, 128 new tokens,
greedy) on random weights, records every step's batch and wall time, then times, for the
most frequent prefill (mixed) and decode buckets, on the batches the engine really built:

- the whole compiled step (what the engine ran);
- the model's matmuls alone: one jitted chain of exactly the step's GEMMs (q/k/v/o,
  gate/up/down per layer, and the LM head on one row per sequence), in XLA, and the same
  GEMMs in torch (oneDNN) as a peer: XLA's matmul-only floor for that step;
- the reference ragged paged attention of every layer on the real metadata and KV pool
  (the K/V write, an in-place scatter of T rows in the step, is left out: timed alone it
  would copy the undonated pool);
- the sampler on [S, vocab] logits.

The sum over the run's steps of the matmul-only time is a lower bound on workload (b) for
any program XLA:CPU compiles from these GEMMs, whatever attention and sampling cost.

    python benchmarks/step_profile.py [--preset configs/models/smollm2-135m.yaml] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sampler import sample
from jaxserve.sampling_params import SamplingParams
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def median_s(fn, iters: int = 7) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def gemm_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of one layer's matmuls, in order."""
    e, m, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return [(e, cfg.num_heads * d), (e, cfg.num_kv_heads * d), (e, cfg.num_kv_heads * d),
            (cfg.num_heads * d, e), (e, m), (e, m), (m, e)]


def xla_matmuls(cfg: ModelConfig, tokens: int, seqs: int, dtype) -> float:
    """Seconds for the step's GEMMs alone, jitted as one program (layers unrolled)."""
    key = jax.random.key(0)
    layers = [[0.02 * jax.random.normal(jax.random.fold_in(key, 8 * i + j), s, dtype)
               for j, s in enumerate(gemm_shapes(cfg))] for i in range(cfg.num_layers)]
    head = 0.02 * jax.random.normal(key, (cfg.hidden_size, cfg.vocab_size), dtype)
    x = jax.random.normal(key, (tokens, cfg.hidden_size), dtype)

    @jax.jit
    def chain(x, layers, head):
        for wq, wk, wv, wo, wg, wu, wd in layers:
            kv = (x @ wk).sum() + (x @ wv).sum()  # used, so not removed
            x = x + (x @ wq) @ wo + kv * 1e-9
            x = x + ((x @ wg) * (x @ wu)) @ wd
        return x[:seqs] @ head

    return median_s(lambda: chain(x, layers, head).block_until_ready())


def torch_matmuls(cfg: ModelConfig, tokens: int, seqs: int) -> float:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    g = torch.Generator().manual_seed(0)
    layers = [[0.02 * torch.randn(s, generator=g) for s in gemm_shapes(cfg)]
              for _ in range(cfg.num_layers)]
    head = 0.02 * torch.randn(cfg.hidden_size, cfg.vocab_size, generator=g)
    x0 = torch.randn(tokens, cfg.hidden_size, generator=g)

    def chain():
        with torch.no_grad():
            x = x0
            for wq, wk, wv, wo, wg, wu, wd in layers:
                kv = (x @ wk).sum() + (x @ wv).sum()
                x = x + (x @ wq) @ wo + kv * 1e-9
                x = x + ((x @ wg) * (x @ wu)) @ wd
            return x[:seqs] @ head

    return median_s(chain)


def attention_time(cfg: ModelConfig, engine: Engine, batch) -> float:
    """All layers' reference attention on the batch's real metadata and the engine's pool."""
    meta = jax.tree.map(jnp.asarray, batch.attn)
    t = batch.input_ids.shape[0]
    q = jax.random.normal(jax.random.key(1), (t, cfg.num_heads, cfg.head_dim), jnp.float32)
    caches = engine.runner.kv_caches

    @jax.jit
    def attend(q, caches):
        out = 0.0
        for kp, vp in caches:
            out = out + ragged_paged_attention(
                q, kp, vp, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs[0],
                sm_scale=cfg.head_dim**-0.5, impl="reference")
        return out

    return median_s(lambda: attend(q, caches).block_until_ready())


def sampler_time(cfg: ModelConfig, batch) -> float:
    s = batch.sampling.temperature.shape[0]
    logits = jax.random.normal(jax.random.key(2), (s, cfg.vocab_size), jnp.float32)
    fn = jax.jit(lambda x, p: sample(x, p, None))
    p = jax.tree.map(jnp.asarray, batch.sampling)
    return median_s(lambda: jax.block_until_ready(fn(logits, p)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="configs/models/smollm2-135m.yaml")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_file(args.preset)
    engine_cfg = EngineConfig(dtype="float32", max_model_len=512, page_size=16,
                              max_num_seqs=64, max_num_batched_tokens=512,
                              token_buckets=(1, 64, 512), enable_prefix_caching=False,
                              async_scheduling=False)
    engine = Engine.from_config(engine_cfg, random_weights_preset=args.preset)
    engine.warmup(progress=False)

    # Workload (b), recording each step's bucket, batch and wall time.
    runner, steps = engine.runner, []
    dispatch = runner.dispatch

    def recording_dispatch(batch, key):
        steps.append({"key": key, "batch": batch})
        return dispatch(batch, key)

    runner.dispatch = recording_dispatch
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"r{i}", rng.integers(0, cfg.vocab_size, 128).tolist(), params)
    start = time.perf_counter()
    last = start
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        steps[-1]["s"] = now - last
        last = now
    total = time.perf_counter() - start
    runner.dispatch = dispatch

    counts = collections.Counter(s["key"] for s in steps)
    rows, floor_xla, floor_torch, parts = [], 0.0, 0.0, {}
    for key, n in sorted(counts.items()):
        t, s, _ = key
        batch = next(x["batch"] for x in steps if x["key"] == key and x.get("s"))
        step_s = float(np.median([x["s"] for x in steps if x["key"] == key]))
        mm_xla = xla_matmuls(cfg, t, s, jnp.float32)
        mm_torch = torch_matmuls(cfg, t, s)
        attn = attention_time(cfg, engine, batch)
        samp = sampler_time(cfg, batch)
        floor_xla += n * mm_xla
        floor_torch += n * mm_torch
        parts[str(key)] = dict(steps=n, step_s=step_s, matmuls_xla_s=mm_xla,
                               matmuls_torch_s=mm_torch, attention_s=attn, sampler_s=samp)
        rows.append([f"T={t}, S={s}", str(n), f"{1e3 * step_s:.1f}", f"{1e3 * mm_xla:.1f}",
                     f"{1e3 * mm_torch:.1f}", f"{1e3 * attn:.1f}", f"{1e3 * samp:.1f}",
                     f"{1e3 * (step_s - mm_xla - attn - samp):.1f}"])

    print(f"\nstep profile, {datetime.date.today().isoformat()}: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__} ({jax.devices()[0].platform}), "
          f"{os.path.basename(args.preset)} float32, workload (b): {len(steps)} steps, {total:.2f} s")
    head = ["bucket", "steps", "step ms", "matmuls XLA ms", "matmuls torch ms",
            "attention ms", "sampler ms", "rest ms"]
    print("| " + " | ".join(head) + " |\n|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\nsum over the run's steps of the matmuls alone: XLA {floor_xla:.2f} s, "
          f"torch {floor_torch:.2f} s (the run took {total:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_s": total, "steps": len(steps), "buckets": parts,
                       "matmul_floor_xla_s": floor_xla, "matmul_floor_torch_s": floor_torch},
                      f, indent=2)


if __name__ == "__main__":
    main()
