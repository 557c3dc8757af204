"""Checkpoints quantized by their makers (jaxserve/loading/prequantized.py): AWQ, GPTQ and
compressed-tensors, served as stored.

Each test quantizes a tiny random model's linear layers and writes the checkpoint the
format's tooling writes: compressed-tensors' own compressors (the package, a dev
dependency) and their own decompression as the float truth; AWQ's and GPTQ's documented
packings reproduced here (AutoAWQ's `WQLinear_GEMM.from_linear`, AutoGPTQ's
`QuantLinear.pack`), the AWQ one checked against AutoAWQ's own `dequantize_gemm` (its
sdist, downloaded once and cached). Then, against transformers running the dequantized
weights in float32: every loaded layer dequantizes to exactly the float weight (the
integers and scales are the same, so nothing rounds differently), and greedy tokens are
equal.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

from conftest import hf_greedy, make_checkpoint
from jaxserve import LLM, SamplingParams
from jaxserve.cli import main
from jaxserve.config import EngineConfig
from jaxserve.demo import cache_root
from jaxserve.engine.loader import load
from pallas_kernels.quantized_matmul.formats import dequantize

ENGINE = dict(dtype="float32", max_model_len=64, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,))
NEW_TOKENS = 16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = ("qkv_proj", "gate_up_proj")  # Phi-3's
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def linears(model):
    """(HF name prefix, nn.Linear) of every decoder linear layer."""
    for name, module in model.named_modules():
        if name.split(".")[-1] in LINEARS + FUSED:
            yield name, module


def quantize_bits(w: torch.Tensor, group: int, sym: bool, bits: int = 4):
    """GPTQ's min-max quantization of `w [N, K]` by groups of K: (u [N, K] in
    [0, 2^bits - 1], u0 [N, K / G], scale [N, K / G] rounded to float16, as AWQ and GPTQ
    store it)."""
    n, k = w.shape
    top = 2**bits - 1
    g = w.reshape(n, k // group, group)
    if sym:
        scale = (2 * g.abs().amax(-1) / top).clamp(min=1e-8).half().float()
        u0 = torch.full_like(scale, 2 ** (bits - 1))
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((high - low) / top).clamp(min=1e-8).half().float()
        u0 = torch.round(-low / scale).clamp(0, top)
    u = torch.clamp(torch.round(g / scale[..., None]) + u0[..., None], 0, top)
    return u.reshape(n, k).to(torch.int32), u0.to(torch.int32), scale


def dequantized(u, u0, scale, group):
    """The float weight `[N, K]` that (u - u0) * scale stands for."""
    rep = lambda a: a.repeat_interleave(group, dim=1)  # noqa: E731
    return (u - rep(u0)).float() * rep(scale)


def pack_columns(ints: torch.Tensor, order=None, bits: int = 4) -> torch.Tensor:
    """[R, C] b-bit ints -> [R, C / P] int32 (P = 32 / b), column P i + order[j] in bits
    b j (order: sequential by default)."""
    per = 32 // bits
    r, c = ints.shape
    out = torch.zeros(r, c // per, dtype=torch.int64)
    for j, col in enumerate(order if order is not None else range(per)):
        out |= (ints[:, col::per].to(torch.int64) & (2**bits - 1)) << (bits * j)
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)  # the same 32 bits


def pack_rows(ints: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[R, C] b-bit ints -> [R / P, C] int32, row P i + j in bits b j (AutoGPTQ's
    qweight)."""
    return pack_columns(ints.T.contiguous(), bits=bits).T.contiguous()


def write_checkpoint(float_dir: Path, out: Path, tensors: dict, qconfig: dict, model) -> Path:
    """The float checkpoint's other tensors and files, the quantized layers' `tensors`,
    config.json with `quantization_config`."""
    out.mkdir()
    for f in float_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()
             if not any(f".{name}.weight" in k for name in LINEARS + FUSED)
             and k.removesuffix(".weight") + ".qweight" not in tensors}  # a quantized head
    save_file({**state, **tensors}, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def make_awq(float_dir: Path, out: Path, model, group: int) -> Path:
    """AutoAWQ's GEMM layout: qweight [K, N / 8] and qzeros [K / G, N / 8] packed along N in
    the order 0 2 4 6 1 3 5 7, scales [K / G, N] float16."""
    tensors = {}
    for name, lin in linears(model):
        u, u0, scale = quantize_bits(lin.weight.data, group, sym=False)
        tensors[f"{name}.qweight"] = pack_columns(u.T.contiguous(), AWQ_ORDER)
        tensors[f"{name}.qzeros"] = pack_columns(u0.T.contiguous(), AWQ_ORDER)
        tensors[f"{name}.scales"] = scale.T.contiguous().half()
        lin.weight.data = dequantized(u, u0, scale, group)
    return write_checkpoint(float_dir, out, tensors, {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}, model)


def make_gptq(float_dir: Path, out: Path, model, group: int, sym: bool, v1: bool,
              act_order: bool = False, bits: int = 4, lm_head: bool = False) -> Path:
    """AutoGPTQ's layout: qweight [K / P, N] packed along K (P = 32 / bits), qzeros
    [K / G, N / P] along N (each zero point minus one in the v1 format, wrapping as
    AutoGPTQ's packing does), scales [K / G, N] float16, g_idx. With
    `act_order` (desc_act), the groups are taken in a random order of the K rows, as GPTQ
    takes them by decreasing Hessian diagonal: g_idx[order[i]] = i // G. With `lm_head`
    the LM head too (GPTQModel's `lm_head: true`)."""
    tensors = {}
    heads = [("lm_head", model.lm_head)] if lm_head else []
    for i, (name, lin) in enumerate([*linears(model), *heads]):
        w = lin.weight.data
        k = w.shape[1]
        order = torch.randperm(k, generator=torch.Generator().manual_seed(i)) if act_order \
            else torch.arange(k)
        u_sorted, u0, scale = quantize_bits(w[:, order], group, sym, bits)
        u = torch.empty_like(u_sorted)
        u[:, order] = u_sorted  # the integers back in the rows' own order
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = torch.arange(k, dtype=torch.int32) // group
        tensors[f"{name}.qweight"] = pack_rows(u.T.contiguous(), bits)
        tensors[f"{name}.qzeros"] = pack_columns(u0.T.contiguous() - (1 if v1 else 0),
                                                 bits=bits)
        tensors[f"{name}.scales"] = scale.T.contiguous().half()
        tensors[f"{name}.g_idx"] = g_idx
        rows = g_idx.long()  # row k's group
        lin.weight.data = (u - u0[:, rows]).float() * scale[:, rows]
    return write_checkpoint(float_dir, out, tensors, {
        "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
        "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": lm_head},
        model)


def make_compressed_tensors(float_dir: Path, out: Path, model, weights: dict, fmt: str) -> Path:
    """compressed-tensors' own quantization config, scales (`calculate_qparams`) and
    compressor; the model is left holding the compressor's decompressed float weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"]))
    for _, lin in linears(model):
        w = lin.weight.data
        n, k = w.shape
        if args.strategy == "block":  # [N / bn, K / bk] blocks
            bn, bk = args.block_structure
            g = w.reshape(n // bn, bn, k // bk, bk).transpose(1, 2).reshape(n // bn, k // bk, -1)
        else:
            per = {"group": args.group_size, "channel": k, "tensor": n * k}[args.strategy]
            g = w.reshape(-1, per)
        scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
        lin.weight_scale.data = scale.reshape(lin.weight_scale.shape).to(lin.weight_scale.dtype)
        if hasattr(lin, "weight_zero_point"):
            lin.weight_zero_point.data = zero.reshape(lin.weight_zero_point.shape).to(
                lin.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    out.mkdir()
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in float_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, out / f.name)
    compressor.decompress_model(model)  # the truth: the package's own dequantization
    return out


def make_fp8_blocks(float_dir: Path, out: Path, model, blocks: list[int]) -> Path:
    """transformers' FineGrainedFP8 layout (DeepSeek-V3's): `weight` float8_e4m3fn [N, K]
    and `weight_scale_inv` float32 [N / bn, K / bk], w = q * weight_scale_inv; the model is
    left holding transformers' own dequantization of them."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    bn, bk = blocks
    tensors = {}
    for name, lin in linears(model):
        w = lin.weight.data
        n, k = w.shape
        amax = w.reshape(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3))
        scale = (amax / 448.0).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale_inv"] = scale.float()
        lin.weight.data = _dequantize_fp8_weight(q, scale.float(), blocks, torch.float32)
    return write_checkpoint(float_dir, out, tensors, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": blocks}, model)


@pytest.fixture
def float_model(tmp_path):
    """A fresh tiny model (its linear weights are replaced by their dequantized values)."""
    def get(arch: str = "llama"):
        path = tmp_path / f"{arch}-float"
        return path, make_checkpoint(arch, path)
    return get


CASES = {
    "awq-g32": lambda d, o, m: make_awq(d, o, m, 32),
    "gptq-sym-g32-v1": lambda d, o, m: make_gptq(d, o, m, 32, sym=True, v1=True),
    "gptq-asym-g64-v1": lambda d, o, m: make_gptq(d, o, m, 64, sym=False, v1=True),
    "gptq-asym-g32-v2": lambda d, o, m: make_gptq(d, o, m, 32, sym=False, v1=False),
    "gptq-act-order-g32": lambda d, o, m: make_gptq(d, o, m, 32, sym=False, v1=True,
                                                    act_order=True),
    "ct-int4-asym-g32": lambda d, o, m: make_compressed_tensors(d, o, m, dict(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
        "pack-quantized"),
    "ct-int4-sym-channel": lambda d, o, m: make_compressed_tensors(d, o, m, dict(
        num_bits=4, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
    "gptq-8bit-asym-g32-v1": lambda d, o, m: make_gptq(d, o, m, 32, sym=False, v1=True,
                                                       bits=8),
    "gptq-8bit-sym-g64-v2": lambda d, o, m: make_gptq(d, o, m, 64, sym=True, v1=False, bits=8),
    "gptq-asym-g32-v1-lm-head": lambda d, o, m: make_gptq(d, o, m, 32, sym=False, v1=True,
                                                          lm_head=True),
    "gptq-8bit-sym-g32-v2-lm-head": lambda d, o, m: make_gptq(d, o, m, 32, sym=True, v1=False,
                                                              bits=8, lm_head=True),
    "ct-int8-channel": lambda d, o, m: make_compressed_tensors(d, o, m, dict(
        num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
    "ct-int8-asym-g32": lambda d, o, m: make_compressed_tensors(d, o, m, dict(
        num_bits=8, type="int", symmetric=False, strategy="group", group_size=32),
        "pack-quantized"),
    "ct-int8-naive-asym-channel": lambda d, o, m: make_compressed_tensors(d, o, m, dict(
        num_bits=8, type="int", symmetric=False, strategy="channel"), "int-quantized"),
    "ct-fp8-channel": lambda d, o, m: make_compressed_tensors(d, o, m, dict(
        num_bits=8, type="float", symmetric=True, strategy="channel"), "float-quantized"),
    "ct-fp8-tensor": lambda d, o, m: make_compressed_tensors(d, o, m, dict(
        num_bits=8, type="float", symmetric=True, strategy="tensor"), "float-quantized"),
    "ct-fp8-block": lambda d, o, m: make_compressed_tensors(d, o, m, dict(
        num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 64]),
        "float-quantized"),
    "fp8-block": lambda d, o, m: make_fp8_blocks(d, o, m, [16, 32]),
}
KINDS = {"awq": "int4", "gptq-8bit": "int8", "gptq": "int4", "ct-int4": "int4",
         "ct-int8": "int8", "ct-fp8": "fp8", "fp8": "fp8"}


def kind_of(case: str) -> str:
    return next(v for k, v in KINDS.items() if case.startswith(k))


def assert_layers_equal_the_float_weights(params, model, kind: str):
    """Every loaded linear layer dequantizes to the float weight the oracle runs."""
    flat = dict(nnx.to_flat_state(params))
    checked = 0
    for name, lin in linears(model):
        i, _, proj = int(name.split(".")[2]), name.split(".")[3], name.split(".")[4]
        block = "attn" if proj in LINEARS[:4] else "mlp"
        path = ("layers", i, block, proj)
        values, scales = flat[path][...], flat[path[:-1] + (proj + "_scales",)][...]
        ours = np.asarray(dequantize(values, scales, kind, jnp.float32))
        perm = flat.get(path[:-1] + (proj + "_perm",))
        if perm is not None:  # act-order: row i holds the weight's row perm[i]
            ours = ours[np.argsort(np.asarray(perm[...]))]
        np.testing.assert_array_equal(ours, lin.weight.data.float().numpy().T, err_msg=name)
        checked += 1
    assert checked == 2 * len(LINEARS)


@pytest.mark.parametrize("case", list(CASES))
def test_served_as_stored_equals_transformers_on_the_dequantized_weights(
        case, float_model, tmp_path, prompts):
    float_dir, model = float_model()
    qdir = CASES[case](float_dir, tmp_path / case, model)
    loaded = load(EngineConfig(model=str(qdir), dtype="float32"))
    assert loaded.config.quantization == kind_of(case)
    asymmetric = case.startswith("awq") or "asym" in case or "act-order" in case
    assert loaded.config.quant_zero_points == asymmetric
    assert_layers_equal_the_float_weights(loaded.params, model, kind_of(case))
    head = dict(nnx.to_flat_state(loaded.params)).get(("lm_head_scales",))
    assert (head is not None) == case.endswith("lm-head")  # GPTQ's quantized head as stored
    if head is not None:
        ours = dequantize(dict(nnx.to_flat_state(loaded.params))[("lm_head",)][...], head[...],
                          kind_of(case), jnp.float32)
        np.testing.assert_array_equal(np.asarray(ours), model.lm_head.weight.data.numpy().T)
    llm = LLM(str(qdir), **ENGINE)
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))]
    assert got == [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("case", ["awq-g32", "gptq-act-order-g32"])
def test_phi3_fused_layers_served_as_stored(case, float_model, tmp_path, prompts):
    """Phi-3's quantized qkv_proj and gate_up_proj (one layer each as stored, act-order's
    permutation shared by the pieces): q/k/v and gate/up are their columns, kept
    quantized; greedy tokens equal transformers' on the dequantized weights."""
    float_dir, model = float_model("phi3")
    qdir = CASES[case](float_dir, tmp_path / case, model)
    llm = LLM(str(qdir), **ENGINE)
    assert llm.engine.config.quantization == "int4"
    flat = dict(nnx.to_flat_state(llm.engine.runner.params))
    assert ("layers", 0, "attn", "k_proj_scales") in flat
    assert ("layers", 0, "mlp", "up_proj_scales") in flat
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))]
    assert got == [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_qwen2_biases_and_zero_points_through_the_gpu_kernel(float_model, tmp_path, prompts):
    """Qwen2's q/k/v biases beside AWQ weights; the Pallas GPU kernel (interpret mode) on
    the zero points gives the reference engine's tokens."""
    float_dir, model = float_model("qwen2")
    qdir = make_awq(float_dir, tmp_path / "awq", model, 32)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [hf_greedy(model, p, 8) for p in prompts[:2]]
    for impl in ("reference", "gpu"):
        llm = LLM(str(qdir), kernel_impl=impl, interpret_kernels=impl == "gpu", **ENGINE)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], greedy)] == want


MESH_RUN = """
import json, sys
from jaxserve import LLM, SamplingParams
llm = LLM(sys.argv[1], mesh={"model": 2}, **json.loads(sys.argv[2]))
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0.0, max_tokens=8,
                                                             ignore_eos=True))
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_kv_heads_repeated_over_more_devices_than_heads(float_model, tmp_path, prompts):
    """Tensor parallelism over 2 devices with Qwen2's one KV head repeats the head's columns
    of the quantized k/v values, scales and zero points, and an act-order checkpoint's
    row-split layers (o, down) gather their permuted inputs across the shards: same tokens
    (in a process of its own with 8 CPU devices)."""
    float_dir, model = float_model("qwen2")
    qdir = make_gptq(float_dir, tmp_path / "gptq", model, 32, sym=False, v1=True,
                     act_order=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, "-c", MESH_RUN, str(qdir), json.dumps(ENGINE),
                           json.dumps(prompts[:2])], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == \
        [hf_greedy(model, p, 8) for p in prompts[:2]]


def test_convert_keeps_the_checkpoints_integers(float_model, tmp_path, prompts):
    """`jaxserve convert` of an AWQ checkpoint writes our format with its group size and
    zero points; the converted checkpoint serves the same tokens."""
    float_dir, model = float_model()
    qdir = make_awq(float_dir, tmp_path / "awq", model, 64)
    out = tmp_path / "converted"
    assert main(["convert", "--model", str(qdir), "--out", str(out), "--dtype", "float32"]) == 0
    manifest = json.loads((out / "jaxserve.json").read_text())
    assert (manifest["quantization"], manifest["quant_group_size"],
            manifest["quant_zero_points"], manifest["source_quantization"]) == \
        ("int4", 64, True, "awq")
    loaded = load(EngineConfig(model=str(out), dtype="float32"))
    assert_layers_equal_the_float_weights(loaded.params, model, "int4")


def awq_packing_utils():
    """AutoAWQ's `awq/utils/packing_utils.py` (torch only), from its sdist on PyPI, cached."""
    path = cache_root() / "oracles" / "autoawq-0.2.9-packing_utils.py"
    if not path.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                  "--no-binary", ":all:", "-q", "autoawq==0.2.9", "-d", tmp],
                                 capture_output=True, text=True)
            sdists = list(Path(tmp).glob("autoawq-*.tar.gz"))
            if got.returncode != 0 or not sdists:
                pytest.skip("the autoawq sdist could not be downloaded (PyPI unreachable?): "
                            f"{got.stderr.strip()[-300:]}")
            with tarfile.open(sdists[0]) as tar:
                member = tar.extractfile("autoawq-0.2.9/awq/utils/packing_utils.py")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(member.read())
    spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_awq_packing_is_autoawqs(float_model, tmp_path):
    """The AWQ tensors written here unpack, by AutoAWQ's own `dequantize_gemm`, to the
    weights the tests run as the truth."""
    utils = awq_packing_utils()
    float_dir, model = float_model()
    qdir = make_awq(float_dir, tmp_path / "awq", model, 32)
    from safetensors.torch import load_file
    tensors = load_file(qdir / "model.safetensors")
    for name, lin in linears(model):
        w = utils.dequantize_gemm(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"],
                                  tensors[f"{name}.scales"].float(), 4, 32)
        np.testing.assert_array_equal(w.numpy(), lin.weight.data.numpy().T, err_msg=name)


def edit_config(qdir: Path, **fields):
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"].update(fields)
    (qdir / "config.json").write_text(json.dumps(cfg))


def test_what_is_not_served_is_refused_naming_the_field(float_model, tmp_path):
    float_dir, model = float_model()
    qdir = make_gptq(float_dir, tmp_path / "gptq", model, 32, sym=False, v1=True)
    with pytest.raises(ValueError, match="leave --quantization unset"):
        load(EngineConfig(model=str(qdir), dtype="float32", quantization="int8"))
    for fields, match in [
        (dict(bits=3), r"quantization_config.bits = 3"),
        (dict(checkpoint_format="marlin"), r"checkpoint_format = 'marlin'"),
        (dict(modules_to_not_convert=["model.layers.0.mlp.down_proj"]),
         r"modules_to_not_convert .*left unquantized"),
        (dict(quant_method="bitsandbytes"), r"quant_method = 'bitsandbytes'"),
        (dict(group_size=64), r"do not match group_size 64"),
        (dict(lm_head=True, desc_act=True), r"lm_head = True: an act-order .*LM head"),
        (dict(lm_head=True), r"lm_head.weight: a float LM head, yet .*lm_head is true"),
    ]:
        cfg = json.loads((qdir / "config.json").read_text())
        edit_config(qdir, **fields)
        with pytest.raises(ValueError, match=match):
            load(EngineConfig(model=str(qdir), dtype="float32"))
        (qdir / "config.json").write_text(json.dumps(cfg))
    # Act-order: g_idx is a permutation's groups, not k // G.
    from safetensors.torch import load_file
    tensors = load_file(qdir / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.g_idx"
    tensors[name] = tensors[name][torch.randperm(tensors[name].numel())]
    save_file(tensors, qdir / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.g_idx .*desc_act"):
        load(EngineConfig(model=str(qdir), dtype="float32"))


def test_awq_gemv_and_a_float_layer_are_refused(float_model, tmp_path):
    float_dir, model = float_model()
    qdir = make_awq(float_dir, tmp_path / "awq", model, 32)
    edit_config(qdir, version="gemv")
    with pytest.raises(ValueError, match="version = 'gemv'"):
        load(EngineConfig(model=str(qdir), dtype="float32"))
    edit_config(qdir, version="gemm")
    from safetensors.torch import load_file
    tensors = load_file(qdir / "model.safetensors")
    prefix = "model.layers.0.self_attn.o_proj"
    for part in ("qweight", "qzeros", "scales"):
        del tensors[f"{prefix}.{part}"]
    tensors[f"{prefix}.weight"] = torch.zeros(64, 64)
    save_file(tensors, qdir / "model.safetensors")
    with pytest.raises(ValueError, match="o_proj.weight: a float weight in a awq"):
        load(EngineConfig(model=str(qdir), dtype="float32"))


def test_plan_sizes_the_checkpoint_as_stored(float_model, tmp_path, monkeypatch):
    """`jaxserve plan --model AWQ_DIR` plans int4 with the checkpoint's groups and zero
    points: its weight bytes are those of the arrays the engine loads."""
    import sharding.planner as planner

    float_dir, model = float_model()
    qdir = make_awq(float_dir, tmp_path / "awq", model, 32)
    plans = []
    real = planner.plan_target
    monkeypatch.setattr(planner, "plan_target",
                        lambda *a, **k: plans.append((k, real(*a, **k))) or plans[-1][1])
    assert main(["plan", "--model", str(qdir), "--target", "h100x1", "--max-model-len", "64",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "16"]) == 0
    (kwargs, result), = plans
    assert (kwargs["quantization"], kwargs["quant_group_size"], kwargs["quant_zero_points"]) \
        == ("int4", 32, True)
    loaded = load(EngineConfig(model=str(qdir), dtype="bfloat16"))
    stored = sum(v[...].nbytes for _, v in nnx.to_flat_state(loaded.params))
    assert result["weight_bytes"] == stored


# --- MoE checkpoints: every expert quantized, read one by one and stacked ----------------

def make_moe_checkpoint(float_dir: Path, out: Path, method: str, group: int, bits: int = 4
                        ) -> tuple[Path, Path]:
    """An AWQ (GEMM) or GPTQ (v2, asymmetric) checkpoint of a MoE model as the tooling
    writes it, every linear layer quantized (experts one by one, the shared expert too; the
    routers float), from the float checkpoint's tensors on disk. Returns it and a float
    checkpoint of its dequantized weights (the oracle's, loaded by transformers)."""
    from safetensors.numpy import load_file

    tensors, truth = {}, {}
    for name, w in load_file(float_dir / "model.safetensors").items():
        stem = name.removesuffix(".weight")
        if stem.split(".")[-1] not in LINEARS + ("w1", "w2", "w3") or name == stem:
            tensors[name] = torch.from_numpy(w)
            truth[name] = tensors[name]
            continue
        u, u0, scale = quantize_bits(torch.from_numpy(w), group, sym=False, bits=bits)
        if method == "awq":
            tensors[f"{stem}.qweight"] = pack_columns(u.T.contiguous(), AWQ_ORDER)
            tensors[f"{stem}.qzeros"] = pack_columns(u0.T.contiguous(), AWQ_ORDER)
        else:
            tensors[f"{stem}.qweight"] = pack_rows(u.T.contiguous(), bits)
            tensors[f"{stem}.qzeros"] = pack_columns(u0.T.contiguous(), bits=bits)
            tensors[f"{stem}.g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // group
        tensors[f"{stem}.scales"] = scale.T.contiguous().half()
        truth[name] = dequantized(u, u0, scale, group)
    qconfig = {"awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                       "version": "gemm", "modules_to_not_convert": ["gate"]},
               "gptq": {"quant_method": "gptq", "bits": bits, "group_size": group,
                        "desc_act": False, "sym": False, "checkpoint_format": "gptq_v2"}}[method]
    dirs = []
    for path, state, qc in ((out, tensors, qconfig), (out.with_name(out.name + "-float"),
                                                     truth, None)):
        path.mkdir()
        for f in float_dir.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy2(f, path / f.name)
        save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
        if qc:
            cfg = json.loads((path / "config.json").read_text())
            cfg["quantization_config"] = qc
            (path / "config.json").write_text(json.dumps(cfg))
        dirs.append(path)
    return tuple(dirs)


@pytest.mark.parametrize("arch, method, bits", [  # ~12 s each: two run with the slow tests
    ("qwen2_moe", "gptq", 4), pytest.param("mixtral", "awq", 4, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "gptq", 8, marks=pytest.mark.slow)])
def test_moe_experts_served_as_stored(prompts, tmp_path, arch, method, bits):
    """A MoE checkpoint whose every expert (and Qwen2-MoE's shared expert) is quantized:
    the experts are stacked as stored (int4 / int8 with zero points, groups of 32) and the
    greedy tokens equal transformers on the dequantized weights, with the plain-JAX
    grouped matmul and the Pallas GPU kernel (interpret mode)."""
    from conftest import _hf_config, hf_greedy
    from jaxserve.demo import write_byte_tokenizer

    cls, cfg = _hf_config(arch)
    if arch == "qwen2_moe":  # whole groups of 32 in the shared expert's down projection
        cfg.shared_expert_intermediate_size = 64
    torch.manual_seed(0)
    model = cls(cfg).eval()
    float_dir = tmp_path / f"{arch}-float-source"
    model.save_pretrained(float_dir)
    write_byte_tokenizer(float_dir)
    qdir, oracle_dir = make_moe_checkpoint(float_dir, tmp_path / arch, method, 32, bits)
    oracle = cls.from_pretrained(oracle_dir, dtype=torch.float32,
                                 attn_implementation="eager").eval()
    loaded = load(EngineConfig(model=str(qdir), dtype="float32"))
    flat = dict(nnx.to_flat_state(loaded.params))
    scales = flat[("layers", 0, "mlp", "gate_proj_scales")][...]
    assert (loaded.config.quantization, loaded.config.quant_zero_points) == (f"int{bits}", True)
    assert scales.shape == (model.config.num_local_experts if arch == "mixtral"
                            else model.config.num_experts, 2, 64 // 32,
                            model.config.intermediate_size if arch == "mixtral"
                            else model.config.moe_intermediate_size)
    want = [hf_greedy(oracle, p, 8) for p in prompts[:2]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for impl in ("cpu", "gpu"):
        llm = LLM(str(qdir), kernel_impl=None if impl == "cpu" else impl,
                  interpret_kernels=impl == "gpu", **ENGINE)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], greedy)] == want, impl
