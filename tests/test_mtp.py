"""DeepSeek-V3's multi-token-prediction layer as the draft head (speculative_config method
"mtp"), read from the target's own checkpoint: the drafts jaxserve proposes at every step
are those of the layer run in torch (eagle_reference.DeepSeekMtp: transformers'
DeepseekV3DecoderLayer between eh_proj and shared_head.norm) on transformers' features of
the same tokens, and the output is transformers' greedy tokens whatever it guesses."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jax.numpy as jnp
import pytest
import torch
import transformers as tf
from flax import nnx
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import hf_greedy
from eagle_reference import DeepSeekMtp
from jaxserve import LLM, SamplingParams
from jaxserve.config import SpeculativeConfig
from test_eagle import check_against_reference, record
from test_speculative import ENGINE, check_clean, tokens

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def write_mtp(target_dir: Path, target, out: Path, seed: int = 5) -> DeepSeekMtp:
    """`target_dir` (its files linked) with an MTP layer as DeepSeek ships one: config.json's
    num_nextn_predict_layers 1, and `model.layers.{L}.*` in a file of its own (its block
    under a decoder layer's names, enorm, hnorm, eh_proj, shared_head.norm, and copies of
    the target's LM head and embedding). Returns the layer in torch."""
    layers = target.config.num_hidden_layers
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers + 1
    torch.manual_seed(seed)
    grown = tf.DeepseekV3ForCausalLM(cfg).eval()  # its last layer: the MTP block (experts)
    block = grown.model.layers[layers]
    h = cfg.hidden_size
    with torch.no_grad():
        block.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(cfg.n_routed_experts))
        block.self_attn.q_b_proj.weight.mul_(4)  # sharp: a position out of place shows
        head = DeepSeekMtp(target.config, block, target.model.rotary_emb).eval()
        for norm in (head.enorm, head.hnorm, head.head_norm):
            norm.weight.copy_(1 + 0.2 * torch.randn(h))
    grown.save_pretrained(out.parent / "grown")
    prefix = f"model.layers.{layers}."
    tensors = {}
    for file in sorted((out.parent / "grown").glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors |= {n: f.get_tensor(n) for n in f.keys() if n.startswith(prefix)}
    tensors |= {prefix + "enorm.weight": head.enorm.weight,
                prefix + "hnorm.weight": head.hnorm.weight,
                prefix + "eh_proj.weight": head.eh_proj.weight,
                prefix + "shared_head.norm.weight": head.head_norm.weight,
                prefix + "shared_head.head.weight": target.lm_head.weight,
                prefix + "embed_tokens.weight": target.model.embed_tokens.weight}
    out.mkdir()
    for file in target_dir.iterdir():
        if file.name != "config.json":
            (out / file.name).symlink_to(file)
    config = json.loads((target_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    save_file({n: t.detach().contiguous() for n, t in tensors.items()}, out / "mtp.safetensors")
    return head


@pytest.fixture(scope="module")
def mtp(checkpoints, tmp_path_factory):
    path, target = checkpoints("deepseek_v3")
    out = tmp_path_factory.mktemp("mtp") / "deepseek_v3_mtp"
    return out, write_mtp(path, target, out)


def test_drafts_are_the_mtp_layers_and_tokens_the_targets(checkpoints, mtp, prompts):
    path, head = mtp
    target = checkpoints("deepseek_v3")[1]
    llm = LLM(str(path), **ENGINE, speculative_config={
        "method": "mtp", "num_speculative_tokens": K, "disable_by_batch_size": None})
    seen = record(llm)
    out = llm.generate(prompts, GREEDY)
    assert tokens(out) == [hf_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    check_against_reference(seen, head, target, (target.config.num_hidden_layers,))
    check_clean(llm)


def test_mtp_needs_the_layer(checkpoints):
    with pytest.raises(ValueError, match="takes no model"):
        SpeculativeConfig(method="mtp", model="elsewhere")
    for arch in ("llama", "deepseek_v3"):  # no latent attention; no MTP layer in the file
        with pytest.raises(ValueError, match="multi-token-prediction layer"):
            LLM(str(checkpoints(arch)[0]), **ENGINE, speculative_config={"method": "mtp"})


@pytest.mark.slow  # two engines' worth of compiling beside the default run's
def test_mtp_layer_of_an_fp8_checkpoint_served_as_stored(checkpoints, mtp, prompts, tmp_path):
    """DeepSeek-V3's FP8 format with the MTP layer: its block's linear layers and experts
    stay FP8 as stored, and the tokens are transformers' on the dequantized weights."""
    from test_deepseek import make_fp8_checkpoint

    qdir, oracle_dir = make_fp8_checkpoint(mtp[0], tmp_path / "fp8")
    oracle = tf.DeepseekV3ForCausalLM.from_pretrained(
        oracle_dir, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(str(qdir), **ENGINE, speculative_config={
        "method": "mtp", "num_speculative_tokens": K, "disable_by_batch_size": None})
    head = dict(nnx.to_flat_state(llm.engine.speculator.proposer.params))
    assert head[("layers", 0, "attn", "q_b_proj")][...].dtype == jnp.float8_e4m3fn
    assert head[("layers", 0, "mlp", "down_proj")][...].dtype == jnp.float8_e4m3fn  # experts
    out = llm.generate(prompts[:2], GREEDY)
    assert tokens(out) == [hf_greedy(oracle, p, GREEDY.max_tokens) for p in prompts[:2]]
    check_clean(llm)
