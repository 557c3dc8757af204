"""DeepSeek-V2 / V3: latent attention (models/latent_attention.py) and DeepSeek's experts
(moe.route_grouped) against transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM
on tiny random checkpoints (conftest: a q bottleneck or none, YaRN's mscale, V3's biased
sigmoid routing in groups, V2's softmax routing in groups, shared experts, a dense first
layer). Their prompt logits in every weight layout are test_parity's; tolerances as
there."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import hf_greedy, run_on_cpu_devices
from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.models.moe import route_grouped
from jaxserve.models.transformer import kv_cache_layout
from test_parity import ENGINE, assert_native_row_ops, ragged_prompt_logits

ARCHS = ["deepseek_v3", "deepseek_v2"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_config_maps_latent_attention_and_routing(checkpoints):
    v3 = ModelConfig.from_file(checkpoints("deepseek_v3")[0])
    # The cache holds one head of the latent and the rotated key: 32 + 8 wide.
    assert (v3.num_kv_heads, v3.head_dim, v3.rotary_dim) == (1, 40, 8)
    assert (v3.q_lora_rank, v3.rope_interleave, v3.sparse_layers) == (48, True, (False, True))
    assert (v3.router_scoring, v3.router_bias, v3.n_group, v3.topk_group) == ("sigmoid", True, 4, 2)
    assert v3.shared_expert_intermediate_size == 32 and not v3.shared_expert_gated
    # YaRN's mscale_all_dim scales the softmax: (0.1 ln 4 + 1)^2 / sqrt(16 + 8)
    assert v3.sm_scale == pytest.approx((0.1 * np.log(4.0) + 1) ** 2 / np.sqrt(24))
    v2 = ModelConfig.from_file(checkpoints("deepseek_v2")[0])
    assert (v2.q_lora_rank, v2.router_scoring, v2.router_bias, v2.n_group) == (
        0, "softmax", False, 2)
    assert v2.shared_expert_intermediate_size == 64
    assert v2.sm_scale == pytest.approx(24 ** -0.5)
    # One pool per layer, both K and V (and its scales when 8-bit).
    assert [s for s, _, _ in kv_cache_layout(v3, 10, 4, jnp.float32)] == [(1, 10, 4, 40)]
    assert [s for s, _, _ in kv_cache_layout(v3, 10, 4, jnp.int8)] == [(1, 10, 4, 40), (1, 10, 4)]
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf({**json.loads((checkpoints("deepseek_v3")[0] / "config.json")
                                          .read_text()), "attention_bias": True})


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_matches_transformers_router(arch, checkpoints):
    """2048 tokens through transformers' own router module: the same experts, the same
    weights (V3: the bias steers the choice only; the groups bite: top-2 of 8 chosen in
    the best 2 of 4 groups, V2 in the best 1 of 2)."""
    path, hf_model = checkpoints(arch)
    cfg = ModelConfig.from_file(path)
    router = hf_model.model.layers[1].mlp.gate
    x = torch.randn(2048, cfg.hidden_size) * 3
    with torch.no_grad():
        _, want_w, want_e = router(x)
    bias = router.e_score_correction_bias.numpy() if cfg.router_bias else None
    got_w, got_e = route_grouped(jnp.asarray(x.numpy()),
                                 jnp.asarray(router.weight.detach().numpy().T),
                                 None if bias is None else jnp.asarray(bias), cfg)
    order_w, order_g = np.argsort(want_e.numpy(), -1), np.argsort(np.asarray(got_e), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got_e), order_g, -1),
                                  np.take_along_axis(want_e.numpy(), order_w, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got_w), order_g, -1),
                               np.take_along_axis(want_w.numpy(), order_w, -1), rtol=1e-5)
    # Without the groups (or V3's bias) other experts would win for many tokens.
    free = np.argsort(-(x.numpy() @ router.weight.detach().numpy().T), -1)[:, :2]
    assert (np.sort(free, -1) != np.sort(np.asarray(got_e), -1)).any(-1).mean() > 0.2


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_matches_transformers(arch, checkpoints, prompts):
    """The engine's greedy tokens are transformers' through chunked prefill (a 16-token
    budget), preemption (a 32-page pool) and prefix-cache hits (a shared 24-token
    prefix); no page leaks, nothing compiled after warm-up."""
    path, hf_model = checkpoints(arch)
    shared = prompts[3][:24]
    family = [shared + p[:n] for p, n in zip(prompts, (3, 6, 9, 1))]
    llm = LLM(str(path), **{**ENGINE, "max_num_batched_tokens": 16, "token_buckets": (16,),
                            "num_pages": 32}, enable_prefix_caching=True)
    assert_native_row_ops(llm, ModelConfig.from_file(path), kv_writes=0)
    first = llm.generate(family[:1], GREEDY)
    rest = llm.generate(family[1:] + prompts[:2], GREEDY)
    want = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in family + prompts[:2]]
    assert [o.outputs[0].token_ids for o in first + rest] == want
    assert all(o.num_cached_tokens == 24 for o in rest[:3])
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.compiles_after_warmup == 0
    assert llm.engine.scheduler.allocator.num_used_pages == 0


@pytest.mark.parametrize("kv_dtype,bound", [(jnp.int8, 0.06), (jnp.float8_e4m3fn, 0.2)])
@pytest.mark.parametrize("arch", ARCHS)
def test_8bit_latent_cache_stays_close(arch, kv_dtype, bound, checkpoints, prompts):
    """An 8-bit latent cache (a scale per token and row): prompt logits within 8-bit
    rounding of transformers' float32 ones at almost every position, as the tiny Llama's
    8-bit K/V (max |error| per position: int8 ~0.05; e4m3, 3 mantissa bits, median 0.094
    and 99% under 0.2; the latent's: 0.086, 99%). A position whose router sat near a tie
    may choose another expert after the rounding and move further (V3 int8: one of 95,
    by 1.6)."""
    path, hf_model = checkpoints(arch)
    ours = ragged_prompt_logits(path, prompts, kv_dtype=kv_dtype)
    errs = []
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf_model(torch.tensor([prompt])).logits[0].numpy()
        errs += list(np.abs(got - want).max(-1))
    errs = np.array(errs)
    assert errs.min() > 1e-5  # the values were rounded
    assert np.mean(errs < bound) > 0.95, np.round(errs, 3)


LATENT_LINEARS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                  "o_proj", "gate_proj", "up_proj", "down_proj")


def make_fp8_checkpoint(float_dir: Path, out: Path, blocks=(8, 16)) -> tuple[Path, Path]:
    """DeepSeek-V3's own checkpoint format at a tiny size: every linear layer of the
    decoder (attention, dense MLP, each expert, the shared expert; not the router)
    float8_e4m3fn in blocks of `blocks` ([out, in]) with float32 `weight_scale_inv`,
    `quantization_config` fp8, and tensors of a multi-token-prediction layer (a few, when
    `float_dir` has none: test_mtp's has a whole one). Returns it and a float checkpoint
    of the dequantized weights (the oracle's)."""
    import shutil

    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    bn, bk = blocks
    tensors, truth = {}, {}
    source = {n: w for f in sorted(float_dir.glob("*.safetensors"))
              for n, w in load_file(f).items()}
    has_mtp = "model.layers.2.eh_proj.weight" in source
    for name, w in source.items():
        w = torch.from_numpy(w)
        stem = name.removesuffix(".weight")
        if stem == name or stem.split(".")[-1] not in LATENT_LINEARS:
            tensors[name] = truth[name] = w
            continue
        n, k = w.shape
        amax = w.reshape(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3))
        scale = (amax / 448.0).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name], tensors[f"{stem}.weight_scale_inv"] = q, scale.float()
        truth[name] = q.float() * full
        if name == "model.layers.1.self_attn.o_proj.weight" and not has_mtp:  # an MTP layer's
            tensors["model.layers.2.eh_proj.weight"] = q.clone()  # (layer num_hidden_layers)
            tensors["model.layers.2.eh_proj.weight_scale_inv"] = scale.float().clone()
            tensors["model.layers.2.enorm.weight"] = torch.ones(64)
    dirs = []
    oracle = out.with_name(out.name + "-float")
    for path, state, fp8 in ((out, tensors, True), (oracle, truth, False)):
        path.mkdir()
        for f in float_dir.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy2(f, path / f.name)
        save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
        if fp8:
            cfg = json.loads((path / "config.json").read_text())
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic",
                                          "weight_block_size": list(blocks)}
            (path / "config.json").write_text(json.dumps(cfg))
        dirs.append(path)
    return tuple(dirs)


@pytest.mark.slow  # an engine or two each: the default run's budget
def test_fp8_block_checkpoint_served_as_stored(checkpoints, prompts, tmp_path):
    """DeepSeek-V3's FP8 format: the linear layers stay FP8 as stored (kv_b_proj, which
    latent attention absorbs, is dequantized at load), the MTP layer is left out, and the
    greedy tokens are transformers' on the dequantized weights."""
    from flax import nnx

    from jaxserve.config import EngineConfig
    from jaxserve.engine.loader import load

    qdir, oracle_dir = make_fp8_checkpoint(checkpoints("deepseek_v3")[0], tmp_path / "fp8")
    oracle = type(checkpoints("deepseek_v3")[1]).from_pretrained(
        oracle_dir, dtype=torch.float32, attn_implementation="eager").eval()
    loaded = load(EngineConfig(model=str(qdir), dtype="float32"))
    flat = dict(nnx.to_flat_state(loaded.params))
    assert loaded.config.quantization == "fp8"
    assert flat[("layers", 0, "attn", "q_b_proj")][...].dtype == jnp.float8_e4m3fn
    assert flat[("layers", 1, "mlp", "down_proj")][...].dtype == jnp.float8_e4m3fn  # experts
    assert flat[("layers", 0, "attn", "k_up")][...].dtype == jnp.float32
    w = oracle.model.layers[0].self_attn.kv_b_proj.weight.detach().numpy().reshape(4, 40, 32)
    np.testing.assert_array_equal(np.asarray(flat[("layers", 0, "attn", "k_up")][...]), w[:, :16])
    llm = LLM(str(qdir), **ENGINE)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], GREEDY)]
    assert got == [hf_greedy(oracle, p, GREEDY.max_tokens) for p in prompts[:2]]


@pytest.mark.slow  # an engine or two each: the default run's budget
def test_prefill_decode_disaggregation_moves_the_latent_cache(checkpoints, prompts):
    """Prefilled on one engine, decoded on another: transformers' greedy tokens, and what
    moved is the latent pool alone (2 layers x 40 float32 numbers a token, whole pages)."""
    path, hf_model = checkpoints("deepseek_v3")
    pd = LLM(str(path), prefill={}, decode={}, **ENGINE)
    got = [o.outputs[0].token_ids for o in pd.generate(prompts, GREEDY)]
    assert got == [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    e = pd.engine
    pages = sum(-(-len(p) // ENGINE["page_size"]) for p in prompts)
    assert e.num_handoffs == len(prompts)
    latent = pages * ENGINE["page_size"] * 40 * 4 * 2  # pages rounded up to their buckets:
    assert latent <= e.handoff_bytes < 2 * latent  # not a K and a V copy of each
    for side in (e.prefill, e.decode):
        assert side.status().num_used_pages == 0


@pytest.mark.slow  # an engine or two each: the default run's budget
def test_bfloat16_within_transformers_bfloat16_rounding(checkpoints, prompts):
    """In bfloat16 the engine's prompt logprobs stray from transformers' float32 ones as
    little as transformers' own bfloat16 ones do (medians per position; a position whose
    router sits near a tie may pick other experts on either side, hence no max)."""
    path, hf_model = checkpoints("deepseek_v3")
    llm = LLM(str(path), **{**ENGINE, "dtype": "bfloat16"})
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    hf16 = type(hf_model).from_pretrained(path, dtype=torch.bfloat16,
                                          attn_implementation="eager").eval()
    ours, theirs = [], []
    for prompt, out in zip(prompts, outs):
        got = np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        want = []
        for model in (hf_model, hf16):
            with torch.no_grad():
                logits = model(torch.tensor([prompt])).logits[0].float()
            want.append(torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1),
                                                      prompt[1:]].numpy())
        ours += list(np.abs(got - want[0]))
        theirs += list(np.abs(want[1] - want[0]))
    assert np.median(ours) > 0  # bfloat16 rounding, not float32
    assert np.median(ours) <= 2 * np.median(theirs) + 0.005, (np.median(ours), np.median(theirs))
    assert np.mean(np.array(ours) < 0.1) > 0.9


@pytest.mark.slow  # an engine or two each: the default run's budget
def test_int8_weights_converted_and_restored(checkpoints, prompts, tmp_path):
    """`--quantization int8` quantizes latent attention's projections and the experts
    (the absorbed kv_b_proj halves stay float); `jaxserve convert` saves those arrays and
    serving the converted checkpoint restores them and gives the same tokens."""
    from flax import nnx

    from jaxserve.cli import main

    path, _ = checkpoints("deepseek_v3")
    out = tmp_path / "int8"
    assert main(["convert", "--model", str(path), "--out", str(out), "--quantization", "int8",
                 "--dtype", "float32"]) == 0
    fresh, restored = LLM(str(path), quantization="int8", **ENGINE), LLM(str(out), **ENGINE)
    want = dict(nnx.to_flat_state(fresh.engine.runner.params))
    state = dict(nnx.to_flat_state(restored.engine.runner.params))
    assert state.keys() == want.keys()
    for key, var in state.items():
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(want[key][...]))
    for name in (("layers", 0, "attn", "q_b_proj"), ("layers", 0, "attn", "kv_a_proj"),
                 ("layers", 1, "mlp", "gate_proj"), ("layers", 1, "mlp", "shared_expert",
                                                     "down_proj")):
        assert state[name][...].dtype == jnp.int8, name
    assert state[("layers", 0, "attn", "k_up")][...].dtype == jnp.float32
    assert ([o.outputs[0].token_ids for o in restored.generate(prompts, GREEDY)]
            == [o.outputs[0].token_ids for o in fresh.generate(prompts, GREEDY)])


def test_lora_on_latent_attention_is_refused(checkpoints):
    with pytest.raises(ValueError, match="LoRA.*latent attention"):
        LLM(str(checkpoints("deepseek_v3")[0]), **ENGINE, enable_lora=True)


@pytest.mark.slow
def test_tensor_data_and_expert_parallel_match_transformers(checkpoints, prompts, tmp_path):
    """On 8 CPU devices: the heads split over `model` with the latent cached on every
    device, data parallelism, the experts split whole, and data-parallel attention with the
    experts over every device (the data shards' tokens gathered to them), there drafting
    with the checkpoint's MTP layer: greedy tokens as transformers'."""
    from test_mtp import write_mtp

    path, hf_model = checkpoints("deepseek_v3")
    write_mtp(path, hf_model, tmp_path / "mtp")
    path = tmp_path / "mtp"
    want = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    out = tmp_path / "runs.json"
    run_on_cpu_devices("mla_multidevice_check.py", path, out,
                       json.dumps({"prompts": prompts, "new_tokens": GREEDY.max_tokens}))
    runs = json.loads(out.read_text())
    names = ("tp 4", "dp+tp 2x2", "ep 4", "dp+ep 8", "dp+tp+ep 4x2 mtp")
    assert set(runs) == {*names, "tp 4 int8 kv"}
    # W_uk's heads split over `model` (4, 2 devices), whole where attention is not split;
    # the 8 experts [8, 64, 32] split by MLP columns under tp, whole under ep: over `model`
    # (ep 4), over every device with data shards (dp+ep, dp+tp+ep: one expert a device).
    assert [runs[n]["k_up_shard"] for n in names] == [
        [1, 16, 32], [2, 16, 32], [4, 16, 32], [4, 16, 32], [2, 16, 32]]
    assert [runs[n]["experts_shard"] for n in names] == [
        [8, 64, 8], [8, 64, 16], [2, 64, 32], [1, 64, 32], [1, 64, 32]]
    for name, run in runs.items():
        if "int8" in name:  # 8-bit rounding may flip a late near-tie: the first tokens hold
            assert all(got[:8] == w[:8] for got, w in zip(run["tokens"], want)), name
        else:
            assert run["tokens"] == want, name
        assert run["leaked_pages"] == 0 and run["compiles_after_warmup"] == 0, name
        assert (run["proposed"] > 0) == ("mtp" in name), name
