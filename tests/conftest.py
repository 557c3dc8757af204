"""Shared fixtures: tiny random Hugging Face checkpoints, made with transformers itself."""

from __future__ import annotations

import os
import tempfile
import time

# Tests run on the CPU (Pallas kernels in interpret mode). XLA:CPU spends 0.1-0.4 s of
# LLVM time per fusion on these 2-core machines; optimisation level 0 halves compile time
# without changing results, and a per-run persistent cache (one per pytest-xdist worker)
# lets engines with the same shapes share compiled programs (servers the tests start use
# it too, through the environment, and leave the user's cache alone). Benchmarks use
# neither.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxserve-test-xla-")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

# On a GPU (`JAX_PLATFORMS=cuda XLA_FLAGS= pytest ...`, benchmarks/gpu_session.sh) the GPU
# kernels run compiled, not interpreted, and float32 dots are IEEE: XLA's default on
# NVIDIA GPUs is TF32 (10-bit mantissas), which the float32 oracles here would flag.
ON_GPU = jax.default_backend() == "gpu"
if ON_GPU:
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml's addopts): for the default run one worker more than the
    cores. Its workers wait on servers, subprocesses and timers, and a file's tail runs
    alone: on a 2-core VM it took 25.9 minutes on 2 workers, 17.7 on 3, 17.8 on 4
    (2026-12-04). The slow tests get one per core: their 8-device checks are subprocesses
    that use every core themselves (on 3 workers, test_sharding's ran past its 900 s)."""
    cores = os.cpu_count() or 1
    slow_only = config.option.markexpr.replace("not slow", "").strip() == "slow"
    return cores if slow_only else cores + 1


def kernel_interpret(impl: str) -> bool:
    """Whether a test runs the Pallas kernel `impl` in interpret mode: always, except the
    GPU kernel on a GPU."""
    return not (ON_GPU and impl == "gpu")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

VOCAB = 320  # > 259, so the demo's byte tokenizer fits every tiny model


def _hf_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, initializer_range=0.1,
                  bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5)
    if arch == "llama":  # Llama 3 rope scaling, GQA 4:2, untied
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            **common, num_key_value_heads=2, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "llama8":  # 8 heads, 2 KV heads: tensor parallel up to 8 (KV replicated past 2)
        return tf.LlamaForCausalLM, tf.LlamaConfig(**{**common, "num_attention_heads": 8},
                                                   num_key_value_heads=2)
    if arch == "nemo":  # Mistral Nemo's shape (a GGUF "llama"): head_dim != hidden / heads
        return tf.LlamaForCausalLM, tf.LlamaConfig(**common, num_key_value_heads=2, head_dim=32)
    if arch == "mistral":  # sliding window (8) far smaller than the prompts
        return tf.MistralForCausalLM, tf.MistralConfig(
            **common, num_key_value_heads=2, sliding_window=8)
    if arch == "phi3":  # fused qkv_proj and gate_up_proj, a sliding window on every layer
        return tf.Phi3ForCausalLM, tf.Phi3Config(
            **common, num_key_value_heads=2, sliding_window=8, pad_token_id=VOCAB - 1)
    if arch == "phi3_longrope":  # Phi-3.5 / Phi-4-mini: LongRoPE past 32, half of a head turned
        return tf.Phi3ForCausalLM, tf.Phi3Config(
            **common, num_key_value_heads=2, pad_token_id=VOCAB - 1, partial_rotary_factor=0.5,
            original_max_position_embeddings=32, rope_scaling={
                "rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2],
                "long_factor": [1.5, 3.0, 6.0, 11.0]})
    if arch == "qwen2":  # q/k/v bias, MQA, tied embeddings
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            **common, num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=False)
    if arch == "qwen2_yarn":  # Qwen2.5's long-context YaRN (attention factor from factor)
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            **common, num_key_value_heads=2, use_sliding_window=False,
            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64})
    if arch == "llama_yarn":  # every YaRN field: mscale ratio, own betas, no truncation
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            **common, num_key_value_heads=2, rope_theta=20000.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 2.0,
                          "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0,
                          "truncate": False, "original_max_position_embeddings": 64})
    if arch == "qwen3":  # q/k RMSNorm, head_dim != hidden / heads
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    if arch == "mixtral":  # 4 experts of intermediate_size, top-2, weights renormalised
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2_moe":  # shared expert with its sigmoid gate; layer 1 dense
        return tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            **common, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48,
            norm_topk_prob=False, mlp_only_layers=[1], use_sliding_window=False)
    if arch == "qwen3_moe":  # q/k norm, 8 experts, top-3 renormalised
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)
    if arch == "gemma2":  # soft-caps set low enough to bite; sliding layers first
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=8, attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
    if arch == "gemma3":  # q/k norms; the sliding layer's rope differs from the full one's
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **common, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1000000.0}})
    if arch == "deepseek_v3":  # latent attention with a q bottleneck, YaRN's mscale; experts
        # by biased sigmoid scores in 2 of 4 groups, one shared expert, layer 0 dense
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **common, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 64})
    if arch == "deepseek_v2":  # one q projection, complex-pair rope; softmax experts chosen
        # in 1 of 2 groups by their best, two shared experts, layer 0 dense
        return tf.DeepseekV2ForCausalLM, tf.DeepseekV2Config(
            **common, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, n_group=2, topk_group=1,
            topk_method="group_limited_greedy", num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
            routed_scaling_factor=1.5)
    if arch == "gpt_oss":  # sinks, biases everywhere, a clamp low enough to bite, 4 experts
        # top-2 softmaxed over their logits; sliding then full layers, YaRN untruncated
        return tf.GptOssForCausalLM, tf.GptOssConfig(
            **{**common, "intermediate_size": 32}, num_key_value_heads=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                             "original_max_position_embeddings": 64})
    raise ValueError(arch)


def make_checkpoint(arch: str, path: Path, seed: int = 0):
    """Save a random tiny model of `arch` with save_pretrained; return the torch model."""
    import torch

    from jaxserve.demo import write_byte_tokenizer

    cls, cfg = _hf_config(arch)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    for name, buffer in model.named_buffers():  # DeepSeek-V3's router bias: not zeros
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.05 * torch.randn(buffer.shape))
    with torch.no_grad():  # gpt-oss's sinks and biases: as large as what they join
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(1.0 + torch.randn(param.shape))
            elif arch == "gpt_oss" and name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape))
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return model


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test module's compiled programs when it ends (its engines are gone by
    then). XLA:CPU maps every executable's code in mappings of its own, and a whole run's
    executables kept by JAX's caches passed the kernel's limit of 65530 memory maps per
    process (vm.max_map_count) in test_speculative, where XLA segfaulted serializing the
    next program: 62k maps at the crash, ~30k entering the module."""
    yield
    import gc

    gc.collect()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{arch: (directory, torch model)} built once per test session."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            cache[arch] = (path, make_checkpoint(arch, path))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def prompts():
    """Token-id prompts of different lengths (up to several pages of 4 tokens)."""
    rng = np.random.default_rng(1234)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 17, 30, 43)]


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"]


def save_peft_adapter(base, path, rank: int = 8, alpha: int = 16, rslora: bool = False,
                      targets=ALL_PROJECTIONS, seed: int = 0):
    """A random PEFT LoRA adapter over `base` (a transformers model), saved in `path`
    with PEFT's own save_pretrained; returns the PEFT model."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
        init_lora_weights=False, lora_dropout=0.0))
    model.eval()
    model.save_pretrained(path)
    return model


def run_on_cpu_devices(script: str, *args, devices: int = 8, timeout: int = 900) -> None:
    """Run tests/`script` with `args` in a process of its own on `devices` CPU devices
    (the count is fixed when JAX starts); fail with its stderr's end if it fails."""
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + f" --xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / script),
                           *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers' own incremental decoding (its KV cache)."""
    import torch

    out, ids = [], torch.tensor([prompt])
    past = None
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(torch.argmax(res.logits[0, -1])))
            ids = torch.tensor([[out[-1]]])
    return out


# --- a TPU chip to compile for ahead of time (libtpu, no TPU) ----------------------------

TOPOLOGIES = ["v5e:2x2", "v6e:2x2"]


def tpu_chip(topology: str):
    """Chip 0 of a TPU topology, waiting while another process holds libtpu's lockfile."""
    pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")
    from sharding.planner import tpu_devices

    deadline = time.monotonic() + 300
    while True:
        try:
            return tpu_devices(topology)[0]
        except Exception as e:  # noqa: BLE001 - libtpu raises a bare runtime error
            if "lockfile" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(5)


@pytest.fixture(scope="session", params=TOPOLOGIES)
def chip(request):
    """Chip 0 of each TPU generation we compile for (v5e, v6e), one after the other."""
    return tpu_chip(request.param)
