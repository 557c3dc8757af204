"""The mixture-of-experts block against numpy: routing (softmax, top-k with ties to the
lower index, renormalisation) and the grouped expert matmuls, with empty experts, one
expert taking every token, and group sizes of every kind. (Parity of whole MoE models
with transformers is in test_parity.py.)"""

from __future__ import annotations

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.moe import grouped_glu, route


def numpy_route(x, router, k, normalize):
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # ties: lower index first
    weights = np.take_along_axis(probs, experts, -1)
    if normalize:
        weights /= weights.sum(-1, keepdims=True)
    return weights, experts


def numpy_experts(x, weights, experts, gate, up, down):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            g, u = x[t] @ gate[e], x[t] @ up[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("normalize", [False, True])
def test_route_ties_go_to_the_lower_expert_and_weights_renormalise(normalize):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    router = rng.standard_normal((8, 5)).astype(np.float32)
    router[:, 3] = router[:, 1]  # experts 1 and 3 tie on every token
    router[:, 4] = router[:, 1]  # and 4
    weights, experts = jax.jit(route, static_argnums=(2, 3, 4))(
        jnp.asarray(x), jnp.asarray(router), 2, normalize, jnp.float32)
    want_w, want_e = numpy_route(x, router, 2, normalize)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-6)
    tied = want_e[:, 0] == 1  # expert 1 on top: 3 and 4 equal it, so the second is 3
    assert tied.any() and (want_e[tied, 1] == 3).all()


@pytest.mark.parametrize("case", ["random", "one expert takes all", "empty experts",
                                  "one token"])
def test_grouped_experts_against_numpy(case):
    rng = np.random.default_rng(1)
    num_experts, hidden, inter, k = 6, 16, 24, 2
    t = 1 if case == "one token" else 13
    x = rng.standard_normal((t, hidden)).astype(np.float32)
    gate, up = (rng.standard_normal((num_experts, hidden, inter)).astype(np.float32) * 0.3
                for _ in range(2))
    down = rng.standard_normal((num_experts, inter, hidden)).astype(np.float32) * 0.3
    experts = rng.integers(0, num_experts, size=(t, k))
    if case == "one expert takes all":
        experts[:, 0] = 4
        experts[:, 1] = 4  # both slots of every token on one expert
    elif case == "empty experts":
        experts = rng.choice([0, 5], size=(t, k))  # experts 1-4 get no token
    weights = rng.uniform(0.1, 1.0, size=(t, k)).astype(np.float32)
    stacks = (jnp.asarray(gate), None, jnp.asarray(up), None, jnp.asarray(down), None)
    got = jax.jit(grouped_glu)(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), stacks)
    np.testing.assert_allclose(np.asarray(got), numpy_experts(x, weights, experts, gate, up, down),
                               rtol=2e-5, atol=2e-5)


def test_padding_tokens_reach_no_expert(monkeypatch):
    """A bucket's padding tokens are routed to no expert: the grouped matmuls see only the
    real tokens' pairs (their group sizes sum to real tokens x top_k), padding rows come
    out zero (plus nothing else) and real rows are those of a batch without padding."""
    from flax import nnx

    from jaxserve.config import ModelConfig, ModelOptions
    from jaxserve.models import moe as moe_module
    from sharding.mesh import make_mesh
    from sharding.rules import ShardingContext

    cfg = ModelConfig(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                      vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=True)
    graphdef, zeros = nnx.split(moe_module.MoE(cfg, jnp.float32, ModelOptions()))
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(zeros))))
    layer = nnx.merge(graphdef, jax.tree.map(
        lambda v: 0.02 * jax.random.normal(next(keys), v.shape, v.dtype), zeros))
    shard = ShardingContext(make_mesh())
    x = jax.random.normal(jax.random.key(1), (8, 32))
    real = jnp.arange(8) < 3
    sizes = []
    real_glu = moe_module.grouped_glu

    def counting_glu(x, weights, experts, *args, **kwargs):
        flat = experts.reshape(-1)
        sizes.append(int(((flat >= 0) & (flat < cfg.num_experts)).sum()))
        return real_glu(x, weights, experts, *args, **kwargs)

    monkeypatch.setattr(moe_module, "grouped_glu", counting_glu)
    padded = layer(x, shard, real=real)
    alone = layer(x[:3], shard)
    assert sizes == [3 * 2, 3 * 2]
    np.testing.assert_array_equal(np.asarray(padded[3:]), 0)
    np.testing.assert_allclose(np.asarray(padded[:3]), np.asarray(alone), rtol=1e-6, atol=1e-7)


def test_bf16_moe_serves(checkpoints, prompts):
    """A Mixtral checkpoint in bfloat16 (router weights kept in float32, as transformers
    does) generates and returns its pages."""
    from jaxserve import LLM, SamplingParams

    path, _ = checkpoints("mixtral")
    llm = LLM(str(path), dtype="bfloat16", max_model_len=64, page_size=4, max_num_seqs=2,
              max_num_batched_tokens=16, token_buckets=(16,))
    out = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    assert llm.engine.scheduler.num_used_pages == 0


# The linear layers we quantize, by their Hugging Face names: attention projections, dense
# MLPs, every expert's projections and Qwen2-MoE's shared expert (not the router, nor the
# shared expert's gate, embeddings or norms).
QUANTIZED = re.compile(r".*\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
                       r"(block_sparse_moe|mlp)\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)|"
                       r"mlp\.shared_expert\.(gate|up|down)_proj)\.weight")


def fake_quantized_checkpoint(src, dst, kind: str) -> int:
    """A copy of an HF checkpoint whose quantized layers hold their dequantized weights
    (each `[out, in]` weight quantized as we store it: `[in, out]`, per output channel or
    in groups along `in`). Returns how many tensors were replaced."""
    from safetensors.numpy import load_file, save_file

    from pallas_kernels.quantized_matmul import dequantize, quantize

    shutil.copytree(src, dst)
    replaced = 0
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, w in tensors.items():
            if QUANTIZED.fullmatch(name):
                values, scales = quantize(jnp.asarray(w.T, jnp.float32), kind)
                tensors[name] = np.ascontiguousarray(
                    np.asarray(dequantize(values, scales, kind)).T).astype(w.dtype)
                replaced += 1
        save_file(tensors, file, metadata={"format": "pt"})
    return replaced


@pytest.mark.parametrize("arch,kind", [("qwen2_moe", "int8"), ("mixtral", "int4"),
                                       ("qwen3_moe", "fp8")])
def test_quantized_experts_compute_with_their_dequantized_weights(arch, kind, checkpoints,
                                                                  prompts, tmp_path):
    """With every linear layer quantized (each expert on its own, in the stacked formats
    of the grouped matmul), our prompt logits equal transformers' on the same checkpoint
    with those weights replaced by their dequantized values (float32; tolerance of the
    parity tests): the quantized expert matmuls compute exactly x @ dequantize(w), under
    the same routing."""
    import torch
    import transformers

    from jaxserve.config import ModelOptions
    from test_parity import ragged_prompt_logits

    path, _ = checkpoints(arch)
    cfg = transformers.AutoConfig.from_pretrained(path)
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    replaced = fake_quantized_checkpoint(path, tmp_path / "fake", kind)
    assert replaced >= cfg.num_hidden_layers * 4 + experts * 3  # the experts are among them
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fake", attn_implementation="eager", dtype=torch.float32).eval()
    ours = ragged_prompt_logits(path, prompts, options=ModelOptions(quantization=kind))
    floats = ragged_prompt_logits(path, prompts[:1])
    assert np.abs(ours[0] - floats[0]).max() > 1e-3  # quantizing moved the logits...
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)  # ...exactly as this


def test_router_statistics_count_every_real_token_once_per_chosen_expert(checkpoints, prompts):
    """The engine's expert load (GetServerStatus, metrics) after a batch: each MoE layer
    has counted top_k experts for every real token the model ran (prompt tokens and all
    generated tokens but the last, which is sampled and never fed back; without async
    scheduling no step runs past a request's end), none for padding; the dense layer of
    Qwen2-MoE has no row."""
    from jaxserve import LLM, SamplingParams

    path, _ = checkpoints("qwen2_moe")
    llm = LLM(str(path), dtype="float32", max_model_len=64, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,), enable_prefix_caching=False,
              async_scheduling=False)
    assert (llm.engine.expert_load() == 0).all()  # warm-up ran padding only
    outs = llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=5,
                                                    ignore_eos=True))
    load = llm.engine.expert_load()
    cfg = llm.engine.model_config
    assert load.shape == (1, cfg.num_experts)  # layer 0 sparse, layer 1 dense
    fed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    assert load.sum() == fed * cfg.num_experts_per_tok
    assert (load > 0).sum() > 1  # routing spreads over experts
    ((layer, tokens, imbalance),) = llm.engine.router_statistics()  # status and metrics
    assert layer == 0 and tokens.tolist() == load[0].tolist()
    assert imbalance == pytest.approx(load.max() / load.mean())

    from server.engine_core import EngineSnapshot
    from server.metrics import Metrics
    text = Metrics("moe").scrape(EngineSnapshot.of(llm.engine)).decode()
    (line,) = [x for x in text.splitlines() if x.startswith("jaxserve:expert_imbalance{")]
    assert 'layer="0"' in line and float(line.split()[-1]) == pytest.approx(imbalance)
