"""Offline throughput of the engine against this machine's ceilings and against transformers.

Random weights of a model preset (default smollm2-135m shape), greedy, ignore_eos:
  (a) 1 request, 32-token prompt, 256 new tokens: TTFT, ms per output token;
  (b) 64 requests, 128-token prompts, 128 new tokens each: output tokens/s.
Ceilings measured in the same run: memory bandwidth (a jitted reduction over 1 GiB) gives
the floor on batch-1 decode time (weights read once per token); matmul rate (a jitted
square matmul) gives the floor on compute time. The peer is Hugging Face transformers
`generate` on a model of the same shape, all 64 prompts in one static batch.

    python benchmarks/offline_throughput.py [--preset configs/models/smollm2-135m.yaml]
        [--dtype float32|bfloat16] [--skip-hf] [--json out.json]
"""

from __future__ import annotations

import argparse
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
from jaxserve.sampling_params import SamplingParams


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s read by a jitted sum over a large float32 array (best of `repeats`)."""
    n = int(gib * 2**30 / 4)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
    return n * 4 / best


def measure_matmul(dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a jitted n x n matmul in `dtype` (best of `repeats`)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best


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


def run_hf(cfg: ModelConfig, dtype: str, prompts: list[list[int]], new_tokens: int) -> dict:
    import torch
    import transformers as tf

    torch.set_num_threads(os.cpu_count() or 1)
    hf_cfg = tf.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings, rms_norm_eps=cfg.rms_norm_eps)
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    model = tf.LlamaForCausalLM(hf_cfg).to(torch_dtype).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        warm = ids[:1, :8]
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, **kwargs)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"total_s": total, "output_tokens": produced, "tokens_per_s": produced / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="configs/models/smollm2-135m.yaml")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--sync", action="store_true",
                    help="no async scheduling: the host waits for each step's tokens before "
                         "building the next batch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cfg = ModelConfig.from_file(args.preset)
    engine_cfg = EngineConfig(dtype=args.dtype, max_model_len=512, page_size=16, max_num_seqs=64,
                              max_num_batched_tokens=512, token_buckets=(1, 64, 512),
                              enable_prefix_caching=False, async_scheduling=not args.sync)
    t0 = time.perf_counter()
    engine = Engine.from_config(engine_cfg, random_weights_preset=args.preset)
    engine.warmup()
    warmup_s = time.perf_counter() - t0

    bandwidth = measure_bandwidth()
    flops = measure_matmul(jnp.float32 if args.dtype == "float32" else jnp.bfloat16)
    itemsize = jnp.dtype(args.dtype).itemsize
    # Per decoded token every weight is read once, except that only one embedding row is
    # gathered (with tied embeddings the lm_head reads the whole table anyway).
    weight_bytes = (cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)) * itemsize
    matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)

    rng = np.random.default_rng(0)
    a = run_engine(engine, [rng.integers(0, cfg.vocab_size, 32).tolist()], 256)
    prompts_b = [rng.integers(0, cfg.vocab_size, 128).tolist() for _ in range(64)]
    steps, overlapped = engine.num_steps, engine.num_overlapped_steps
    b = run_engine(engine, prompts_b, 128)
    b_steps = engine.num_steps - steps
    b_overlapped = engine.num_overlapped_steps - overlapped
    hf = None if args.skip_hf else run_hf(cfg, args.dtype, prompts_b, 128)

    decode_floor_ms = 1e3 * weight_bytes / bandwidth
    # Compute floor for (b): 2 FLOPs per weight per token, prefill + decode (attention
    # adds < 5% at these lengths and is left out, which makes the floor lower, not higher).
    b_tokens = 64 * (128 + 128)
    b_floor_s = 2 * matmul_params * b_tokens / flops
    assert engine.runner.compiles_after_warmup == 0

    rows = [
        ("machine", f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, {jax.devices()[0].platform}"),
        ("model", f"{os.path.basename(args.preset)} random weights, {cfg.num_params() / 1e6:.1f}M params, {args.dtype}"),
        ("warm-up (load + compile all buckets)", f"{warmup_s:.1f} s, {engine.runner.num_compiled} programs"),
        ("measured memory bandwidth", f"{bandwidth / 1e9:.1f} GB/s"),
        ("measured matmul rate", f"{flops / 1e9:.1f} GFLOP/s ({args.dtype})"),
        ("(a) TTFT", f"{a['ttft_s'] * 1e3:.1f} ms"),
        ("(a) ms per output token", f"{a['tpot_ms']:.2f} ms"),
        ("(a) bandwidth floor per token", f"{decode_floor_ms:.2f} ms ({weight_bytes / 1e6:.0f} MB of weights)"),
        ("(a) ratio to floor", f"{a['tpot_ms'] / decode_floor_ms:.2f}x"),
        ("(a) output tokens/s", f"{a['tokens_per_s']:.1f}"),
        ("(b) mean TTFT", f"{b['ttft_s']:.2f} s"),
        ("(b) total time", f"{b['total_s']:.2f} s"),
        ("(b) output tokens/s", f"{b['tokens_per_s']:.1f}"),
        ("(b) compute floor", f"{b_floor_s:.2f} s, ratio {b['total_s'] / b_floor_s:.2f}x"),
        ("(b) steps queued behind a running step", f"{b_overlapped} of {b_steps}"
                                                   + (" (--sync)" if args.sync else "")),
    ]
    if hf is not None:
        rows += [("(b) transformers generate, static batch", f"{hf['total_s']:.2f} s, {hf['tokens_per_s']:.1f} tokens/s"),
                 ("(b) jaxserve / transformers throughput", f"{b['tokens_per_s'] / hf['tokens_per_s']:.2f}x")]
    width = max(len(k) for k, _ in rows)
    print(f"\noffline throughput, {datetime.date.today().isoformat()}")
    print(f"| {'metric'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": a, "b": b, "hf": hf, "bandwidth": bandwidth, "flops": flops,
                       "decode_floor_ms": decode_floor_ms, "b_floor_s": b_floor_s}, f, indent=2)


if __name__ == "__main__":
    main()
