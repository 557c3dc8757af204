"""Ahead-of-time compilation of the sharded step for a TPU v5e slice, on this CPU machine.

Needs libtpu (`pip install "jax[tpu]==<our jax>"`, in the dev extras), not a TPU.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")

from flax import nnx  # noqa: E402

from jaxserve.config import EngineConfig, ModelConfig  # noqa: E402
from jaxserve.engine.batch import BatchBuilder, BucketKey  # noqa: E402
from jaxserve.engine.speculative.eagle import draft  # noqa: E402
from jaxserve.engine.kv_memory import abstract_kv_cache  # noqa: E402
from jaxserve.engine.programs import FEATURE_AXES  # noqa: E402
from jaxserve.models.eagle import EagleHead  # noqa: E402
from jaxserve.loading.safetensors import abstract_model  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402
from sharding.planner import (  # noqa: E402
    collective_bytes, collectives, compile_step, no_persistent_cache, placed, tpu_devices)
from sharding.rules import ShardingContext, model_sharding, strategy_rules  # noqa: E402

CFG = ModelConfig(model_type="llama", architecture="LlamaForCausalLM", vocab_size=1024,
                  hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                  num_kv_heads=4, head_dim=32, max_position_embeddings=512)
ENGINE = EngineConfig(max_model_len=256, page_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                      token_buckets=(64,))
PAGES = 64
KEY = BucketKey(tokens=64, seqs=8, history=False)
# Llama-3-8B's dimensions with 2 layers: real tile-friendly shapes (TPU pads tiny minor
# dimensions to 8x128 tiles), compiled in seconds.
LLAMA3_8B_2L = ModelConfig.from_file("configs/models/llama3-8b.yaml").first_layers(2)


@pytest.fixture(scope="module")
def devices():
    return tpu_devices("v5e:2x2")


def sharded_weight_bytes(cfg: ModelConfig, devices) -> int:
    """Analytic per-chip weight bytes: a parameter with an axis on `model` is split 4 ways."""
    mesh = make_mesh({"model": 4}, devices=devices)
    rules = strategy_rules("tp", mesh, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
                           cfg.intermediate_size)
    _, abstract = abstract_model(cfg, jnp.bfloat16, ShardingContext(mesh, rules))
    total = 0
    for _, var in nnx.to_flat_state(abstract):
        split = any(a for a in rules.spec(var.get_metadata()["logical_axes"]))
        total += int(np.prod(var.shape)) * 2 // (4 if split else 1)
    return total


def test_tp_step_compiles_for_v5e_with_megatron_collectives(devices):
    compiled = compile_step(CFG, ENGINE, {"model": 4}, "tp", devices, PAGES, KEY)
    hidden = re.findall(r"= bf16\[64,256\]\S* all-reduce(?:-start)?\(", compiled.as_text())
    # One all-reduce after attention and one after the MLP per layer, plus the
    # vocabulary-parallel embedding lookup.
    assert len(hidden) == 2 * CFG.num_layers + 1
    assert "reduce-scatter" not in collectives(compiled)



def test_per_chip_memory_matches_analytic_count(devices):
    """Arguments per chip = weights x 2 bytes / 4 (split ones) + the chip's KV pages, within 3%."""
    cfg = LLAMA3_8B_2L
    engine = dataclasses.replace(ENGINE, max_model_len=1024)
    compiled = compile_step(cfg, engine, {"model": 4}, "tp", devices, PAGES, KEY)
    weights = sharded_weight_bytes(cfg, devices)
    kv = 2 * cfg.num_layers * PAGES * ENGINE.page_size * (cfg.num_kv_heads // 4) * cfg.head_dim * 2
    args = compiled.memory_analysis().argument_size_in_bytes
    assert abs(args - (weights + kv)) / (weights + kv) < 0.03, (args, weights, kv)
    assert weights < cfg.num_params() * 2 / 3  # the weights really are split


def hidden_state_collectives(compiled) -> collections.Counter:
    """(rows, op) of every collective on a [rows, hidden] bf16 array (the residual)."""
    return collections.Counter(re.findall(
        rf"= bf16\[(\d+),{CFG.hidden_size}\]\S* (reduce-scatter|all-gather|all-reduce)"
        r"(?:-start)?\(", compiled.as_text()))


def test_tp_sp_step_reduce_scatters_where_tp_all_reduces(devices):
    """Sequence parallelism turns each block's two all-reduces of the residual (64 tokens)
    into a reduce-scatter to 16-token shards and an all-gather back before the next
    column-split matmuls; only the vocabulary-parallel embedding is still all-reduced.
    Plain TP on the same mesh all-reduces all five (the test above)."""
    compiled = compile_step(CFG, ENGINE, {"model": 4}, "tp+sp", devices, PAGES, KEY)
    counts = hidden_state_collectives(compiled)
    layers = CFG.num_layers
    assert counts[("16", "reduce-scatter")] == 2 * layers
    assert counts[("64", "all-gather")] == 2 * layers
    assert counts[("64", "all-reduce")] == 1
    tp = hidden_state_collectives(compile_step(CFG, ENGINE, {"model": 4}, "tp", devices,
                                               PAGES, KEY))
    assert tp == collections.Counter({("64", "all-reduce"): 2 * layers + 1})


@pytest.mark.slow
def test_jaxserve_plan_cli(tmp_path, capsys):
    """`jaxserve plan` on Llama-3-8B dimensions (2 layers): the table's compiled weight bytes
    per chip match the analytic count, and the KV per token is 2 layers x K,V x 2 heads x
    128 x 2 bytes."""
    from jaxserve.cli import main

    preset = tmp_path / "llama3-8b-2l.yaml"
    text = open("configs/models/llama3-8b.yaml").read().replace("num_hidden_layers: 32",
                                                                   "num_hidden_layers: 2")
    preset.write_text(text)
    code = main(["plan", "--model", str(preset), "--topology", "v5e:2x2", "--max-model-len",
                 "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "128"])
    out = capsys.readouterr().out
    assert code == 0
    ratio = float(re.search(r"weights per chip \(analytic\)\s+\| [\d.]+ GiB \(ratio ([\d.]+)\)",
                            out).group(1))
    assert abs(ratio - 1.0) < 0.03
    assert re.search(r"KV cache per token per chip\s+\| 2\.0 KiB", out)
    assert re.search(r"decode step, 16 tokens: collectives\s+\| .*all-reduce x\d+", out)
    assert re.search(r"fits its seqs x max_model_len\s+\| yes", out)


@pytest.mark.slow
def test_plan_says_when_it_does_not_fit(monkeypatch):
    """With 0.7 GiB of HBM per chip, 0.69 GiB of weights leave room for too few KV tokens."""
    from sharding import plan_report, planner

    monkeypatch.setitem(planner.HBM_GIB, "v5e", 0.7)
    result = planner.plan(LLAMA3_8B_2L, "v5e:2x2", max_model_len=1024, max_num_seqs=16,
                          max_num_batched_tokens=128)
    assert not result["fits"]
    assert result["kv_tokens_that_fit"] < result["wanted_kv_tokens"]
    assert "| NO (16,384 tokens wanted)" in plan_report.format_plan(result)


@pytest.mark.slow
@pytest.mark.parametrize("topology,quant", [
    ("v5e:2x2", {}),
    ("v5e:2x2", dict(quantization="int8", kv_cache_dtype="int8", page_size=32)),
    ("v6e:2x2", dict(quantization="int4", kv_cache_dtype="fp8", page_size=32)),
    # An AWQ checkpoint's layout: int4 by groups of 128 with zero points.
    ("v5e:2x2", dict(quantization="int4", quant_zero_points=True)),
])
def test_engine_step_compiles_with_pallas_kernels(topology, quant):
    """The forward pass of Llama-3-8B's dimensions (2 layers) on one chip runs our Mosaic
    kernels: two ragged paged attention calls per layer (one for decode work items, one for
    prefill items, each under its own branch) and, quantized, one matmul per linear layer
    (q, k, v, o, gate, up, down); the weights stay quantized in HBM (with zero points, a
    float32 zero point beside each group's scale)."""
    cfg = dataclasses.replace(LLAMA3_8B_2L, vocab_size=1024)  # linear layers dominate
    chip = tpu_devices(topology)[:1]
    engine = dataclasses.replace(ENGINE, max_model_len=1024, **quant)
    compiled = compile_step(cfg, engine, {"model": 1}, "tp", chip, PAGES, KEY)
    kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    assert kernels == cfg.num_layers * (2 + (7 if "quantization" in quant else 0))
    e, m, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    linear = 2 * e * (cfg.num_heads + cfg.num_kv_heads) * d + 3 * e * m  # weights per layer
    bits = {None: 16, "int8": 8, "int4": 4}[quant.get("quantization")]
    group_scales = linear // 128 * 4 if bits == 4 else 0  # float32 per 128 rows
    group_scales *= 2 if quant.get("quant_zero_points") else 1  # and a zero point
    kv_bytes = 1 if "kv_cache_dtype" in quant else 2
    kv = 2 * cfg.num_kv_heads * PAGES * engine.page_size * d * kv_bytes
    expected = cfg.num_layers * (linear * bits // 8 + group_scales + kv) + 2 * cfg.vocab_size * e * 2
    args = compiled.memory_analysis().argument_size_in_bytes
    assert abs(args - expected) / expected < 0.03, (args, expected)  # + norms, channel scales


@pytest.mark.slow  # ~35 s of compiling
def test_the_scoring_step_compiles_on_a_v5e_mesh(devices):
    """Prompt logprobs' program (the step's forward pass scoring each of its 256 tokens
    against Llama 3's 128k vocabulary, split over 4 chips) compiles with the attention
    kernels, and its extra temporaries per chip are a small part of the batch's float32
    logits (32.8 MB a chip; 1 MB measured)."""
    cfg = dataclasses.replace(LLAMA3_8B_2L, vocab_size=128256)
    key = BucketKey(tokens=256, seqs=8, history=False)
    engine = dataclasses.replace(ENGINE, max_model_len=1024, max_num_batched_tokens=256,
                                 token_buckets=(256,))
    plain, scoring = (compile_step(cfg, engine, {"model": 4}, "tp", devices, PAGES, key,
                                   scores=scores) for scores in (False, True))
    assert scoring.as_text().count('custom_call_target="tpu_custom_call"') == \
        plain.as_text().count('custom_call_target="tpu_custom_call"') == 2 * cfg.num_layers
    extra = (scoring.memory_analysis().temp_size_in_bytes
             - plain.memory_analysis().temp_size_in_bytes)
    logits = key.tokens * cfg.vocab_size // 4 * 4
    assert 0 < extra < logits / 8, (extra, logits)


@pytest.mark.slow  # ~30 s of compiling
def test_the_pooling_step_compiles_on_a_v5e_mesh(devices):
    """Embeddings' and classification's program (the step's forward pass also summing its
    pool segments' final hidden states) compiles with the attention kernels over 4
    chips: it returns each row's float32 sums besides, and its extra temporaries per
    chip are smaller than those."""
    key = BucketKey(tokens=256, seqs=8, history=False)
    engine = dataclasses.replace(ENGINE, max_model_len=1024, max_num_batched_tokens=256,
                                 token_buckets=(256,))
    plain, pooling = (compile_step(LLAMA3_8B_2L, engine, {"model": 4}, "tp", devices, PAGES,
                                   key, pools=pools) for pools in (False, True))
    assert pooling.as_text().count('custom_call_target="tpu_custom_call"') == \
        plain.as_text().count('custom_call_target="tpu_custom_call"') == \
        2 * LLAMA3_8B_2L.num_layers
    sums = (pooling.memory_analysis().output_size_in_bytes
            - plain.memory_analysis().output_size_in_bytes)
    assert sums == key.seqs * LLAMA3_8B_2L.hidden_size * 4  # [rows, hidden] float32
    extra = (pooling.memory_analysis().temp_size_in_bytes
             - plain.memory_analysis().temp_size_in_bytes)
    assert 0 <= extra <= sums, (extra, sums)  # (7.5 KB measured)


@pytest.mark.slow
def test_a_quantized_lm_head_runs_the_tpu_kernel():
    """`lm_head_quantization`: the LM head is one more Mosaic matmul of the step, and the
    chip holds it int8 (with a float32 scale per column) where it held bfloat16."""
    cfg = dataclasses.replace(LLAMA3_8B_2L, vocab_size=1024)
    chip = tpu_devices("v5e:2x2")[:1]
    sizes = {}
    for head in (None, "int8"):
        engine = dataclasses.replace(ENGINE, max_model_len=1024, quantization="int8",
                                     lm_head_quantization=head)
        compiled = compile_step(cfg, engine, {"model": 1}, "tp", chip, PAGES, KEY)
        kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
        assert kernels == cfg.num_layers * (2 + 7) + (head is not None)
        sizes[head] = compiled.memory_analysis().argument_size_in_bytes
    e, v = cfg.hidden_size, cfg.vocab_size
    assert sizes[None] - sizes["int8"] == e * v * 2 - (e * v + 4 * v)


@pytest.mark.parametrize("strategy,quantization", [("tp+sp", "int4"), ("tp", "int8")])
def test_quantized_kernels_run_per_chip_on_a_mesh(devices, strategy, quantization):
    """On 4 v5e chips every linear layer runs our Mosaic matmul per chip under shard_map
    (XLA cannot partition a kernel): 7 matmul kernels + 2 attention kernels (decode and
    prefill items) per layer on each chip. Row-split layers (o, down) sum their partial
    products: all-reduce under TP, reduce-scatter to token shards under TP+SP, with int4
    groups (128 rows) split whole."""
    cfg = dataclasses.replace(LLAMA3_8B_2L, vocab_size=1024)
    engine = dataclasses.replace(ENGINE, max_model_len=1024, quantization=quantization)
    compiled = compile_step(cfg, engine, {"model": 4}, strategy, devices, PAGES, KEY)
    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == cfg.num_layers * 9
    hidden = rf"= bf16\[(\d+),{cfg.hidden_size}\]\S* (reduce-scatter|all-reduce)(?:-start)?\("
    found = [(int(t), op) for t, op in re.findall(hidden, text)]
    if strategy == "tp+sp":
        assert found.count((16, "reduce-scatter")) == 2 * cfg.num_layers
    else:
        assert found.count((64, "all-reduce")) >= 2 * cfg.num_layers


@pytest.mark.slow
@pytest.mark.parametrize("strategy,quantization", [("ep", None), ("tp+ep", None), ("tp", None),
                                                  ("tp+ep", "int8")])
def test_mixture_of_experts_step_compiles_for_v5e(devices, strategy, quantization):
    """Qwen3-30B-A3B's dimensions (2 layers, 128 experts of 768) on 4 v5e chips with our
    attention and grouped-matmul kernels: under ep / tp+ep a chip holds 32 whole experts,
    under tp a quarter of every expert's MLP; either way each MoE layer ends in one
    all-reduce of the hidden state over the chips and no expert weight is all-gathered.
    int8 experts stay int8 in HBM (the kernel dequantizes blocks in VMEM)."""
    cfg = dataclasses.replace(
        ModelConfig.from_file("configs/models/qwen3-30b-a3b.yaml").first_layers(2),
        vocab_size=1024)
    engine = dataclasses.replace(ENGINE, max_model_len=1024, quantization=quantization)
    compiled = compile_step(cfg, engine, {"model": 4}, strategy, devices, PAGES, KEY)
    text = compiled.as_text()
    kernels = re.findall(r"%([a-z_-]+)[.\d]* = .*custom_call_target=\"tpu_custom_call\"", text)
    # Ours: attention (decode and prefill items), one grouped matmul per expert projection
    # (gate, up, down) and, quantized, one matmul per attention projection (q, k, v, o).
    assert kernels.count("ragged_paged_attention") == cfg.num_layers * 2, kernels
    assert kernels.count("grouped_matmul") == cfg.num_layers * 3, kernels
    assert not [k for k in kernels if "ragged-dot" in k], kernels  # not XLA's lowering
    assert kernels.count("quantized_matmul") == cfg.num_layers * 4 * bool(quantization)
    gathers = [[int(d) for d in g.split(",") if d] for g in
               re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", text)]
    e, m = cfg.hidden_size, cfg.moe_intermediate_size
    weight_like = [g for g in gathers if e in g and ({m, m // 4} & set(g))]
    assert not weight_like, gathers  # no expert weight, whole or split
    reduces = re.findall(rf"= bf16\[64,{cfg.hidden_size}\]\S* all-reduce(?:-start)?\(", text)
    attention = 0 if strategy == "ep" else 1  # o_proj's all-reduce under tp
    assert len(reduces) >= cfg.num_layers * (1 + attention)
    experts = 128 // 4 if "ep" in strategy else 128
    weight_bytes = 1 if quantization else 2
    per_chip = 3 * experts * e * m * weight_bytes // (1 if "ep" in strategy else 4)
    args = compiled.memory_analysis().argument_size_in_bytes
    assert args > cfg.num_layers * per_chip
    if quantization:  # int8 experts, not bf16 ones, are what the chip holds
        assert args < cfg.num_layers * 2 * per_chip


def test_gpt_oss_120b_expert_stacks_reach_the_kernel_as_placed(devices):
    """gpt-oss-120b's fp4 experts (one layer, one chip): its u8[128, 1440, 2880] stacks
    and bf16[128, 90, 2880] scales are parameters in the row-major layout the grouped
    kernel reads (sharding/layouts.py), not the TPU's default for those shapes (experts
    minor), so the step copies none of them: before, each call copied every stack (526
    MB of temp for the layer's three)."""
    cfg = dataclasses.replace(
        ModelConfig.from_file("configs/models/gpt-oss-120b.yaml").first_layers(1),
        vocab_size=1024)
    engine = dataclasses.replace(ENGINE, quantization="fp4")
    compiled = compile_step(cfg, engine, {"model": 1}, "tp", devices[:1], PAGES, KEY)
    text = compiled.as_text()
    stacks = re.findall(r"= (?:u8|bf16)\[128,(?:1440|90),\d+\]\S* copy\(", text)
    assert not stacks, stacks
    formats = [f for f in jax.tree.leaves(compiled.input_formats)
               if getattr(f, "layout", None) is not None]
    three_d = [f.layout.major_to_minor for f in formats if len(f.layout.major_to_minor) == 3]
    assert three_d and set(three_d) == {(0, 1, 2)}
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20


def test_gpt_oss_under_ep_all_reduces_the_hidden_state_alone(devices):
    """gpt-oss-120b's dimensions (2 layers, fp4 experts) on 4 v5e chips under ep: each MoE
    layer's one collective is the all-reduce of its partial sums, [tokens, hidden], the
    experts' down biases included (gathered where each token is: before, a masked gather
    from the chips' own experts and an all-reduce of [tokens, top_k, hidden] more)."""
    cfg = dataclasses.replace(
        ModelConfig.from_file("configs/models/gpt-oss-120b.yaml").first_layers(2),
        vocab_size=1024)
    engine = dataclasses.replace(ENGINE, quantization="fp4")
    compiled = compile_step(cfg, engine, {"model": 4}, "ep", devices, PAGES, KEY)
    assert collective_bytes(compiled.as_text()) == {
        "all-reduce": (cfg.num_layers, cfg.num_layers * KEY.tokens * cfg.hidden_size * 2)}


@pytest.mark.slow
def test_gemma2_soft_caps_compile_with_the_attention_kernel():
    """Gemma 2's attention soft-cap and sliding window go to our Mosaic kernel (2 calls a
    layer), its final soft-cap into the logits."""
    cfg = dataclasses.replace(
        ModelConfig.from_file("configs/models/gemma2-9b.yaml").first_layers(2), vocab_size=1024)
    engine = dataclasses.replace(ENGINE, max_model_len=1024)
    compiled = compile_step(cfg, engine, {"model": 1}, "tp", tpu_devices("v5e:2x2")[:1],
                            PAGES, KEY)
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 4
    assert "tanh" in compiled.as_text()


@pytest.mark.slow
@pytest.mark.parametrize("mesh, strategy", [({"model": 4}, "tp"),
                                            ({"data": 2, "model": 2}, "dp+tp")])
def test_a_step_verifying_draft_trees_compiles_with_the_attention_kernel(devices, mesh,
                                                                         strategy):
    """A bucket verifying Medusa trees (tree starts and masks in its attention metadata,
    split over data shards) on 4 v5e chips: our Mosaic attention kernel (2 calls a layer)
    takes two operands more than in a bucket of chains, the trees."""
    cfg = dataclasses.replace(LLAMA3_8B_2L, vocab_size=1024)
    engine = dataclasses.replace(ENGINE, max_model_len=1024)
    tree = KEY._replace(drafts=7, tree=True)

    def kernel_operands(key: BucketKey) -> list[int]:
        text = compile_step(cfg, engine, mesh, strategy, devices, PAGES, key).as_text()
        return [len(call.split(", ")) for call in re.findall(
            r"custom-call\((.*?)\), custom_call_target=\"tpu_custom_call\"", text)]

    trees, chains = kernel_operands(tree), kernel_operands(tree._replace(tree=False))
    assert len(trees) == len(chains) == cfg.num_layers * 2
    assert [n - 2 for n in trees] == chains


@pytest.mark.slow
@pytest.mark.parametrize("mesh, strategy", [({"model": 4}, "tp"),
                                            ({"data": 2, "model": 2}, "dp+tp")])
def test_an_eagle_head_drafting_trees_compiles_with_the_attention_kernel(devices, mesh,
                                                                         strategy):
    """EAGLE-1's drafting program with a tree of 3 depths on 4 v5e chips: our Mosaic
    attention kernel (2 calls) in round 1 and in each of the 2 rounds that feed a depth's
    nodes, those with the two tree operands more."""
    cfg = dataclasses.replace(LLAMA3_8B_2L, vocab_size=1024)
    head_cfg = cfg.first_layers(1)
    shard = model_sharding(make_mesh(mesh, devices=devices), strategy, cfg)
    target_graphdef, target = abstract_model(cfg, jnp.bfloat16, shard)
    graphdef, head = nnx.split(nnx.eval_shape(lambda: EagleHead(
        head_cfg, 1, cfg.hidden_size, True, cfg.vocab_size, jnp.bfloat16, shard)))
    builder = BatchBuilder((64,), 8, 16, PAGES, 64, 1024, (), cfg.vocab_size,
                           shard.data_shards, draft_model=True)
    replicated = shard.sharding(())
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         dataclasses.replace(builder.empty(KEY), sampling=None, history=None))
    pages = PAGES * shard.data_shards
    kv = abstract_kv_cache(head_cfg, pages, 16, jnp.bfloat16, shard)[0]
    features = jax.ShapeDtypeStruct((pages * 16, cfg.hidden_size), jnp.bfloat16,
                                     sharding=shard.sharding(FEATURE_AXES))
    limits = jax.ShapeDtypeStruct((KEY.seqs,), jnp.int32, sharding=replicated)
    tree = ((0,), (0, 0), (0, 0, 0), (0, 1), (1,), (1, 0))
    program = jax.jit(functools.partial(draft, rounds=0, max_num_seqs=8, page_size=16,
                                        drop_slot=PAGES * 16, tree=tree),
                      static_argnums=(0, 2))
    with no_persistent_cache(), jax.default_device(devices[0]):
        text = program.lower(graphdef, placed(head, shard), target_graphdef,
                             placed(target, shard), kv, features, batch,
                             limits, None).compile().as_text()
    operands = [len(call.split(", ")) for call in re.findall(
        r"custom-call\((.*?)\), custom_call_target=\"tpu_custom_call\"", text)]
    chain = min(operands)  # round 1's calls
    assert sorted(operands) == [chain] * 2 + [chain + 2] * 4


@pytest.mark.slow
@pytest.mark.parametrize("mesh, strategy", [({"model": 4}, "tp+ep"), ({"data": 4}, "dp+ep")])
def test_deepseek_v3_latent_attention_and_grouped_experts_compile_for_v5e(devices, mesh,
                                                                          strategy):
    """DeepSeek-V3's dimensions (a dense layer and a MoE one of 256 experts; 128 heads of
    latent attention) on 4 v5e chips, 64 whole experts per chip through our grouped-matmul
    kernel, no expert weight gathered, attention in our Mosaic kernel. tp+ep: the heads
    split, each chip caching the 576-wide latent of every token (one of 4 copies).
    dp+ep (data-parallel attention): each chip its own requests, latent pages and
    attention, its experts serving all 4 shards' tokens (all-gathered over `data`, [64,
    hidden], and the sums reduce-scattered back, [16, hidden]). The attention kernel
    takes the latent pool once, as K and V."""
    cfg = dataclasses.replace(
        ModelConfig.from_file("configs/models/deepseek-v3.yaml").first_layers(2),
        vocab_size=1024, sparse_layers=(False, True))
    engine = dataclasses.replace(ENGINE, max_model_len=1024)
    shard = model_sharding(make_mesh(mesh, devices=devices), strategy, cfg)
    caches = abstract_kv_cache(cfg, PAGES * shard.data_shards, engine.page_size, jnp.bfloat16,
                               shard)
    assert [len(layer) for layer in caches] == [1, 1]  # one pool, both K and V
    pages = caches[0][0]
    copies = 1 if shard.data_shards > 1 else 4
    assert pages.shape == (copies, PAGES * 4 // copies, engine.page_size, 576)
    assert pages.sharding.shard_shape(pages.shape) == (1, PAGES, engine.page_size, 576)
    compiled = compile_step(cfg, engine, mesh, strategy, devices, PAGES, KEY)
    text = compiled.as_text()
    kernels = re.findall(r"%([a-z_-]+)[.\d]* = .*custom_call_target=\"tpu_custom_call\"", text)
    assert kernels.count("grouped_matmul") == 3, kernels
    assert kernels.count("ragged_paged_attention") == cfg.num_layers * 2, kernels
    # The latent pool goes in once (V is K): 5 scalar-prefetch operands, the queries, it.
    operands = [len(re.search(r"custom-call\((.*?)\), custom_call_target", line)[1].split(", "))
                for line in text.splitlines()
                if "tpu_custom_call" in line and "ragged_paged_attention" in line]
    assert operands == [7] * len(operands) and operands, operands
    collectives = {op: [[int(d) for d in g.split(",") if d] for g in re.findall(
        rf"= \w+\[([\d,]*)\]\S* {op}(?:-start)?\(", text)]
        for op in ("all-gather", "reduce-scatter")}
    e, m = cfg.hidden_size, cfg.moe_intermediate_size
    assert not [g for g in collectives["all-gather"] if e in g and m in g], collectives
    if shard.data_shards > 1:
        assert [KEY.tokens, e] in collectives["all-gather"], collectives
        assert [KEY.tokens // 4, e] in collectives["reduce-scatter"], collectives
    # Per chip: 64 of the 256 experts, a quarter of the heads' weights or all of them.
    args = compiled.memory_analysis().argument_size_in_bytes
    experts = 3 * 64 * e * m * 2
    assert experts < args < experts + 2 * 1024**3
