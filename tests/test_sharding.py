"""Tensor, sequence and data parallelism over 8 CPU devices give the single-device tokens.

The runs happen in a subprocess (tests/multidevice_check.py) started with 8 CPU devices;
it compiles every mesh's programs (~5 min on 2 cores), so the file is marked slow: CI runs it
after the default run (`pytest -q -m slow`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    import torch
    from test_gguf import GGUF_MESH_MIX, family_config, write_family_gguf, write_tiny_gguf

    path, model = checkpoints("llama8")
    moe, _ = checkpoints("qwen2_moe")
    out = tmp_path_factory.mktemp("tp") / "runs.json"
    ggufs = [out.parent / "mix.gguf", out.parent / "moe-mix.gguf", out.parent / "tied.gguf"]
    write_tiny_gguf(model, ggufs[0], "Q4_0", layer_types=GGUF_MESH_MIX)  # 3 formats
    write_tiny_gguf(checkpoints("qwen2")[1], ggufs[2], "Q8_0", arch="qwen2")  # lookups: head
    cls, cfg = family_config("qwen2_moe")  # rows of multiples of 32, as Q4_0 needs
    torch.manual_seed(0)
    write_family_gguf(cls(cfg).eval(), ggufs[1], "Q4_0", layer_types=GGUF_MESH_MIX)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    script = Path(__file__).parent / "multidevice_check.py"
    proc = subprocess.run([sys.executable, str(script), str(path), str(out), str(moe),
                           *map(str, ggufs)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mesh", ['{"model": 2}', '{"model": 4}', '{"model": 8}',
                                  '{"model": 4} tp+sp', '{"model": 8} tpu-kernels',
                                  '{"data": 2} dp', '{"data": 2, "model": 4} dp+tp',
                                  '{"data": 2, "model": 4} dp+tp+sp',
                                  '{"data": 2, "model": 4} dp+tp multi-step'])
def test_tensor_parallel_matches_one_device(runs, mesh):
    compare_runs(runs["null"], runs[mesh])
    # Several decode steps per program (programs.decode_steps) ran on the mesh.
    assert (runs[mesh]["multi_steps"] > 0) == ("multi-step" in mesh)


@pytest.mark.parametrize("mesh", ['{"model": 2} int8 tp+sp tpu-kernels',
                                  '{"data": 2, "model": 4} int8 dp+tp tpu-kernels'])
def test_quantized_matmul_kernels_per_device_match_one_device(runs, mesh):
    """int8 weights with the Pallas matmul kernels under shard_map (the attention kernel
    beside them, at TP=2 and under DP+TP) give the tokens of int8 weights on one device
    (reference dequantize-and-dot and attention); under SP the row-split
    kernels' partial products are reduce-scattered to token shards (2 per layer)."""
    compare_runs(runs["null int8"], runs[mesh])
    if "tp+sp" in mesh:
        assert runs[mesh]["reduce_scatter_shapes"] == [[32, 64]] * 4


def test_quantized_lm_head_on_a_mesh_matches_one_device(runs):
    """An int8 LM head, its vocabulary split over `model` (the quantized matmul per device
    under shard_map, no collective), gives one device's tokens and logprobs."""
    compare_runs(runs["null int8 head"], runs['{"model": 4} int8 head'])


@pytest.mark.parametrize("run", ['mix.gguf {"model": 2} tp', 'mix.gguf {"model": 4} tp',
                                 'mix.gguf {"data": 2, "model": 2} dp+tp',
                                 'moe-mix.gguf {"model": 2} tp',
                                 'moe-mix.gguf {"data": 2, "model": 2} dp+tp',
                                 'moe-mix.gguf {"model": 2} ep', 'moe-mix.gguf {"model": 2} tp+ep',
                                 'tied.gguf {"model": 2} tp',
                                 'tied.gguf {"data": 2, "model": 2} dp+tp'])
def test_gguf_files_on_a_mesh_match_one_device(runs, run):
    """A GGUF file whose layers (experts' stacks too) are held in three formats (int4 in
    groups of 32, int8 in groups of 32, int8 in groups of 32 with zero points; int4
    row-split weights keep whole groups on each device, or on 4 devices, fewer groups
    than devices, hold their scales whole on each), and a tied one whose token
    lookups read its quantized head (vocabulary split over `model`): one device's greedy
    tokens on tensor-, data- and expert-parallel meshes."""
    name = run.split()[0]
    one, sharded = runs[f"gguf {name} null tp"], runs[f"gguf {run}"]
    assert one["overrides"] == sharded["overrides"]
    assert (one["overrides"] > 0) == (name != "tied.gguf")
    assert one["embed_from_lm_head"] == sharded["embed_from_lm_head"] == (name == "tied.gguf")
    assert sharded["tokens"] == one["tokens"] and sharded["leaked_pages"] == 0


@pytest.mark.parametrize("run", ['{"model": 2} tp', '{"data": 2, "model": 2} dp+tp',
                                 '{"model": 2} tp int8'])
def test_speculative_decoding_matches_one_device(runs, run):
    """Drafts (the one-device tokens, every third proposal spoiled) verified in the
    sharded step: the one-device tokens, some drafts accepted and some rejected."""
    result = runs["speculative " + run]
    assert result["tokens"] == runs["null int8" if "int8" in run else "null"]["tokens"]
    assert 0 < result["accepted"] < result["proposed"]
    assert result["leaked_pages"] == 0 and result["compiles_after_warmup"] == 0


@pytest.mark.parametrize("run", ['{"model": 2} tp medusa',
                                 '{"data": 2, "model": 2} dp+tp medusa tree'])
def test_medusa_heads_under_tensor_and_data_parallelism(runs, run):
    """Heads that guess the last token again on a sharded target; trees (an oracle's, of
    the one-device tokens along random branches, every third spoiled) with their masks
    split over data shards, and their accepted nodes' K/V moved into place on each
    shard: the one-device tokens. The heads' LM heads are split over the vocabulary as
    the target's is (3 heads x hidden 64 x 320 tokens, half per device)."""
    result = runs["speculative " + run]
    assert result["tokens"] == runs["null"]["tokens"]
    assert 0 < result["accepted"] < result["proposed"]
    assert (result["moved"] > 10) == ("tree" in run)
    assert result["medusa_lm_head_shard_shape"] == [3, 64, 160]
    assert result["leaked_pages"] == 0 and result["compiles_after_warmup"] == 0


@pytest.mark.parametrize("run", ['{"model": 2} tp eagle',
                                 '{"data": 2, "model": 2} dp+tp eagle tree'])
def test_an_eagle_head_under_tensor_and_data_parallelism(runs, run):
    """An EAGLE-1 head that reads the target's features straight through (it guesses the
    token just sampled again) on a sharded target, the features split over data shards,
    as a chain and as a tree (its rounds' masks split over data shards too): the
    one-device tokens, with drafts accepted where the output repeats."""
    result = runs["speculative " + run]
    assert result["tokens"] == runs["null"]["tokens"]
    assert 0 < result["accepted"] < result["proposed"]
    assert result["leaked_pages"] == 0 and result["compiles_after_warmup"] == 0


@pytest.mark.parametrize("run", ['{"model": 2} tp draft', '{"data": 2, "model": 2} dp+tp draft'])
def test_a_sharded_draft_model_equal_to_the_target_accepts_every_token(runs, run):
    result = runs["speculative " + run]
    assert result["tokens"] == runs["null"]["tokens"]
    assert 0 < result["accepted"] == result["proposed"]
    assert result["leaked_pages"] == 0 and result["compiles_after_warmup"] == 0


def test_converted_checkpoint_keeps_one_copy_per_kv_head(runs):
    """Converted on 4 devices (2 KV heads stored twice), restored on 1 and on 8 devices
    (4 copies): the tokens of int8 weights quantized at load."""
    want = runs["null int8"]["tokens"]
    assert runs["converted null"]["tokens"] == want
    assert runs['converted {"model": 8}']["tokens"] == want


def test_constrained_outputs_hold_on_one_device(runs):
    """The reference the sharded runs must equal keeps to its constraints."""
    regex, as_json, sampled, free = runs["null"]["constrained"]
    assert re.fullmatch("[a-z]{3,9}-[0-9]{2}", regex) and re.fullmatch("[a-z]{3,9}-[0-9]{2}",
                                                                       sampled)
    assert set(json.loads(as_json)) == {"n"} and json.loads(as_json)["n"] <= 99
    assert not re.fullmatch("[a-z]{3,9}-[0-9]{2}", free)


@pytest.mark.parametrize("mesh, strategy, expert_shards", [
    ('{"model": 2}', "tp", [[8, 64, 16], [8, 16, 64]]),  # every expert's MLP split
    ('{"model": 4}', "tp+sp", [[8, 64, 8], [8, 8, 64]]),
    ('{"data": 2}', "dp", [[8, 64, 32], [8, 32, 64]]),
    ('{"data": 2, "model": 4}', "dp+tp", [[8, 64, 8], [8, 8, 64]]),
    ('{"model": 4}', "ep", [[2, 64, 32], [2, 32, 64]]),  # whole experts per device
    ('{"model": 8}', "ep", [[1, 64, 32], [1, 32, 64]]),
    ('{"model": 2}', "tp+ep", [[4, 64, 32], [4, 32, 64]]),
    # Data and expert parallelism: the data shards share one copy of the experts, split
    # over all 8 / 4 devices; {"data": 8}: each device its own requests (DP attention).
    ('{"data": 2, "model": 4}', "dp+ep", [[1, 64, 32], [1, 32, 64]]),
    ('{"data": 2, "model": 2}', "dp+tp+ep", [[2, 64, 32], [2, 32, 64]]),
    ('{"data": 8}', "dp+ep", [[1, 64, 32], [1, 32, 64]])])
def test_mixture_of_experts_on_a_mesh_matches_one_device(runs, mesh, strategy, expert_shards):
    """Qwen2-MoE (8 experts, a shared expert, a dense layer) under tensor, sequence, data
    and expert parallelism (EP 2, 4, 8) gives the single-device greedy tokens; each device
    holds its share of the expert weights, and the compiled step never all-gathers them
    (under dp+ep the data shards' tokens are gathered instead: 2-D)."""
    one, run = runs["moe null tp"], runs[f"moe {mesh} {strategy}"]
    assert run["tokens"] == one["tokens"]
    assert run["leaked_pages"] == 0 and run["compiles_after_warmup"] == 0
    assert run["expert_shard_shapes"] == expert_shards
    assert all(len(shape) < 3 for shape in run["all_gather_shapes"]), run["all_gather_shapes"]


def test_int4_experts_with_kernels_on_a_mesh_match_one_device(runs):
    """int4 Qwen2-MoE (experts, shared expert, attention and the dense layer quantized)
    under tp+ep on 4 devices, the TPU kernels (interpret mode) per device, gives the
    int4 single-device greedy tokens; each device holds 2 whole experts, still packed
    (int4: half the rows in bytes). Its attention and dense layers have K <= 128, one int4
    group that a K split would cut: those run the partitioned reference instead."""
    one, run = runs["moe null tp int4"], runs['moe {"model": 4} tp+ep int4 tpu-kernels']
    assert run["tokens"] == one["tokens"]
    assert run["leaked_pages"] == 0 and run["compiles_after_warmup"] == 0
    assert run["expert_shard_shapes"] == [[2, 32, 32], [2, 16, 64]]


def compare_runs(one, tp):
    assert tp["tokens"] == one["tokens"]
    assert tp["constrained"] == one["constrained"]  # grammar masks on the sharded step
    # float32 logprobs: sharded matmuls sum in a different order; 1e-4 as in test_parity.
    for seq_one, seq_tp in zip(one["logprobs"], tp["logprobs"]):
        for step_one, step_tp in zip(seq_one, seq_tp):
            assert step_one.keys() == step_tp.keys()
            for t in step_one:
                assert abs(step_one[t] - step_tp[t]) < 1e-4
    assert tp["leaked_pages"] == 0 and tp["compiles_after_warmup"] == 0


@pytest.mark.parametrize("mesh,kv_spec,cache_heads", [
    ('{"model": 2}', "P('model', None, None, None)", 2),
    ('{"model": 4}', "P('model', None, None, None)", 4),
    ('{"model": 8}', "P('model', None, None, None)", 8)])
def test_weights_split_not_gathered(runs, mesh, kv_spec, cache_heads):
    """q_proj is split by heads; the 2 KV heads are split at TP=2, and beyond that each is
    stored once per device that reads it (cache heads = TP), so every device holds one
    [pages, page_size, head_dim] slab; the compiled step all-reduces and never
    all-gathers a weight back to its full shape."""
    tp = runs[mesh]
    assert tp["q_proj_sharding"] == "P(None, 'model', None)"
    assert tp["kv_cache_sharding"] == kv_spec
    assert tp["kv_cache_shape"][0] == cache_heads
    devices = json.loads(mesh)["model"]
    assert tp["kv_cache_shard_shape"] == [cache_heads // devices] + tp["kv_cache_shape"][1:]
    # k_proj [embed, cache heads, head_dim]: each device holds its own head(s) only.
    assert tp["k_proj_shard_shape"][1] == cache_heads // devices
    assert tp["all_reduces"] >= 2 * 2  # attention out and MLP down, per layer
    full = {tuple(s) for s in tp["param_shapes"]}
    assert not [s for s in tp["all_gather_shapes"] if tuple(s) in full]


@pytest.mark.parametrize("name", ['{"data": 2} dp', '{"data": 2, "model": 4} dp+tp',
                                  '{"data": 2, "model": 4} dp+tp+sp'])
def test_data_parallel_splits_requests_and_pages(runs, name):
    """Each data shard has its own half of the page pool (pages axis over `data`), both
    shards got prompts, and the step gathers neither a weight nor the KV cache."""
    dp = runs[name]
    assert "'data'" in dp["kv_cache_sharding"].split(",")[1]
    assert dp["kv_cache_shard_shape"][1] * 2 == dp["kv_cache_shape"][1]
    assert all(n > 0 for n in dp["prompt_tokens_per_data_shard"])
    assert len(dp["prompt_tokens_per_data_shard"]) == 2
    full = {tuple(s) for s in dp["param_shapes"]}
    gathered = {tuple(s) for s in dp["all_gather_shapes"]}
    assert not gathered & full
    assert not [s for s in gathered if len(s) == 4 and s[2:] == tuple(dp["kv_cache_shape"][2:])]


def test_sequence_parallel_reduce_scatters_instead_of_all_reducing(runs):
    """The compiled 64-token step (hidden 64, 2 layers, TP=4): under TP every layer
    all-reduces its attention and MLP outputs [64, 64]; under TP+SP those become
    reduce-scatters to token shards [16, 64]. Left in both: the vocabulary-parallel
    embedding lookup's all-reduce."""
    tp, sp = runs['{"model": 4}'], runs['{"model": 4} tp+sp']
    layers = 2
    assert tp["all_reduce_shapes"].count([64, 64]) == 2 * layers + 1
    assert tp["reduce_scatter_shapes"] == []
    assert sp["all_reduce_shapes"].count([64, 64]) == 1
    assert sp["reduce_scatter_shapes"] == [[16, 64]] * (2 * layers)
    # With DP=2 in front, each data shard's 32 tokens are reduce-scattered over its 4
    # model devices.
    dp_tp, dp_sp = runs['{"data": 2, "model": 4} dp+tp'], runs['{"data": 2, "model": 4} dp+tp+sp']
    assert dp_tp["reduce_scatter_shapes"] == []
    assert dp_sp["reduce_scatter_shapes"] == [[8, 64]] * (2 * layers)
