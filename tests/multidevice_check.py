"""Run the engine on 1 device, with tensor parallelism 2, 4, 8, with TP+SP, with data
parallelism (alone, with TP, with TP+SP) and with our Pallas kernels (interpret mode)
over 8 CPU devices; speculative decoding under TP and DP+TP; and a mixture of experts
under tensor, data and expert parallelism.

Started by tests/test_sharding.py in its own process (the device count is fixed when JAX
starts): `python tests/multidevice_check.py MODEL_DIR OUT.json [MOE_MODEL_DIR]`. Writes,
per mesh, the greedy tokens and top-5 logprobs of a batch of prompts, the collectives of
the compiled step (all-gathered shapes next to the parameters' full shapes, all-reduce and
reduce-scatter counts), and the shardings of q_proj and the KV cache.
"""

import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.config import ModelConfig
from jaxserve.engine.batch import BucketKey
from jaxserve.loading.converted import convert
from oracle_proposer import OracleProposer, OracleTreeProposer
from sharding.mesh import make_mesh
from sharding.rules import model_sharding

# One token bucket: every run compiles one forward program (two sampling ones), most of a
# run's time (the Pallas kernels' runs most of all: ~12 s a program in interpret mode).
ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(64,))
KERNELS = dict(kernel_impl="tpu", interpret_kernels=True)
# (mesh, strategy, extra engine settings, name suffix). The model has 2 KV heads: TP=2
# splits them; TP=4 and 8 store each on the 2 or 4 devices that read it. The Pallas
# kernels run per device under shard_map (with DP, per data shard too), the int8 matmul
# kernels too (column-split: no collective; row-split: psum, or psum_scatter under SP).
# The attention kernels at TP=2 and under DP+TP run in the int8 runs (with the matmul
# kernels beside them), at TP=8 with float weights.
RUNS = [(None, "tp", {}, ""), ({"model": 2}, "tp", {}, ""), ({"model": 4}, "tp", {}, ""),
        ({"model": 8}, "tp", {}, ""), ({"model": 4}, "tp+sp", {}, " tp+sp"),
        ({"model": 8}, "tp", KERNELS, " tpu-kernels"),
        ({"data": 2}, "dp", {}, " dp"), ({"data": 2, "model": 4}, "dp+tp", {}, " dp+tp"),
        ({"data": 2, "model": 4}, "dp+tp+sp", {}, " dp+tp+sp"),
        ({"data": 2, "model": 4}, "dp+tp", {"num_scheduler_steps": 4}, " dp+tp multi-step"),
        (None, "tp", {"quantization": "int8"}, " int8"),
        ({"model": 2}, "tp+sp", {**KERNELS, "quantization": "int8"}, " int8 tp+sp tpu-kernels"),
        ({"data": 2, "model": 4}, "dp+tp", {**KERNELS, "quantization": "int8"},
         " int8 dp+tp tpu-kernels"),
        (None, "tp", {"quantization": "int8", "lm_head_quantization": "int8"}, " int8 head"),
        ({"model": 4}, "tp", {"quantization": "int8", "lm_head_quantization": "int8"},
         " int8 head")]


def all_gather_shapes(hlo: str) -> list[list[int]]:
    shapes = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\][^ ]* all-gather(-start)?\(", line)
        if m:
            shapes.append([int(d) for d in m.group(1).split(",") if d])
    return shapes


def shapes_of(hlo: str, op: str) -> list[list[int]]:
    """The result shapes of every `op` (all-reduce, reduce-scatter) in the program."""
    return [[int(d) for d in m.group(1).split(",") if d]
            for m in re.finditer(rf"= \w+\[([\d,]*)\][^ ]* {op}(-start)?\(", hlo)]


def main(model_dir: str, out_path: str, moe_dir: str | None = None,
         gguf_files: list[str] = ()) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(1234)
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (5, 17, 30, 43)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    results = sharded_runs(model_dir, prompts, params)
    results.update(speculative_runs(model_dir, prompts, params, results))
    # A checkpoint converted on 4 devices (each KV head stored twice) holds one copy of each
    # head: served on 1 device and on 8 (4 copies) it gives the int8 tokens.
    cfg = ModelConfig.from_file(model_dir)
    out = Path(tempfile.mkdtemp()) / "converted"
    convert(model_dir, out, "float32", "int8",
            model_sharding(make_mesh({"model": 4}), "tp", cfg))
    for mesh in (None, {"model": 8}):
        llm = LLM(str(out), mesh=mesh, **ENGINE)
        results[f"converted {json.dumps(mesh)}"] = {
            "tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, params)]}
    if moe_dir:
        results.update(moe_runs(moe_dir, prompts, params))
    for path in gguf_files:  # files mixing block types: layers in several formats
        for mesh, strategy in GGUF_RUNS + (GGUF_MOE_RUNS if "moe" in Path(path).name else []):
            llm = LLM(path, mesh=mesh, sharding=strategy, **ENGINE)
            results[f"gguf {Path(path).name} {json.dumps(mesh)} {strategy}"] = {
                "tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, params)],
                "overrides": len(llm.engine.config.quant_overrides),
                "embed_from_lm_head": llm.engine.config.embed_from_lm_head,
                "leaked_pages": llm.engine.scheduler.num_used_pages}
    with open(out_path, "w") as f:
        json.dump(results, f)


def sharded_runs(model_dir: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Each mesh and strategy of RUNS: tokens, grammar-constrained texts, logprobs, and
    what the compiled step and the placed arrays look like."""
    # Grammar masks on a sharded step: a regex, a JSON Schema, and a free request beside.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    constrained = [SamplingParams(temperature=t, seed=3, max_tokens=24,
                                  structured_outputs=StructuredOutputsParams(**c))
                   for t, c in [(0.0, {"regex": "[a-z]{3,9}-[0-9]{2}"}), (0.0, {"json": schema}),
                                (0.8, {"regex": "[a-z]{3,9}-[0-9]{2}"})]]
    constrained.append(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    results = {}
    for mesh, strategy, extra, suffix in RUNS:
        llm = LLM(model_dir, mesh=mesh, sharding=strategy, **{**ENGINE, **extra})
        outs = llm.generate(prompts, params)
        shaped = llm.generate(prompts, constrained)
        runner = llm.engine.runner
        hlo = runner.compiled(BucketKey(64, 4, False)).as_text()
        results[json.dumps(mesh) + suffix] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "constrained": [o.outputs[0].text for o in shaped],
            "logprobs": [[{str(t): e.logprob for t, e in lp.items()} for lp in o.outputs[0].logprobs]
                         for o in outs],
            "all_gather_shapes": all_gather_shapes(hlo),
            "all_reduces": len(re.findall(r" all-reduce(-start)?\(", hlo)),
            "all_reduce_shapes": shapes_of(hlo, "all-reduce"),
            "reduce_scatter_shapes": shapes_of(hlo, "reduce-scatter"),
            "param_shapes": [list(x.shape) for x in jax.tree.leaves(runner.params) if x.ndim > 1],
            "kv_cache_sharding": str(runner.kv_caches[0][0].sharding.spec),
            "kv_cache_shape": list(runner.kv_caches[0][0].shape),
            "kv_cache_shard_shape": list(runner.kv_caches[0][0].addressable_shards[0].data.shape),
            "prompt_tokens_per_data_shard": [a.prefix_queries
                                             for a in llm.engine.scheduler.allocators],
            "q_proj_sharding": str(runner.params["layers"][0]["attn"]["q_proj"].value.sharding.spec),
            "k_proj_shard_shape": list(runner.params["layers"][0]["attn"]["k_proj"].value
                                       .addressable_shards[0].data.shape),
            "leaked_pages": llm.engine.scheduler.num_used_pages,
            "compiles_after_warmup": runner.compiles_after_warmup,
            "multi_steps": llm.engine.num_multi_steps,
        }
    return results


def speculative_runs(model_dir: str, prompts: list[list[int]], params: SamplingParams,
                     results: dict) -> dict:
    """Speculative decoding: drafts of the one-device tokens (every third proposal spoiled)
    verified in the sharded step, under TP, DP+TP and TP with int8 weights; and the target
    drafting for itself (a draft model sharded as the target), Medusa and EAGLE heads."""
    medusa_dir = repeat_token_medusa_heads(model_dir)
    eagle_dir = repeat_token_eagle_head(model_dir)
    out = {}
    for mesh, strategy, extra, suffix in SPEC_RUNS:
        words = suffix.split()
        method = next((m for m in ("draft", "medusa", "eagle") if m in words), "ngram")
        model = {"draft": model_dir, "medusa": medusa_dir, "eagle": eagle_dir}.get(method)
        tree = {"speculative_token_tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]]
                } if "tree" in words else {}
        llm = LLM(model_dir, mesh=mesh, sharding=strategy, **ENGINE, **extra,
                  speculative_config={"num_speculative_tokens": 3, "disable_by_batch_size": None,
                                      "model": model, **tree,
                                      "method": method.replace("draft", "draft_model")})
        one_device = results["null" + (" int8" if extra else "")]["tokens"]
        if method == "ngram":
            llm.engine.speculator.proposer = OracleProposer(list(zip(prompts, one_device)),
                                                            320, spoil=3)
        if method == "medusa" and tree:  # known branches, mostly outside their slots
            llm.engine.speculator.proposer = OracleTreeProposer(
                list(zip(prompts, one_device)), 320,
                llm.engine.speculator.config.speculative_token_tree, spoil=3)
        moved = count_moves(llm.engine.runner)
        stats = llm.engine.speculator.stats
        out[f"speculative {json.dumps(mesh)} {strategy}{suffix}"] = {
            "tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, params)],
            "proposed": stats.num_proposed, "accepted": stats.num_accepted,
            "medusa_lm_head_shard_shape": list(
                llm.engine.runner.medusa.lm_heads.addressable_shards[0].data.shape)
            if method == "medusa" else None,
            "moved": moved[0], "leaked_pages": llm.engine.scheduler.num_used_pages,
            "compiles_after_warmup": llm.engine.runner.compiles_after_warmup}
    return out


def moe_runs(moe_dir: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    """A mixture of experts (Qwen2-MoE: 8 experts, a shared expert, a dense layer): its
    experts split by MLP columns under tp, by whole experts under ep."""
    out = {}
    for mesh, strategy, extra, suffix in MOE_RUNS:
        llm = LLM(moe_dir, mesh=mesh, sharding=strategy, **{**ENGINE, **extra})
        runner = llm.engine.runner
        seqs = max(4, (mesh or {}).get("data", 1))  # a bucket's sequences divide over data
        hlo = runner.compiled(BucketKey(64, seqs, False)).as_text()
        moe = runner.params["layers"][0]["mlp"]
        out[f"moe {json.dumps(mesh)} {strategy}{suffix}"] = {
            "tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, params)],
            "leaked_pages": llm.engine.scheduler.num_used_pages,
            "compiles_after_warmup": runner.compiles_after_warmup,
            "all_gather_shapes": all_gather_shapes(hlo),
            "expert_shard_shapes": [list(moe[name].value.addressable_shards[0].data.shape)
                                    for name in ("gate_proj", "down_proj")]}
    return out


SPEC_RUNS = [({"model": 2}, "tp", {}, ""), ({"data": 2, "model": 2}, "dp+tp", {}, ""),
             ({"model": 2}, "tp", {"quantization": "int8"}, " int8"),
             ({"model": 2}, "tp", {}, " draft"), ({"data": 2, "model": 2}, "dp+tp", {}, " draft"),
             ({"model": 2}, "tp", {}, " medusa"),
             ({"data": 2, "model": 2}, "dp+tp", {}, " medusa tree"),
             ({"model": 2}, "tp", {}, " eagle"),
             ({"data": 2, "model": 2}, "dp+tp", {}, " eagle tree")]


def count_moves(runner) -> list[int]:
    """A counter of the K/V slots `runner` is asked to move (after trees' steps)."""
    moved, moves = [0], runner.moves

    def counting(todo):
        moved[0] += len(todo)
        return moves(todo)

    runner.moves = counting
    return moved


def repeat_token_medusa_heads(model_dir: str) -> str:
    """Three Medusa heads (published layout) that guess the token just sampled again:
    identity blocks, the target's LM head."""
    from safetensors.numpy import load_file, save_file

    lm_head = load_file(str(Path(model_dir) / "model.safetensors"))["lm_head.weight"]
    d = lm_head.shape[1]
    out = Path(tempfile.mkdtemp()) / "medusa"
    out.mkdir()
    tensors = {}
    for h in range(3):
        tensors |= {f"{h}.0.linear.weight": np.zeros((d, d), np.float32),
                    f"{h}.0.linear.bias": np.zeros(d, np.float32), f"{h}.1.weight": lm_head}
    save_file(tensors, str(out / "medusa_lm_head.safetensors"))
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    return str(out)


def repeat_token_eagle_head(model_dir: str) -> str:
    """An EAGLE-1 head (published layout) that guesses the token just sampled again: fc
    passes the target's final hidden state through, the layer adds zeros (its o_proj and
    down_proj), and the target's LM head reads it."""
    from safetensors.numpy import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    h, d = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    rng = np.random.default_rng(0)
    tensors = {"fc.weight": np.concatenate([np.zeros((h, h)), np.eye(h)], 1).astype(np.float32),
               "layers.0.post_attention_layernorm.weight": np.ones(h, np.float32),
               "layers.0.self_attn.o_proj.weight": np.zeros((h, h), np.float32),
               "layers.0.mlp.down_proj.weight": np.zeros((h, config["intermediate_size"]),
                                                         np.float32)}
    for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
                        ("self_attn.v_proj", (kv, h)),
                        ("mlp.gate_proj", (config["intermediate_size"], h)),
                        ("mlp.up_proj", (config["intermediate_size"], h))):
        tensors[f"layers.0.{name}.weight"] = rng.normal(0, 0.1, shape).astype(np.float32)
    out = Path(tempfile.mkdtemp()) / "eagle"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return str(out)

# (mesh, strategy, extra engine settings, name suffix); int4 experts (and attention, and the
# dense layer) quantized, on one device and with the TPU kernels per device under tp+ep.
MOE_RUNS = [(None, "tp", {}, ""), ({"model": 2}, "tp", {}, ""), ({"model": 4}, "tp+sp", {}, ""),
            ({"data": 2}, "dp", {}, ""), ({"data": 2, "model": 4}, "dp+tp", {}, ""),
            ({"model": 4}, "ep", {}, ""), ({"model": 2}, "tp+ep", {}, ""),
            ({"data": 2, "model": 4}, "dp+ep", {}, ""), ({"data": 2, "model": 2}, "dp+tp+ep", {}, ""),
            ({"data": 8}, "dp+ep", {"max_num_seqs": 8, "num_pages": 512}, ""),
            ({"model": 8}, "ep", {}, ""), (None, "tp", {"quantization": "int4"}, " int4"),
            ({"model": 4}, "tp+ep", {**KERNELS, "quantization": "int4"}, " int4 tpu-kernels")]

# {"model": 4}: the tiny models' row-split int4 o_proj (K = 64: two groups of 32) has
# fewer scale groups than devices (its scales whole on each, the reference's dot).
GGUF_RUNS = [(None, "tp"), ({"model": 2}, "tp"), ({"model": 4}, "tp"),
             ({"data": 2, "model": 2}, "dp+tp")]
GGUF_MOE_RUNS = [({"model": 2}, "ep"), ({"model": 2}, "tp+ep")]

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None, sys.argv[4:])
