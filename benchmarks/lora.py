"""Multi-LoRA serving cost: a batch of 64 requests over 8 adapters, against the same batch
on the base model alone and on one adapter merged into the weights.

One random-weight checkpoint of a preset's shape (default smollm2-135m, written once by
benchmarks/peers.py) and 8 random LoRA adapters of rank 16 on all seven projections
(q/k/v/o, gate/up/down), written as PEFT directories (adapter_config.json and
adapter_model.safetensors, straight from numpy). Workload: 64 requests of 128-token
prompts, 128 new tokens each, greedy, ignore_eos (offline_throughput.py's (b)); engine
settings from configs/engine/cpu.yaml, without the prefix cache. Output tokens/s of four
engines, one pass each per round, in turn, --rounds rounds:
  base      LoRA off;
  lora-off  enable_lora (8 slots of rank 16), every request on the base model: what the
            plumbing costs when no request uses an adapter;
  8 loras   enable_lora, request i under adapter i % 8;
  merged    adapter 0 merged into the weights (W + A.B.scale), LoRA off: a one-adapter
            deployment, the ceiling of serving adapters.
Ratios are taken within a round (the VM's speed drifts). Target (issue 55): 8 loras >= 0.8x
base. Like offline_throughput.py, it restarts itself with huge pages first.

    python benchmarks/lora.py [--preset configs/models/smollm2-135m.yaml] [--dtype float32]
        [--rounds 3] [--num-requests 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import yaml

import peers
from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.huge_pages import restart_with_huge_pages
from jaxserve.loading.safetensors import checkpoint_files, read_tensors
from jaxserve.models.lora import MODULES, module_shapes

ROOT = Path(__file__).resolve().parents[1]
NUM_ADAPTERS, RANK, ALPHA = 8, 16, 32
PROMPT_LEN, NEW_TOKENS = 128, 128


def write_adapter(model_dir: Path, out: Path, seed: int) -> None:
    """A random rank-16 PEFT LoRA adapter on every projection of `model_dir`'s model
    (B scaled so that the adapter moves the outputs, as a trained one does)."""
    from safetensors.numpy import save_file

    cfg = ModelConfig.from_file(model_dir)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name in MODULES:
            d_in, d_out = module_shapes(cfg)[name]
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((RANK, d_in)) /
                                               np.sqrt(d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((d_out, RANK))
                                               ).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(MODULES),
        "bias": "none", "base_model_name_or_path": str(model_dir)}))


def write_merged(model_dir: Path, adapter_dir: Path, out: Path) -> None:
    """`model_dir` with the adapter folded into its weights (W + B.A.scale, HF layout)."""
    from safetensors.numpy import load_file, save_file

    if out.is_dir():
        return
    shutil.copytree(model_dir, out)
    delta = load_file(adapter_dir / "adapter_model.safetensors")
    scale = ALPHA / RANK
    for file in checkpoint_files(out):
        tensors = {name: np.array(t) for name, t in read_tensors(file)}
        for name, w in tensors.items():
            key = "base_model.model." + name.removesuffix(".weight")
            if f"{key}.lora_A.weight" in delta:
                a, b = delta[f"{key}.lora_A.weight"], delta[f"{key}.lora_B.weight"]
                tensors[name] = (w.astype(np.float32) + scale * b @ a).astype(w.dtype)
        save_file(tensors, file, metadata={"format": "pt"})


def tokens_per_s(llm: LLM, prompts: list[list[int]], loras: list | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    return len(prompts) * NEW_TOKENS / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=str(ROOT / "configs/models/smollm2-135m.yaml"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    restart_with_huge_pages()
    model_dir = peers.checkpoint(args.preset, dtype=args.dtype)
    work = peers.cache_dir() / "lora" / model_dir.name
    adapters = []
    for i in range(NUM_ADAPTERS):
        d = work / f"adapter-{i}"
        if not (d / "adapter_config.json").is_file():
            write_adapter(model_dir, d, seed=i)
        adapters.append(LoRARequest(f"adapter-{i}", i + 1, str(d)))
    merged = work / "merged"
    write_merged(model_dir, Path(adapters[0].lora_path), merged)

    engine = yaml.safe_load((ROOT / "configs/engine/cpu.yaml").read_text())
    # No prefix cache: every round repeats the prompts, and the base and merged engines
    # would find theirs cached from the round before while the LoRA engine's are evicted
    # by its own "8 loras" pass (~0.75x for lora-off from that alone, 2026-12-02).
    engine.update(dtype=args.dtype, max_num_seqs=args.num_requests,
                  max_num_batched_tokens=max(engine["max_num_batched_tokens"], PROMPT_LEN),
                  enable_prefix_caching=False)
    lora = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
    rng = np.random.default_rng(0)
    vocab = ModelConfig.from_file(model_dir).vocab_size
    prompts = [rng.integers(3, vocab, PROMPT_LEN).tolist() for _ in range(args.num_requests)]
    mixed = [adapters[i % NUM_ADAPTERS] for i in range(args.num_requests)]
    runs = {  # name: (engine, per-request adapters)
        "base": (LLM(str(model_dir), **engine), None),
        "lora-off": (LLM(str(model_dir), **engine, **lora), None),
        "8 loras": None,
        "merged": (LLM(str(merged), **engine), None),
    }
    runs["8 loras"] = (runs["lora-off"][0], mixed)
    for llm, loras in runs.values():  # warm: adapters read, pages touched
        tokens_per_s(llm, prompts[:NUM_ADAPTERS], loras[:NUM_ADAPTERS] if loras else None)
    results = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, (llm, loras) in runs.items():
            results[name].append(tokens_per_s(llm, prompts, loras))
            print(f"round {r} {name:>9}: {results[name][-1]:8.1f} tok/s", flush=True)

    def cell(values: list[float]) -> str:
        return peers.median_range(values, 2)

    print(f"\nlora.py: {platform.node()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC, {Path(args.preset).stem} {args.dtype}, {args.num_requests} requests x "
          f"{PROMPT_LEN} + {NEW_TOKENS} tokens, {NUM_ADAPTERS} adapters of rank {RANK}, "
          f"{args.rounds} rounds (median [min-max])")
    print("| engine | output tokens/s | over base (same round) |\n|---|---|---|")
    for name, values in results.items():
        ratios = [v / b for v, b in zip(values, results["base"])]
        print(f"| {name} | {cell(values)} | {cell(ratios)} |")
    ratio = statistics.median(v / b for v, b in zip(results["8 loras"], results["base"]))
    print(f"\ntarget: 8 adapters >= 0.8x the base model's throughput: "
          f"{'met' if ratio >= 0.8 else 'missed'} ({ratio:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
