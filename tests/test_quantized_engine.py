"""The engine with our Pallas kernels (interpret mode), quantized weights and KV caches,
and converted (Orbax) checkpoints."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxserve.loading.safetensors as safetensors
from jaxserve import LLM, SamplingParams
from jaxserve.cli import main

# One token bucket keeps the interpreted kernels' compile time down.
ENGINE = dict(dtype="float32", max_model_len=64, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,))
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("impl,quant", [
    pytest.param("tpu", {}, marks=pytest.mark.slow),  # ~17 s; the kernels' own tests cover it
    ("tpu", dict(quantization="int8", kv_cache_dtype="int8")),
    ("gpu", dict(quantization="int4", kv_cache_dtype="fp8")),
])
def test_kernels_give_the_reference_engines_tokens(checkpoints, prompts, impl, quant):
    """Chunked prefill (16-token budget) and decode through the Pallas attention and
    quantized-matmul kernels reproduce the pure-JAX engine's greedy tokens."""
    path, _ = checkpoints("llama")
    want = greedy(LLM(str(path), kernel_impl="reference", **ENGINE, **quant), prompts)
    got = greedy(LLM(str(path), kernel_impl=impl, interpret_kernels=True, **ENGINE, **quant),
                 prompts)
    assert got == want


@pytest.mark.parametrize("quant", [dict(quantization="int8"),
                                   dict(quantization="int4", quant_group_size=32)],
                         ids=["int8", "int4"])
def test_native_kernel_on_packed_weights_gives_the_reference_engines_tokens(
        checkpoints, prompts, quant):
    """On a CPU the engine packs its quantized linear layers (values and scales) in the
    native kernel's strips (layers.weights_for_native_matmul): prefill chunks and decode
    through the native kernel on them reproduce the pure-JAX engine's greedy tokens on
    row-major weights."""
    path, _ = checkpoints("llama")
    want = greedy(LLM(str(path), kernel_impl="reference", **ENGINE, **quant), prompts)
    llm = LLM(str(path), kernel_impl="cpu", **ENGINE, **quant)
    state = dict(nnx.to_flat_state(llm.engine.runner.params))
    q_proj = state[("layers", 0, "attn", "q_proj")]
    assert q_proj.get_metadata().get("packed") and q_proj[...].dtype in (jnp.int8, jnp.uint8)
    assert state[("layers", 0, "attn", "q_proj_scales")].get_metadata().get("packed")
    assert greedy(llm, prompts) == want


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_convert_then_serve_without_requantizing(arch, checkpoints, prompts, tmp_path,
                                                 monkeypatch):
    """A converted int8 checkpoint (for Qwen2-MoE: the expert stacks, each expert with its
    own scales, and the shared expert) restores the arrays a fresh load quantizes, without
    quantizing again, and gives the same tokens."""
    path, _ = checkpoints(arch)
    out = tmp_path / f"{arch}-int8"
    assert main(["convert", "--model", str(path), "--out", str(out), "--quantization", "int8",
                 "--dtype", "float32"]) == 0
    assert {"config.json", "jaxserve.json", "params"} <= {p.name for p in out.iterdir()}
    fresh = LLM(str(path), quantization="int8", **ENGINE)

    def no_quantizing(*args, **kwargs):
        raise AssertionError("a converted checkpoint must not be quantized again")

    monkeypatch.setattr(safetensors, "quantize", no_quantizing)
    restored = LLM(str(out), **ENGINE)
    assert restored.engine.config.quantization == "int8"
    fresh_state = dict(nnx.to_flat_state(fresh.engine.runner.params))
    for key, var in nnx.to_flat_state(restored.engine.runner.params):
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(fresh_state[key][...]))
    state = dict(nnx.to_flat_state(restored.engine.runner.params))
    assert state[("layers", 0, "attn", "q_proj")][...].dtype == jnp.int8
    if arch == "qwen2_moe":
        assert state[("layers", 0, "mlp", "gate_proj")][...].dtype == jnp.int8
        assert state[("layers", 0, "mlp", "gate_proj_scales")][...].shape == (8, 1, 32)
    assert greedy(restored, prompts) == greedy(fresh, prompts)
    with pytest.raises(ValueError, match="holds int8 weights"):
        LLM(str(out), quantization="int4", **ENGINE)
    assert main(["convert", "--model", str(path), "--out", str(out)]) == 2  # not empty


# Heads whose quantization changes greedy tokens (32 and 9 of the 48 differ from the float
# head's), so that a float head would fail.
@pytest.mark.parametrize("arch, head", [
    ("llama", dict(lm_head_quantization="int4", lm_head_group_size=32)),
    ("qwen2", dict(lm_head_quantization="int8")),
    ("qwen2", dict(lm_head_quantization="int4", lm_head_group_size=16, lm_head_zero_points=True,
                   embed_from_lm_head=True)),
], ids=["untied-int4", "tied-int8", "tied-int4-lookups"])
def test_quantized_lm_head_gives_transformers_tokens_on_its_dequantized_weights(
        arch, head, checkpoints, prompts):
    """`lm_head_quantization` quantizes the LM head alone (a tied one as a copy: lookups
    read the float embedding, or with `embed_from_lm_head` the quantized head's columns,
    no float embedding held): greedy tokens equal transformers' with the head (and those
    lookups' embedding) replaced by the quantized head's dequantized weights and
    everything else as stored, on the native CPU kernel (the head packed in its strips)
    and on the reference."""
    import torch

    from conftest import hf_greedy
    from pallas_kernels.quantized_matmul.formats import dequantize, quantize

    path, model = checkpoints(arch)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    w = state.get("lm_head.weight", state["model.embed_tokens.weight"]).numpy()  # [V, H]
    kind, group = head["lm_head_quantization"], head.get("lm_head_group_size")
    values, scales = quantize(w.T.astype(np.float32), kind, group,
                              zero_points=head.get("lm_head_zero_points", False))
    state["lm_head.weight"] = torch.from_numpy(np.asarray(dequantize(values, scales, kind)).T
                                               .copy())
    lookups = head.get("embed_from_lm_head", False)
    if lookups:
        state["model.embed_tokens.weight"] = state["lm_head.weight"].clone()
    cfg = type(model.config).from_dict({**model.config.to_dict(), "tie_word_embeddings": False})
    oracle = type(model)(cfg).eval()
    oracle.load_state_dict(state)
    want = [hf_greedy(oracle, p, GREEDY.max_tokens) for p in prompts]
    for impl in ("cpu", "reference"):
        llm = LLM(str(path), kernel_impl=impl, **ENGINE, **head)
        params = dict(nnx.to_flat_state(llm.engine.runner.params))
        assert params[("lm_head",)][...].dtype == (jnp.int8 if kind == "int8" else jnp.uint8)
        assert (("embed",) not in params) if lookups else \
            params[("embed",)][...].dtype == jnp.float32
        assert bool(params[("lm_head",)].get_metadata().get("packed")) == (impl == "cpu")
        assert greedy(llm, prompts) == want, impl


def test_quantized_embedding_gives_transformers_tokens_on_its_dequantized_table(
        checkpoints, prompts):
    """An untied model's embedding held quantized (a `quant_overrides` entry "embed", which
    a GGUF file's quantized `token_embd` sets; here alone, on a float checkpoint): no float
    table is held, and greedy tokens equal transformers' with the embedding replaced by
    the quantized table's dequantized values, on the native CPU kernels and the
    reference. An override naming no layer is refused."""
    import torch

    from conftest import hf_greedy
    from pallas_kernels.quantized_matmul.formats import dequantize, quantize

    path, model = checkpoints("llama")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    table = state["model.embed_tokens.weight"].numpy()  # [V, H]
    values, scales = quantize(table.T.astype(np.float32), "int4", 16, zero_points=True)
    state["model.embed_tokens.weight"] = torch.from_numpy(
        np.asarray(dequantize(values, scales, "int4")).T.copy())
    oracle = type(model)(model.config).eval()
    oracle.load_state_dict(state)
    want = [hf_greedy(oracle, p, GREEDY.max_tokens) for p in prompts]
    float_oracle = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    assert want != float_oracle  # the quantization shows in the tokens
    embed = dict(quant_overrides=[["embed", "int4", 16, True]])
    for impl in ("cpu", "reference"):
        llm = LLM(str(path), kernel_impl=impl, **ENGINE, **embed)
        params = dict(nnx.to_flat_state(llm.engine.runner.params))
        held = params[("embed",)][...]  # by rows: [vocab, hidden / 2] bytes
        assert (held.dtype, held.shape) == (jnp.uint8, (table.shape[0], table.shape[1] // 2))
        assert greedy(llm, prompts) == want, impl
    with pytest.raises(ValueError, match=r"\['layers.9.mlp.down_proj'\], which are not"):
        LLM(str(path), **ENGINE, quantization="int8",
            quant_overrides=[["layers.9.mlp.down_proj", "int4", 32, False]])
