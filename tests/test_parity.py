"""Parity with Hugging Face transformers (PyTorch, float32) on tiny random checkpoints.

Tolerance for prompt logits: |ours - HF| <= 1e-4 + 1e-4 * |HF|. Both sides compute in
float32 with different op orders (einsum vs. linear, fused vs. separate softmax), which
moves logits of these 2-layer, 64-wide models by ~1e-6; 1e-4 leaves 100x headroom while
any real error (rope, bias, norm, window, head layout) moves them by more than 1e-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import ON_GPU, hf_greedy
from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.loading.safetensors import load_checkpoint
from jaxserve.models.layers import weights_for_native_matmul
from jaxserve.models.transformer import AttentionMetadata, kv_cache_layout
from sharding.mesh import make_mesh
from sharding.rules import ShardingContext

ARCHS = ["llama", "mistral", "phi3", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral",
         "qwen2_moe", "qwen3_moe"]
NEW_TOKENS = 32
# Small buckets keep the number of compiled programs per engine low.
ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))


def ragged_prompt_logits(model_dir, prompts, page_size=4, seed=0, options=ModelOptions(),
                         kv_dtype=jnp.float32, laid_out=False, pack=False):
    """Our logits at every prompt position, all prompts in one ragged batch, pages shuffled;
    with `laid_out`, from the float weights laid out [N, K] as the engine holds them on one
    CPU device, and with `pack` also packed where their shapes allow."""
    cfg = ModelConfig.from_file(model_dir)
    graphdef, params = load_checkpoint(model_dir, cfg, jnp.float32, ShardingContext(make_mesh()),
                                       options)
    if laid_out:
        params = weights_for_native_matmul(params, pack=pack)
        assert pack == any(v.get_metadata().get("packed") for _, v in nnx.to_flat_state(params))
    model = nnx.merge(graphdef, params)
    rng = np.random.default_rng(seed)
    per_seq = max(-(-len(p) // page_size) for p in prompts)
    num_pages = per_seq * len(prompts) + 3
    pages = rng.permutation(num_pages)[: per_seq * len(prompts)].reshape(len(prompts), per_seq)
    ids, pos, slots, cu = [], [], [], [0]
    for s, p in enumerate(prompts):
        ids += p
        pos += range(len(p))
        slots += [pages[s, j // page_size] * page_size + j % page_size for j in range(len(p))]
        cu.append(len(ids))
    layout = kv_cache_layout(cfg, num_pages, page_size, kv_dtype)
    caches = [tuple(jnp.zeros(shape, dtype) for shape, dtype, _ in layout)] * cfg.num_layers
    meta = AttentionMetadata(
        slot_mapping=jnp.array(slots, jnp.int32), cu_q_lens=jnp.array(cu, jnp.int32),
        kv_lens=jnp.array([len(p) for p in prompts], jnp.int32),
        page_indices=jnp.array(pages, jnp.int32), num_seqs=jnp.array([len(prompts)], jnp.int32))
    hidden, _ = jax.jit(model.__call__)(jnp.array(ids, jnp.int32), jnp.array(pos, jnp.int32),
                                        caches, meta)
    logits = np.asarray(model.logits(hidden))
    return [logits[cu[s]:cu[s + 1]] for s in range(len(prompts))]


def assert_matmul_weights_transposed(params, cfg: ModelConfig):
    """Every float weight of a matmul (and an untied LM head) is laid out [N, K], nothing
    else is."""
    flat = list(nnx.to_flat_state(params))
    for path, var in flat:
        name, axes = path[-1], var.get_metadata()["logical_axes"]
        matmul_weight = (name.endswith("_proj") or name == "lm_head") and "experts" not in axes
        assert var.get_metadata().get("transposed", False) == matmul_weight, path
    q = next(var for path, var in flat if path[-1] == "q_proj")
    assert q.shape == (cfg.num_heads, cfg.head_dim, cfg.hidden_size)


def assert_native_row_ops(llm, cfg: ModelConfig, kv_writes: int | None = None):
    """One CPU device: each layer rotates q and k, writes its K/V (`kv_writes` of them
    natively; None: every layer's), norms its rows and (dense MLPs, shared experts) gates
    its activation with the native kernels, on the real rows."""
    runner = llm.engine.runner
    text = runner.compiled(runner.builder.all_buckets()[0]).as_text()
    count = lambda target: text.count(f'custom_call_target="{target}"')  # noqa: E731
    gated = sum(not sparse or cfg.shared_expert_intermediate_size > 0
                for sparse in cfg.sparse_layers)
    assert count("jaxserve_rope") == cfg.num_layers
    assert count("jaxserve_write_kv") == (cfg.num_layers if kv_writes is None else kv_writes)
    assert count("jaxserve_rms_norm") == cfg.num_layers * (4 if cfg.sandwich_norms else 2)
    assert count("jaxserve_gated_act") == gated


# The weights as loaded ([K, N]); laid out [N, K] as the engine holds them on one CPU device,
# unpacked (CPUs without AVX-512) and packed where their shapes allow (q, gate/up, down and
# the LM head or tied embedding here; k/v have 32 columns), through the native kernel and
# through XLA's dots (where the engine never sends them).
LAYOUTS = {"kn": (False, False, ModelOptions()), "nk": (True, False, ModelOptions()),
           "nk-xla": (True, False, ModelOptions(kernel_impl="reference")),
           "packed": (True, True, ModelOptions()),
           "packed-xla": (True, True, ModelOptions(kernel_impl="reference"))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS + ["deepseek_v3", "deepseek_v2", "gpt_oss"])
def test_prompt_logits_match_transformers(arch, layout, checkpoints, prompts):
    path, hf_model = checkpoints(arch)
    laid_out, pack, options = LAYOUTS[layout]
    ours = ragged_prompt_logits(path, prompts, options=options, laid_out=laid_out, pack=pack)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf_model(torch.tensor([prompt])).logits[0].numpy()
        assert want.std() > 0.3, "random logits too flat to compare"
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2_yarn", "llama_yarn"])
def test_yarn_rope_matches_transformers(arch, checkpoints, prompts):
    """YaRN's frequencies and attention factor: prompt logits (as loaded and as the engine
    lays the weights out) and the engine's greedy tokens are transformers'."""
    path, hf_model = checkpoints(arch)
    assert ModelConfig.from_file(path).rope_scaling.rope_type == "yarn"
    for laid_out in (False, True):
        ours = ragged_prompt_logits(path, prompts, laid_out=laid_out, pack=laid_out)
        for prompt, got in zip(prompts, ours):
            with torch.no_grad():
                want = hf_model(torch.tensor([prompt])).logits[0].numpy()
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    _, outs = _generate(path, prompts[1:3], enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts[1:3]]


def test_longrope_and_partial_rotary_match_transformers(checkpoints, prompts):
    """Phi-3.5 / Phi-4-mini's rope: half of each head turned, by LongRoPE's short factors
    for an engine whose context fits the original 32 positions and by its long ones (every
    position) past it, as transformers does for a sequence of that length; prompt
    logprobs and greedy tokens are transformers'."""
    path, hf_model = checkpoints("phi3_longrope")
    cfg = ModelConfig.from_file(path)
    assert (cfg.rotary_dim, cfg.rope_scaling.use_long_factor) == (8, True)
    for max_model_len, prompt in ((32, prompts[1]), (128, prompts[3])):
        new = min(12, max_model_len - len(prompt))  # within the original 32, or past it
        llm = LLM(str(path), **{**ENGINE, "max_model_len": max_model_len})
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new,
                                                    ignore_eos=True, prompt_logprobs=0))[0]
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0]
        want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), prompt[1:]]
        got = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, new)


@pytest.fixture(scope="module")
def hf_continuations(checkpoints, prompts):
    return {arch: [hf_greedy(checkpoints(arch)[1], p, NEW_TOKENS) for p in prompts]
            for arch in ARCHS}


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _generate(path, prompts, **overrides):
    llm = LLM(str(path), **{**ENGINE, **overrides})
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.runner.compiles_after_warmup == 0
    assert llm.engine.scheduler.allocator.num_used_pages == 0, "pages leaked"
    return llm, outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(arch, checkpoints, prompts, hf_continuations):
    path, _ = checkpoints(arch)
    llm, outs = _generate(path, prompts, enable_prefix_caching=False)
    cfg = ModelConfig.from_file(path)
    if ON_GPU:  # the step runs the GPU attention kernel (Triton) in each layer
        runner = llm.engine.runner
        text = runner.compiled(runner.builder.all_buckets()[0]).as_text()
        assert text.count("__gpu$xla.gpu.triton") >= cfg.num_layers
    else:  # one CPU device with the native matmul: the engine holds the weights [N, K] and
        # runs the native row-wise ops
        assert_matmul_weights_transposed(llm.engine.runner.params, cfg)
        assert_native_row_ops(llm, cfg)
    for out, prompt, want in zip(outs, prompts, hf_continuations[arch]):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_chunked_prefill(arch, checkpoints, prompts, hf_continuations):
    """A 16-token budget splits the 17-, 30- and 43-token prompts into chunks."""
    path, _ = checkpoints(arch)
    _, outs = _generate(path, prompts, max_num_batched_tokens=16, token_buckets=(16,),
                        enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_continuations[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_preemption(arch, checkpoints, prompts, hf_continuations):
    """A pool of 32 pages (128 tokens) cannot hold four sequences of up to 75 tokens."""
    path, _ = checkpoints(arch)
    llm, outs = _generate(path, prompts, num_pages=32, enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_continuations[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_prefix_cache_hits(arch, checkpoints, prompts):
    """Prompts sharing a 24-token prefix: later ones reuse its pages, outputs unchanged."""
    path, hf_model = checkpoints(arch)
    shared = prompts[3][:24]
    family = [shared + p[:n] for p, n in zip(prompts, (3, 6, 9, 1))]
    want = [hf_greedy(hf_model, p, NEW_TOKENS) for p in family]
    llm = LLM(str(path), **ENGINE, enable_prefix_caching=True)
    first = llm.generate(family[:1], GREEDY)  # fills the cache
    rest = llm.generate(family[1:], GREEDY)
    assert [o.outputs[0].token_ids for o in first + rest] == want
    assert all(o.num_cached_tokens == 24 for o in rest)
    assert llm.engine.scheduler.allocator.num_used_pages == 0


def test_router_ties_match_transformers(tmp_path, prompts):
    """Mixtral with expert 2 a copy of expert 1 (router row and weights): the two tie on
    every token, so top-2 picks among tied experts and renormalises over them. Which of
    the tied indices is picked is the implementation's (jaxserve: the lower, as
    lax.top_k; torch.topk on a CPU: whatever std::nth_element leaves, e.g. [1, 3] of
    [.2, .3, .3, .3, .1]), but copies give the same output either way, so logits and
    greedy tokens must match transformers."""
    from conftest import make_checkpoint

    model = make_checkpoint("mixtral", tmp_path)
    with torch.no_grad():
        for layer in model.model.layers:
            moe = layer.mlp
            moe.gate.weight[2] = moe.gate.weight[1]
            moe.experts.gate_up_proj[2] = moe.experts.gate_up_proj[1]
            moe.experts.down_proj[2] = moe.experts.down_proj[1]
    model.save_pretrained(tmp_path)
    ours = ragged_prompt_logits(tmp_path, prompts)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    _, outs = _generate(tmp_path, prompts[:2])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, NEW_TOKENS)
                                                      for p in prompts[:2]]
