"""gpt-oss: attention sinks on alternating sliding and full layers, YaRN, biased
projections, and its experts (a router with a bias, top-k softmaxed, gate and up
interleaved in one stack with biases, the clamped SwiGLU, down biases) against
transformers' GptOssForCausalLM on a tiny random checkpoint (conftest: sinks and biases
drawn as large as what they join, a clamp low enough to bite). Its prompt logits in every
weight layout are test_parity's; tolerances as there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, run_on_cpu_devices
from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from pallas_kernels.quantized_matmul.formats import dequantize
from test_parity import ENGINE

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_config_maps_sinks_layers_and_experts(checkpoints):
    cfg = ModelConfig.from_file(checkpoints("gpt_oss")[0])
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert (cfg.layer_window(0), cfg.layer_window(1)) == (8, None)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.norm_topk_prob and cfg.expert_biases and cfg.sparse_layers == (True, True)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (0.3, 1.702)
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.truncate) == ("yarn", False)


def test_greedy_batch_matches_transformers(checkpoints, prompts):
    """The engine (prefix caching on, chunked prefill at 16 tokens, a bucket for decodes):
    every prompt's greedy tokens as transformers' own decoding, no page left used."""
    path, hf_model = checkpoints("gpt_oss")
    llm = LLM(str(path), **{**ENGINE, "max_num_batched_tokens": 16, "token_buckets": (16,)})
    outs = llm.generate(prompts, GREEDY)
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
    assert llm.engine.scheduler.allocator.num_used_pages == 0
    assert llm.engine.runner.compiles_after_warmup == 0


def test_expert_stacks_in_another_layout_serve_the_same_tokens(checkpoints, prompts,
                                                              monkeypatch):
    """sharding/layouts.py moves the loaded expert stacks into the layout the grouped
    kernel takes (row-major, on a TPU). Made to ask for another one here, where every
    default is row-major: the stacks are moved into it and the engine's programs take
    them as they lie (a committed argument's layout), with transformers' tokens."""
    from jax.experimental.layout import Format, Layout

    from sharding import layouts

    def columns_first(var, sharding):
        if not layouts.is_expert_stack(var):
            return sharding
        return Format(Layout(major_to_minor=(2, 0, 1)), sharding)

    monkeypatch.setattr(layouts, "kernel_format", columns_first)
    path, hf_model = checkpoints("gpt_oss")
    llm = LLM(str(path), **{**ENGINE, "max_num_batched_tokens": 16, "token_buckets": (16,)})
    moved = {x.shape for x in llm.engine.runner.param_leaves
             if x.format.layout.major_to_minor == (2, 0, 1)}
    assert moved == {(4, 64, 32), (4, 32, 64)}  # gate and up, down: every expert stack
    outs = llm.generate(prompts[:2], GREEDY)
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens)


@pytest.mark.slow
def test_tensor_expert_and_data_parallel_match_transformers(checkpoints, prompts, tmp_path):
    """On 8 CPU devices (tests/gpt_oss_multidevice_check.py): the 4 heads and their sinks
    split over 2 and 4 devices, the TPU kernel per device, the 4 experts and their biases
    split whole over 4 devices, data + tensor parallelism: transformers' greedy tokens."""
    path, hf_model = checkpoints("gpt_oss")
    want = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    out = tmp_path / "runs.json"
    names = ["tp 2", "tp 4", "tp 2 tpu-kernels", "ep 4", "dp+tp 2x2"]
    run_on_cpu_devices("gpt_oss_multidevice_check.py", path, out, json.dumps(
        {"prompts": prompts, "new_tokens": GREEDY.max_tokens, "runs": names}))
    runs = json.loads(out.read_text())
    assert set(runs) == set(names)
    # 4 sinks over 2 / 4 model devices; the gate bias [4 experts, 32]: its MLP columns
    # split under tp, whole experts under ep.
    assert [runs[n]["sinks_shard"] for n in ("tp 2", "tp 4", "dp+tp 2x2")] == [[2], [1], [2]]
    assert runs["tp 2"]["gate_bias_shard"] == [4, 16]
    assert runs["ep 4"]["gate_bias_shard"] == [1, 32]
    for name, run in runs.items():
        assert run["tokens"] == want, name
        assert run["leaked_pages"] == 0 and run["compiles_after_warmup"] == 0, name


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An expert stack `[E, K, N]` as OpenAI's checkpoints store it: each output column's
    groups of 32 inputs as e2m1 codes, two a byte (the low nibble first), `[E, N, K / 32,
    16]`, under a power-of-two scale (e8m0, 2^(s - 127)) that fits the group's largest
    value in 6."""
    e, k, n = w.shape
    groups = w.transpose(0, 2, 1).reshape(e, n, k // 32, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    codes = np.abs((groups / np.exp2(exp))[..., None] - E2M1).argmin(-1).astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp[..., 0] + 127).astype(np.uint8)


def write_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """The float checkpoint with its experts in MXFP4, as openai/gpt-oss-* are published
    (the attention, routers, embedding and head left float)."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, x in load_file(dst / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4(x.numpy())
            tensors[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            tensors[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        else:
            tensors[name] = x
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_mxfp4_experts_served_as_fp4_equal_transformers_dequantized(checkpoints, prompts,
                                                                     tmp_path):
    """An MXFP4 checkpoint (the experts' e2m1 codes and e8m0 scales): each expert stack held
    as fp4 in groups of 32 (half a byte a weight, bf16 scales) that dequantizes to exactly
    what transformers' own MXFP4 reader dequantizes (Mxfp4Config(dequantize=True)), gate
    and up taken apart from their interleaved columns; attention left float; greedy tokens
    as transformers' on those weights."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    path = write_mxfp4_checkpoint(checkpoints("gpt_oss")[0], tmp_path / "mxfp4")
    hf_model = GptOssForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    llm = LLM(str(path), **{**ENGINE, "max_num_batched_tokens": 16, "token_buckets": (16,)})
    assert (llm.engine.config.quantization, llm.engine.config.quant_group_size) == ("fp4", 32)
    float_experts = load_file(checkpoints("gpt_oss")[0] / "model.safetensors")
    for i in range(2):
        layer = llm.engine.runner.params["layers"][i]
        assert layer["attn"]["q_proj"][...].dtype == np.float32
        experts = hf_model.model.layers[i].mlp.experts
        gate_up = experts.gate_up_proj.detach().numpy()
        for ours, want in (("gate_proj", gate_up[..., 0::2]), ("up_proj", gate_up[..., 1::2]),
                           ("down_proj", experts.down_proj.detach().numpy())):
            values, scales = layer["mlp"][ours][...], layer["mlp"][f"{ours}_scales"][...]
            assert values.dtype == np.uint8 and scales.dtype == jnp.bfloat16
            assert scales.shape[1] == 2 * values.shape[1] // 32
            got = np.stack([np.asarray(dequantize(v, s, "fp4"))
                            for v, s in zip(values, scales)])
            np.testing.assert_array_equal(got, want)
        # 4-bit codes: not the float weights themselves
        assert np.abs(gate_up - float_experts[f"model.layers.{i}.mlp.experts.gate_up_proj"]
                      .numpy()).max() > 1e-3
    outs = llm.generate(prompts, GREEDY)
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
    assert llm.engine.scheduler.allocator.num_used_pages == 0


@pytest.mark.slow
def test_mxfp4_experts_on_a_mesh_match_transformers(checkpoints, prompts, tmp_path):
    """The MXFP4 checkpoint's fp4 experts on 8 CPU devices, whole experts over 4 devices
    and over 2 through the TPU and the GPU kernels per device (interpret mode: fp4 decoded
    in the grouped kernels): the greedy tokens of transformers' dequantized model. (Its
    32-wide experts are one group of 32 rows: no tp split of them, which is refused.)"""
    from transformers import GptOssForCausalLM, Mxfp4Config

    path = write_mxfp4_checkpoint(checkpoints("gpt_oss")[0], tmp_path / "mxfp4")
    hf_model = GptOssForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    want = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    names = ["ep 4", "ep 2 tpu-kernels", "ep 2 gpu-kernels"]
    out = tmp_path / "runs.json"
    run_on_cpu_devices("gpt_oss_multidevice_check.py", path, out, json.dumps(
        {"prompts": prompts, "new_tokens": GREEDY.max_tokens, "runs": names}))
    runs = json.loads(out.read_text())
    assert set(runs) == set(names)
    for name, run in runs.items():
        assert run["tokens"] == want, name
        assert run["leaked_pages"] == 0 and run["compiles_after_warmup"] == 0, name


def test_an_mxfp4_config_alone_gives_the_settings_that_serve_it(checkpoints, tmp_path):
    """`jaxserve plan` opens a directory of an MXFP4 checkpoint's config.json alone (no
    weights to read until they are loaded): fp4 in groups of 32 for the experts, every
    attention projection held float."""
    from jaxserve.loading.source import open_checkpoint

    config = json.loads((checkpoints("gpt_oss")[0] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = open_checkpoint(tmp_path, None)
    assert (ckpt.method, ckpt.settings["quantization"], ckpt.settings["quant_group_size"],
            ckpt.settings["quant_zero_points"]) == ("mxfp4", "fp4", 32, False)
    assert sorted(o[0] for o in ckpt.settings["quant_overrides"]) == sorted(
        f"layers.{i}.attn.{p}_proj" for i in range(2) for p in "qkvo")
    assert all(o[1:] == (None, None, False) for o in ckpt.settings["quant_overrides"])
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        next(iter(ckpt.tensors))
    with pytest.raises(ValueError, match="mxfp4.*fp4.*--quantization"):
        open_checkpoint(tmp_path, "int4")
