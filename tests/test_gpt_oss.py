"""gpt-oss: attention sinks on alternating sliding and full layers, YaRN, biased
projections, and its experts (a router with a bias, top-k softmaxed, gate and up
interleaved in one stack with biases, the clamped SwiGLU, down biases) against
transformers' GptOssForCausalLM on a tiny random checkpoint (conftest: sinks and biases
drawn as large as what they join, a clamp low enough to bite). Its prompt logits in every
weight layout are test_parity's; tolerances as there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hf_greedy
from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
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


@pytest.mark.slow
def test_tensor_expert_and_data_parallel_match_transformers(checkpoints, prompts, tmp_path):
    """On 8 CPU devices (tests/gpt_oss_multidevice_check.py): the 4 heads and their sinks
    split over 2 and 4 devices, the TPU kernel per device, the 4 experts and their biases
    split whole over 4 devices, data + tensor parallelism: transformers' greedy tokens."""
    path, hf_model = checkpoints("gpt_oss")
    want = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    out = tmp_path / "runs.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=8"}
    script = Path(__file__).parent / "gpt_oss_multidevice_check.py"
    spec = json.dumps({"prompts": prompts, "new_tokens": GREEDY.max_tokens})
    proc = subprocess.run([sys.executable, str(script), str(path), str(out), spec], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    assert set(runs) == {"tp 2", "tp 4", "tp 2 tpu-kernels", "ep 4", "dp+tp 2x2"}
    # 4 sinks over 2 / 4 model devices; the gate bias [4 experts, 32]: its MLP columns
    # split under tp, whole experts under ep.
    assert [runs[n]["sinks_shard"] for n in ("tp 2", "tp 4", "dp+tp 2x2")] == [[2], [1], [2]]
    assert runs["tp 2"]["gate_bias_shard"] == [4, 16]
    assert runs["ep 4"]["gate_bias_shard"] == [1, 32]
    for name, run in runs.items():
        assert run["tokens"] == want, name
        assert run["leaked_pages"] == 0 and run["compiles_after_warmup"] == 0, name
