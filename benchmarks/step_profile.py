"""Where a step's time goes: the whole step against its parts, timed alone on the same shapes.

Runs workload (b) of offline_throughput.py (64 requests, 128-token prompts, 128 new tokens,
greedy; sync scheduling, so each step's wall time is its own) on random weights, records
every step's batch and wall time, then times, for every bucket the run used, on the
batches the engine really built:

- the whole compiled step (what the engine ran);
- the model's matmuls alone, as one jitted chain of exactly the step's GEMMs (q/k/v, o,
  gate/up, down per layer and the LM head on one row per sequence): with the kernels the
  engine picks (pallas_kernels.matmul's default: on a CPU with the native kernels, the
  [N, K] weights of one device, packed on AVX-512 CPUs, on the bucket's real rows), with
  XLA's dot on every row of the bucket, and in torch (oneDNN) as a peer;
- the engine's ragged paged attention (its default implementation) of every layer on the
  real metadata and KV pool (the K/V write is left out: timed alone it would copy the
  undonated pool);
- the sampler on [S, vocab] logits.

"rest" is the step less the engine's matmuls, attention and sampler: the norms, rotary,
residuals, K/V writes and the program's own overhead.

torch's bf16 matmuls on a CPU without native bf16 dot products take minutes per bucket:
--skip-torch leaves that column out.

    python benchmarks/step_profile.py [--preset configs/models/smollm2-135m.yaml]
        [--dtype float32|bfloat16] [--skip-torch] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sampler import sample
from jaxserve.huge_pages import restart_with_huge_pages
from jaxserve.sampling_params import SamplingParams
from pallas_kernels import matmul as matmul_kernels
from pallas_kernels.matmul import packed
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def median_s(fn, iters: int = 7) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def ms(t: float) -> str:
    return "skipped" if math.isnan(t) else f"{1e3 * t:.1f}"


def seconds(t: float) -> str:
    return "skipped" if math.isnan(t) else f"{t:.2f} s"


def gemm_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of one layer's matmuls, in order."""
    e, m, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return [(e, cfg.num_heads * d), (e, cfg.num_kv_heads * d), (e, cfg.num_kv_heads * d),
            (cfg.num_heads * d, e), (e, m), (e, m), (m, e)]


def matmul_chain(cfg: ModelConfig, tokens: int, seqs: int, real_tokens: int, real_seqs: int,
                 dtype, engine_kernels: bool) -> float:
    """Seconds for the step's GEMMs alone, jitted as one program (layers unrolled): with
    the kernels the engine picks (`engine_kernels`; [N, K] weights, packed where the engine
    packs them, the real rows only where the native kernels run) or XLA's dot on every row
    ([K, N] weights)."""
    key = jax.random.key(0)
    transposed = engine_kernels and matmul_kernels.default_impl() == "cpu"
    shapes = gemm_shapes(cfg) + [(cfg.hidden_size, cfg.vocab_size)]
    packs = transposed and packed.worth_packing(dtype) and all(
        packed.packable(n, k, dtype) for k, n in shapes)  # all or none here
    shape = (lambda k, n: (n, k)) if transposed else (lambda k, n: (k, n))

    def weight(seed, k, n):
        w = 0.02 * jax.random.normal(jax.random.fold_in(key, seed), shape(k, n), dtype)
        return packed.pack(w) if packs else w

    layers = [[weight(8 * i + j, k, n) for j, (k, n) in enumerate(gemm_shapes(cfg))]
              for i in range(cfg.num_layers)]
    head = weight(8 * cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
    x = jax.random.normal(key, (tokens, cfg.hidden_size), dtype)

    def mm(x, ws, rows):
        if engine_kernels:
            return matmul_kernels.matmuls(x, ws, rows, transpose_w=transposed, packed_w=packs)
        return [x @ w for w in ws]

    @jax.jit
    def chain(x, layers, head):
        for wq, wk, wv, wo, wg, wu, wd in layers:
            q, k, v = mm(x, [wq, wk, wv], real_tokens)
            kv = k.sum() + v.sum()  # used, so not removed
            x = x + mm(q, [wo], real_tokens)[0] + kv * 1e-9
            g, u = mm(x, [wg, wu], real_tokens)
            x = x + mm(g * u, [wd], real_tokens)[0]
        return mm(x[:seqs], [head], real_seqs)[0]

    return median_s(lambda: chain(x, layers, head).block_until_ready())


def torch_matmuls(cfg: ModelConfig, tokens: int, seqs: int, dtype: str) -> float:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    g = torch.Generator().manual_seed(0)
    tdtype = getattr(torch, dtype)
    layers = [[(0.02 * torch.randn(s, generator=g)).to(tdtype) for s in gemm_shapes(cfg)]
              for _ in range(cfg.num_layers)]
    head = (0.02 * torch.randn(cfg.hidden_size, cfg.vocab_size, generator=g)).to(tdtype)
    x0 = torch.randn(tokens, cfg.hidden_size, generator=g).to(tdtype)

    def chain():
        with torch.no_grad():
            x = x0
            for wq, wk, wv, wo, wg, wu, wd in layers:
                kv = (x @ wk).sum() + (x @ wv).sum()
                x = x + (x @ wq) @ wo + kv * 1e-9
                x = x + ((x @ wg) * (x @ wu)) @ wd
            return x[:seqs] @ head

    return median_s(chain)


def attention_time(cfg: ModelConfig, engine: Engine, batch, dtype) -> float:
    """All layers' attention (the engine's default kernels) on the batch's real metadata
    and the engine's pool."""
    meta = jax.tree.map(jnp.asarray, batch.attn)
    t = batch.input_ids.shape[0]
    q = jax.random.normal(jax.random.key(1), (t, cfg.num_heads, cfg.head_dim), dtype)
    caches = engine.runner.kv_caches

    @jax.jit
    def attend(q, caches):
        out = 0.0
        for kp, vp in caches:
            out = out + ragged_paged_attention(
                q, kp, vp, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs[0],
                sm_scale=cfg.head_dim**-0.5)
        return out

    return median_s(lambda: attend(q, caches).block_until_ready())


def sampler_time(cfg: ModelConfig, batch, dtype) -> float:
    s = batch.sampling.temperature.shape[0]
    logits = jax.random.normal(jax.random.key(2), (s, cfg.vocab_size), dtype)
    fn = jax.jit(lambda x, p: sample(x, p, None))
    p = jax.tree.map(jnp.asarray, batch.sampling)
    return median_s(lambda: jax.block_until_ready(fn(logits, p)))


def run_workload_b(engine: Engine, cfg: ModelConfig) -> tuple[list[dict], float]:
    """Workload (b), recording each step's bucket, batch and wall time; the run's time."""
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
    runner.dispatch = dispatch
    return steps, time.perf_counter() - start


def bucket_parts(cfg: ModelConfig, engine: Engine, key, steps: list[dict], dtype,
                 skip_torch: bool) -> tuple[dict, int, int]:
    """One bucket's median step against its parts, timed alone on its first real batch;
    and that batch's real tokens and sequences."""
    t, s = key.tokens, key.seqs
    batch = next(x["batch"] for x in steps if x["key"] == key and x.get("s"))
    real_seqs = int(batch.num_rows[0])
    real_tokens = int(batch.attn.cu_q_lens[int(batch.attn.num_seqs[0])])
    step_s = float(np.median([x["s"] for x in steps if x["key"] == key]))
    part = dict(steps=sum(x["key"] == key for x in steps), step_s=step_s,
                matmuls_engine_s=matmul_chain(cfg, t, s, real_tokens, real_seqs, dtype, True),
                matmuls_xla_s=matmul_chain(cfg, t, s, real_tokens, real_seqs, dtype, False),
                matmuls_torch_s=(float("nan") if skip_torch
                                 else torch_matmuls(cfg, t, s, jnp.dtype(dtype).name)),
                attention_s=attention_time(cfg, engine, batch, dtype),
                sampler_s=sampler_time(cfg, batch, dtype))
    part["rest_s"] = step_s - part["matmuls_engine_s"] - part["attention_s"] - part["sampler_s"]
    return part, real_tokens, real_seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="configs/models/smollm2-135m.yaml")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    restart_with_huge_pages()  # malloc as under the `jaxserve` command
    cfg = ModelConfig.from_file(args.preset)
    dtype = jnp.dtype(args.dtype)
    engine_cfg = EngineConfig(dtype=args.dtype, max_model_len=512, page_size=16,
                              max_num_seqs=64, max_num_batched_tokens=512,
                              token_buckets=(1, 64, 512), enable_prefix_caching=False,
                              async_scheduling=False)
    engine = Engine.from_config(engine_cfg, random_weights_preset=args.preset)
    engine.warmup(progress=False)
    steps, total = run_workload_b(engine, cfg)

    rows, floors, parts = [], collections.Counter(), {}
    for key, n in sorted(collections.Counter(s["key"] for s in steps).items()):
        part, real_tokens, real_seqs = bucket_parts(cfg, engine, key, steps, dtype,
                                                    args.skip_torch)
        for name in ("step_s", "matmuls_engine_s", "matmuls_xla_s", "matmuls_torch_s"):
            floors[name] += n * part[name]
        parts[str(tuple(key))] = part
        rows.append([f"T={key.tokens}, S={key.seqs} ({real_tokens} tokens, {real_seqs} seqs)",
                     str(n)] + [ms(part[name]) for name in
                                ("step_s", "matmuls_engine_s", "matmuls_xla_s", "matmuls_torch_s",
                                 "attention_s", "sampler_s", "rest_s")])

    print(f"\nstep profile, {datetime.date.today().isoformat()}: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__} ({jax.devices()[0].platform}), "
          f"{os.path.basename(args.preset)} {args.dtype}, workload (b): {len(steps)} steps, {total:.2f} s")
    head = ["bucket (first batch's real tokens)", "steps", "step ms", "matmuls engine ms",
            "matmuls XLA ms", "matmuls torch ms", "attention ms", "sampler ms", "rest ms"]
    print("| " + " | ".join(head) + " |\n|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\nsums over the run's steps (median step time x steps): steps {floors['step_s']:.2f} s; "
          f"the matmuls alone: engine's kernels {floors['matmuls_engine_s']:.2f} s, "
          f"XLA {floors['matmuls_xla_s']:.2f} s, torch {seconds(floors['matmuls_torch_s'])} "
          f"(the run took {total:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_s": total, "steps": len(steps), "buckets": parts,
                       "sums_s": dict(floors)},
                      f, indent=2)


if __name__ == "__main__":
    main()
