"""GGUF files (llama.cpp's and Ollama's format) served as they are: `--model file.gguf`.

What this reads: the Llama family (`general.architecture` "llama": Llama, Mistral, SmolLM,
TinyLlama and the like; with `expert_count`, Mixtral), Qwen2 and Qwen3 (their q/k/v biases,
q/k norms), Qwen2-MoE and Qwen3-MoE (experts stacked `[E, N, K]` in the file, split into
one tensor per expert; Qwen2-MoE's shared expert), Gemma 2 and Gemma 3 (soft-caps, sliding
layers, Gemma 3's local rope and linear rope scaling; llama.cpp stores their norms as
1 + weight), Phi-3 (fused attn_qkv and ffn_up, split as they load; its sliding window,
which transformers applies and llama.cpp ignores; LongRoPE from the rope_factors_long /
_short tensors; a partial rope by rope.dimension_count), gpt-oss (`_gpt_oss_config`; its
gate / up / down expert stacks as Hugging Face's stacked names, MXFP4 ones kept as our fp4:
gguf_blocks.mxfp4_as_ours); with a byte-level BPE vocabulary
(`tokenizer.ggml.model` "gpt2") split as GPT-2 splits (`tokenizer.ggml.pre` "default",
"gpt2", "smollm") or by Llama 3's, Qwen2's, Tekken's or o200k's regex ("llama-bpe",
"qwen2", "tekken", "gpt-4o" and their
aliases, as transformers' GGUF loader names them), or a SentencePiece BPE vocabulary
(`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama; merges implied by the
scores, byte fallback; Gemma's variant by architecture).
Settings a GGUF file does not carry follow llama.cpp's rules (Gemma's query scale, Gemma
3's sliding-window pattern of 6 and local rope base of 10000); Llama 3.1-3.3's rope scaling,
which the converter stores as per-frequency factors (`rope_freqs`), is read back as the
llama3 `rope_scaling` that gives them, and YaRN's metadata (Qwen2.5 / Qwen3 files
converted for long context) as the yarn one. Anything else (other architectures, other
rope scalings) is refused at load, naming the field. The model config,
the tokenizer (vocabulary, merges, control tokens, BOS/EOS, `add_bos`) and the chat
template come from the file's metadata; the weights of every type the `gguf` package
dequantizes (F32/F16/BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants, the IQ types) are
dequantized to the engine's dtype as they are read, one tensor at a time (no float copy of
the model on disk), except that the decoder linear layers of the legacy, K-quant and IQ
types (Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ1_S ... IQ4_XS) are kept quantized (the
experts' stacks and a shared expert's too), each layer in the format of ours that holds its
type as stored (gguf_blocks.py: Q4_0 as int4 in groups of 32, Q4_K as int4 in groups of 32
with zero points, Q6_K as int8 in groups of 16, IQ4_XS's levels and IQ3_S's lattice
points as int8 in groups of 32; a Q4_K_M file's Q6_K layers are `quant_overrides` beside
its Q4_K ones, and a float layer an override held in the dtype;
`stored_settings`; `--quantization` given: all dequantized and quantized our way). The
LM head of such a file is kept likewise, in the format that holds its own type (SmolLM2's
tied Q8_0 head as int8 in groups of 32, which token lookups read too, dequantizing the
columns they take: no float embedding; `--lm-head-quantization` given: dequantized and
quantized our way, beside a float embedding), and so is an untied file's embedding
(Llama 3's Q4_K `token_embd` as int4 in groups of 32 with zero points: a `quant_overrides`
entry "embed", held by rows; lookups dequantize the rows they take).
llama.cpp's converter stores attn_q and attn_k of its Llama (and Mixtral) with each head's
rotary halves interleaved; they are put back in Hugging Face's order.

The tokenizer is written once, as tokenizer.json + tokenizer_config.json (and config.json)
in a cache directory named for the file, and read from there like any checkpoint's. It is
built as transformers' GGUF loader builds it (`transformers.integrations.gguf`), the oracle
of tests/test_gguf.py.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxserve.loading import gguf_blocks
from jaxserve.loading.safetensors import FUSED
from jaxserve.loading.tokenizer import gpt2_byte_table

# general.architecture -> (model_type, class); "llama" with experts is Mixtral.
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                 "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
                 "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                 "gemma2": ("gemma2", "Gemma2ForCausalLM"),
                 "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
                 "phi3": ("phi3", "Phi3ForCausalLM"),
                 "gpt-oss": ("gpt_oss", "GptOssForCausalLM")}
MIXTRAL = ("mixtral", "MixtralForCausalLM")
# llama.cpp's converter interleaves q/k's rotary halves for these (its LlamaModel only).
PERMUTED_QK = {"llama", "mixtral"}
GEMMA = {"gemma2", "gemma3"}
# Pre-tokenizers whose text splitting is GPT-2's own regex (ByteLevel's).
GPT2_SPLITS = {"default", "gpt2", "smollm"}
# The others this reads: the regex each vocabulary's merges were learned on (Llama 3's,
# Qwen2's and Tekken's, as llama.cpp's `tokenizer.ggml.pre` names them; transformers'
# GGUF loader's table), then byte-level spelling.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken (Mistral Nemo, Mistral Small 3): words split at case changes, no
# contractions, single digits.
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# OpenAI's o200k (gpt-oss; llama.cpp's "gpt-4o"): Tekken's case-change words with
# contractions, digits in threes.
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
                "pixtral": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
                "megrez": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT, "gpt-4o": _O200K_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
# Part of the metadata directory's cache key: bump it when what is written there changes.
METADATA_VERSION = 4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj",
}
# Gemma's four norms a layer (llama.cpp's ffn_norm is the norm before the MLP).
_GEMMA_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Mixture-of-experts layers: the router, the Qwen2-MoE shared expert and its gate.
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj",
              "ffn_down_shexp": "mlp.shared_expert.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# The experts' weights, stacked [E, N, K] in the file: one Hugging Face tensor per expert.
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                  "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
# gpt-oss (llama.cpp's converter splits its interleaved gate_up stack into gate and up
# and stores its sinks as a weight): Hugging Face's stacked names, as our loader reads
# them after split_fused (loading/safetensors.py), by (GGUF stem, suffix).
_GPT_OSS_NAMES = {
    ("ffn_gate_exps", "weight"): "mlp.experts.gate_proj",
    ("ffn_up_exps", "weight"): "mlp.experts.up_proj",
    ("ffn_down_exps", "weight"): "mlp.experts.down_proj",
    ("ffn_gate_exps", "bias"): "mlp.experts.gate_bias",
    ("ffn_up_exps", "bias"): "mlp.experts.up_bias",
    ("ffn_down_exps", "bias"): "mlp.experts.down_proj_bias",
    ("ffn_gate_inp", "weight"): "mlp.router.weight", ("ffn_gate_inp", "bias"): "mlp.router.bias",
    ("attn_sinks", "weight"): "self_attn.sinks",
    ("post_attention_norm", "weight"): "post_attention_layernorm.weight"}


def is_gguf(path: str | os.PathLike | None) -> bool:
    return path is not None and str(path).endswith(".gguf") and Path(path).is_file()


def _reader(path: Path):
    try:
        import gguf
    except ImportError as e:  # a dependency; only a broken install lacks it
        raise ValueError("reading a GGUF file needs the `gguf` package (pip install gguf)") from e
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader, key: str):
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"the GGUF file lacks `{key}`")
    return value


def hf_config(reader) -> dict:
    """The model's config.json (Hugging Face keys) from the file's metadata."""
    arch = _required(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture {arch!r}: GGUF files of {sorted(ARCHITECTURES)} "
                         "are supported")
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    model_type, class_name = MIXTRAL if arch == "llama" and experts else ARCHITECTURES[arch]
    heads = int(_required(reader, f"{arch}.attention.head_count"))
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    layers = int(_required(reader, f"{arch}.block_count"))
    tokens = _required(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    config = {
        "model_type": model_type, "architectures": [class_name],
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_required(reader, f"{arch}.context_length")),
        "rms_norm_eps": float(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    llama3 = _llama3_rope(reader, config["rope_theta"], head_dim)
    if llama3 is not None:
        config["rope_scaling"] = llama3
    elif scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(
            _required(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling == "yarn":
        config["rope_scaling"] = _yarn_rope(reader, arch)
    elif scaling not in (None, "none"):
        raise ValueError(f"{arch}.rope.scaling.type = {scaling!r}: linear and yarn are the "
                         "rope scalings supported in GGUF files")
    rotary = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:  # Phi-4-mini turns 3/4 of each head
        config["partial_rotary_factor"] = rotary / head_dim
    if "rope_factors_long.weight" in names:
        config["rope_scaling"] = _longrope(reader, arch)
    if arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        config["use_sliding_window"] = False
    if arch == "phi3":  # 0: none (Phi-4); llama.cpp ignores Phi-3's, transformers does not
        config["sliding_window"] = int(_field(reader, f"{arch}.attention.sliding_window", 0)) \
            or None
    if experts:
        config.update(_moe_config(reader, arch, model_type, experts, names, layers))
    if arch in GEMMA:
        config.update(_gemma_config(reader, arch, hidden, heads, head_dim, layers))
    if arch == "gpt-oss":
        config.update(_gpt_oss_config(reader, arch, layers, config.get("rope_scaling")))
    for key in ("bos", "eos"):
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config[f"{key}_token_id"] = int(value)
    return config


def _longrope(reader, arch: str) -> dict:
    """Hugging Face's longrope `rope_scaling` of a Phi-3 file's LongRoPE (128k variants,
    Phi-3.5, Phi-4-mini): the converter's `rope_factors_long` / `rope_factors_short`
    tensors, original context and attention factor."""
    factors = {t.name: np.asarray(t.data, np.float32).reshape(-1).tolist()
               for t in reader.tensors if t.name.startswith("rope_factors_")}
    if "rope_factors_short.weight" not in factors:
        raise ValueError("rope_factors_long.weight without rope_factors_short.weight: "
                         "LongRoPE needs both")
    scaling = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
               "short_factor": factors["rope_factors_short.weight"],
               "original_max_position_embeddings": int(_required(
                   reader, f"{arch}.rope.scaling.original_context_length"))}
    attn = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    return scaling


def _yarn_rope(reader, arch: str) -> dict:
    """Hugging Face's yarn `rope_scaling` of a file's YaRN metadata. llama.cpp's YaRN
    (ggml's rope_yarn) is transformers': frequencies ramped between beta_fast and
    beta_slow turns over the original context (floor / ceil of their dimensions), rotations
    scaled by 1 + 0.1 ln(factor) times `yarn_attn_factor` (1 unless the file says)."""
    key = f"{arch}.rope.scaling"
    scaling = {"rope_type": "yarn", "factor": float(_required(reader, f"{key}.factor")),
               "original_max_position_embeddings": int(_required(
                   reader, f"{key}.original_context_length"))}
    for name in ("beta_fast", "beta_slow"):
        value = _field(reader, f"{key}.yarn_{name}")
        if value is not None:
            scaling[name] = float(value)
    # Settings with no transformers counterpart: only their neutral values are served
    # (an ext_factor below 0 is llama.cpp's "unset": 1 for YaRN).
    log_mul, ext = (_field(reader, f"{key}.{name}")
                    for name in ("yarn_log_multiplier", "yarn_ext_factor"))
    if log_mul is not None and float(log_mul) != 0.0:
        raise ValueError(f"{key}.yarn_log_multiplier = {log_mul}: only 0 is supported")
    if ext is not None and 0.0 <= float(ext) != 1.0:
        raise ValueError(f"{key}.yarn_ext_factor = {ext}: only 1 is supported")
    attn = _field(reader, f"{key}.yarn_attn_factor")
    if attn is not None and float(attn) != 1.0:
        mscale = 0.1 * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0
        scaling["attention_factor"] = float(attn) * mscale
    return scaling


# Llama 3's rope scaling parameters as released (Llama 3.1 to 3.3): original context,
# low / high frequency factors; `_llama3_rope` tries these (and a few others) against a
# file's factors.
_LLAMA3_ROPES = [(original, low, high) for original in (8192, 4096, 16384, 32768)
                 for low, high in ((1.0, 4.0), (1.0, 8.0), (2.0, 4.0), (2.0, 8.0))]


def llama3_rope_factors(inv_freq: np.ndarray, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """What each rotary frequency is divided by under Llama 3's rope scaling (1 above
    `original / high`'s wavelength, `factor` below `original / low`'s, smoothed between):
    the `rope_freqs` llama.cpp's converter writes."""
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    return np.where(wavelen < original / high, 1.0, np.where(
        wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))


def _llama3_rope(reader, theta: float, head_dim: int) -> dict | None:
    """Hugging Face's llama3 `rope_scaling` whose per-frequency factors are the file's
    `rope_freqs` tensor (llama.cpp's converter writes the factors, not the parameters, for
    Llama 3.1 and later), or None: no such tensor, or all factors 1."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    factors = np.asarray(t.data, np.float32).reshape(-1)
    if np.all(factors == 1):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    for original, low, high in _LLAMA3_ROPES if factors.shape == inv_freq.shape else ():
        if np.allclose(llama3_rope_factors(inv_freq, factor, low, high, original), factors,
                       rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError("rope_freqs.weight: per-frequency rope factors that are not Llama 3's "
                     "rope scaling with the parameters Llama 3.1-3.3 use; not supported")


def _moe_config(reader, arch: str, model_type: str, experts: int, names: set[str],
                layers: int) -> dict:
    """Mixtral's and the Qwen MoE models' expert fields. A layer without a router
    (`ffn_gate_inp`) is dense (Qwen's mlp_only_layers)."""
    used = int(_required(reader, f"{arch}.expert_used_count"))
    if model_type in ("mixtral", "gpt_oss"):
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    config = {"num_experts": experts, "num_experts_per_tok": used,
              "moe_intermediate_size": int(_required(reader,
                                                     f"{arch}.expert_feed_forward_length")),
              "decoder_sparse_step": 1,
              "mlp_only_layers": [i for i in range(layers)
                                  if f"blk.{i}.ffn_gate_inp.weight" not in names],
              # llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's
              # unless the file says otherwise.
              "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm",
                                            arch == "qwen3moe"))}
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(_field(
            reader, f"{arch}.expert_shared_feed_forward_length", 0))
    return config


def _gpt_oss_config(reader, arch: str, layers: int, rope_scaling: dict | None) -> dict:
    """gpt-oss's fields a GGUF file does not spell as Hugging Face does: biased attention,
    its sliding window on every other layer from the first (llama.cpp's pattern of 2,
    unless the file gives one), and YaRN without truncated correction dimensions (the
    released models' `truncate: false`, what transformers computes; llama.cpp's ggml
    rounds them to whole dimensions). The SwiGLU clamp (7) and alpha (1.702) are the
    models' and llama.cpp's constants (our config's defaults)."""
    types = _layer_types(reader, arch, layers, 2)
    config = {"attention_bias": True, "layer_types": types,
              "sliding_window": int(_required(reader, f"{arch}.attention.sliding_window"))}
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
        config["rope_scaling"] = {**rope_scaling, "truncate": False}
    return config


def _layer_types(reader, arch: str, layers: int, period: int) -> list[str]:
    """Each layer's attention: the file's `sliding_window_pattern` (per layer, true for a
    sliding-window one; or a period), else every `period`-th layer full, the others
    sliding (llama.cpp's default for the architecture)."""
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    period = int(pattern or period)
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(layers)]


_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _gemma_config(reader, arch: str, hidden: int, heads: int, head_dim: int,
                  layers: int) -> dict:
    """Gemma 2's and 3's fields as llama.cpp reads them: soft-caps (Gemma 2), the sliding
    window and its layers (Gemma 2 alternates, sliding first; Gemma 3 has one global layer
    in every 6 unless the file gives a pattern), Gemma 3's local rope (base 10000, no
    scaling) and the query scale: 1/sqrt(hidden / heads) for the 27B models (46 and 62
    layers), 1/sqrt(head_dim) otherwise."""
    config = {"hidden_activation": "gelu_pytorch_tanh",
              "query_pre_attn_scalar": hidden // heads if layers == _LAYERS_27B[arch]
              else head_dim}
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
        config["layer_types"] = _layer_types(reader, arch, layers, 2 if arch == "gemma2" else 6)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _field(reader, f"{arch}.{key}")
        if value:
            config[key] = float(value)
    if arch == "gemma3":
        config["rope_local_base_freq"] = 10000.0
    return config


def _hf_name(name: str, model_type: str) -> str:
    """A GGUF tensor's Hugging Face name (ValueError for one this loader does not know); an
    expert stack's has `{expert}` where each expert's number goes."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        layer, part = f"model.layers.{parts[1]}", parts[2]
        if model_type == "gpt_oss" and (part, suffix) in _GPT_OSS_NAMES:
            return f"{layer}.{_GPT_OSS_NAMES[part, suffix]}"
        moe = "block_sparse_moe" if model_type == "mixtral" else "mlp"
        if model_type.startswith("gemma") and part in _GEMMA_NAMES:
            return f"{layer}.{_GEMMA_NAMES[part]}.{suffix}"
        if part in _EXPERT_STACKS:
            proj = _EXPERT_STACKS[part]
            proj = _MIXTRAL_EXPERTS[proj] if model_type == "mixtral" else proj
            return f"{layer}.{moe}.experts.{{expert}}.{proj}.{suffix}"
        if part in _MOE_NAMES:
            return f"{layer}.{_MOE_NAMES[part].replace('mlp', moe, 1)}.{suffix}"
        if part == "ffn_up" and model_type == "phi3":
            return f"{layer}.mlp.gate_up_proj.{suffix}"
        if part in _LAYER_NAMES:
            return f"{layer}.{_LAYER_NAMES[part]}.{suffix}"
    raise ValueError(f"tensor {name!r} of the GGUF file is not one this loader knows")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two rotary halves of q and k
    (convert_hf_to_gguf.py's `permute`); this puts them back in Hugging Face's order."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# The decoder's linear layers (with the experts' stacks and a shared expert's
# projections): each kept quantized when it is of a type gguf_blocks reads.
_SHARED_EXPERT = {"ffn_gate_shexp": "gate_proj", "ffn_up_shexp": "up_proj",
                  "ffn_down_shexp": "down_proj"}
_LINEAR_STEMS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate",
                 "ffn_up", "ffn_down", *_EXPERT_STACKS, *_SHARED_EXPERT)


def _is_linear(name: str) -> bool:
    """A decoder linear layer's weight (not its bias)."""
    parts = name.split(".")
    return (len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR_STEMS
            and parts[3] == "weight")


def _stored_formats(reader) -> dict[str, gguf_blocks.Format | None] | None:
    """Each decoder linear layer's format that holds it as stored (by tensor name; None: a
    float layer, dequantized), or None when no layer is of a type we hold."""
    formats = {t.name: gguf_blocks.stored_format(int(t.tensor_type))
               for t in reader.tensors if _is_linear(t.name)}
    if not any(formats.values()):
        return None
    return formats


def _layers_format(formats: dict[str, gguf_blocks.Format | None]) -> gguf_blocks.Format:
    """The format most of the quantized layers are in: the model's `quantization`; the
    others (and the dequantized layers) are its `quant_overrides`."""
    return collections.Counter(f for f in formats.values() if f).most_common(1)[0][0]


def _param_paths(name: str, fused: bool) -> list[str]:
    """Our parameter paths of a decoder linear layer's tensor ("blk.3.ffn_down.weight" ->
    ["layers.3.mlp.down_proj"], as loading/safetensors maps its Hugging Face name; an
    expert stack's is the MoE's stacked parameter, "layers.3.mlp.down_proj" too); a fused
    projection's (attn_qkv; ffn_up of a `fused` file, Phi-3's) those it is split into."""
    _, layer, part, _ = name.split(".")
    if part in _EXPERT_STACKS:
        return [f"layers.{layer}.mlp.{_EXPERT_STACKS[part]}"]
    if part in _SHARED_EXPERT:
        return [f"layers.{layer}.mlp.shared_expert.{_SHARED_EXPERT[part]}"]
    block, proj = _LAYER_NAMES[part].replace("self_attn.", "attn.").split(".")
    if fused and part == "ffn_up":  # Phi-3's: the gate's rows, then up's
        proj = "gate_up_proj"
    return [f"layers.{layer}.{block}.{piece}" for piece in FUSED.get(proj, (proj,))]


def _format_of(reader, name: str) -> gguf_blocks.Format | None:
    """Our format that holds tensor `name` as stored, or None: it is of another type."""
    return gguf_blocks.stored_format(next(int(t.tensor_type) for t in reader.tensors
                                          if t.name == name))


def _embed_format(reader) -> gguf_blocks.Format | None:
    """Our format that holds an untied file's embedding (`token_embd`) as stored, or None:
    it is of another type, or the file is tied (its head holds the embedding)."""
    return None if _tied(reader) else _format_of(reader, "token_embd.weight")


def _head_format(reader) -> gguf_blocks.Format | None:
    """Our format that holds the LM head as stored (`output`, or a tied head's
    `token_embd`), or None: it is of another type."""
    return _format_of(reader, "token_embd.weight" if _tied(reader) else "output.weight")


def stored_settings(path: str | os.PathLike, keep_head: bool = True) -> dict | None:
    """The engine settings that keep the file's linear layers as stored, or None when they
    are dequantized (`_stored_formats`): the most common layer format, and the layers of
    others as `quant_overrides` (Q4_K_M's Q6_K layers among its Q4_K ones; a float
    layer's entry, kind None, holds it dequantized in the dtype); with them,
    unless not `keep_head`, the LM head's when it is of a type we hold as stored (a tied
    head: the embedding as stored, which token lookups read too, dequantizing the columns
    they take: `embed_from_lm_head`, no float embedding); an untied file's embedding as
    stored where its type allows (an override for "embed")."""
    reader = _reader(Path(path))
    formats = _stored_formats(reader)
    if formats is None:
        return None
    fmt = _layers_format(formats)
    fused = _required(reader, "general.architecture") == "phi3"
    overrides = [(path, *((f.kind, f.group, f.zero_points) if f else (None, None, False)))
                 for name, f in formats.items() if f != fmt
                 for path in _param_paths(name, fused)]
    embed = _embed_format(reader)
    if embed is not None:  # held as stored, by rows: lookups dequantize the rows they take
        overrides.append(("embed", embed.kind, embed.group, embed.zero_points))
    settings = dict(quantization=fmt.kind, quant_group_size=fmt.group,
                    quant_zero_points=fmt.zero_points, quant_overrides=tuple(sorted(overrides)))
    head = _head_format(reader) if keep_head else None
    if head is not None:
        settings.update(lm_head_quantization=head.kind, lm_head_group_size=head.group,
                        lm_head_zero_points=head.zero_points,
                        embed_from_lm_head=_tied(reader))
    return settings


def _tied(reader) -> bool:
    """Whether the file's LM head is its embedding (no `output` tensor)."""
    return all(t.name != "output.weight" for t in reader.tensors)


def tensors(reader, config: dict, keep: bool = False, keep_head: bool = True
            ) -> Iterator[tuple[str, np.ndarray]]:
    """The weights as (Hugging Face name, float32 array), dequantized one at a time; with
    `keep` (`stored_settings`), the linear layers each in our format that holds it as stored
    (`Prequantized`), and unless not `keep_head` the LM head likewise where its type allows
    ("lm_head.weight"; a tied head's instead of the float embedding, which lookups then
    read from it)."""
    from gguf.quants import dequantize

    kept = _stored_formats(reader) if keep else None
    head = _head_format(reader) if kept is not None and keep_head else None
    embed = _embed_format(reader) if kept is not None else None
    head_name = "output.weight" if not config["tie_word_embeddings"] else "token_embd.weight"
    model_type = config["model_type"]
    for t in reader.tensors:
        if t.name in ("rope_freqs.weight", "rope_factors_long.weight",
                      "rope_factors_short.weight"):  # rope scalings: in the config (hf_config)
            continue
        name = _hf_name(t.name, model_type)
        shape = tuple(int(n) for n in reversed(t.shape))  # [N, K] ([E, N, K] for experts)
        heads = {"q_proj": config["num_attention_heads"],
                 "k_proj": config["num_key_value_heads"]}.get(name.split(".")[-2])
        if model_type not in PERMUTED_QK or not name.endswith(".weight"):
            heads = None
        if head is not None and t.name == head_name:
            w = gguf_blocks.decode(t.data, int(t.tensor_type), *shape)
            yield "lm_head.weight", gguf_blocks.as_ours(w, head)
            continue
        if embed is not None and t.name == "token_embd.weight":
            w = gguf_blocks.decode(t.data, int(t.tensor_type), *shape)
            yield name, gguf_blocks.as_ours(w, embed)
            continue
        if model_type == "gpt_oss" and ".mlp.experts." in name and len(shape) == 3:
            # an expert stack [E, N, K], as [E, K, N]
            if kept and kept.get(t.name) and kept[t.name].kind == "fp4":
                yield name, gguf_blocks.mxfp4_as_ours(t.data, shape)
            else:  # (another type: dequantized, quantized our way where it is held so)
                w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
                yield name, w.transpose(0, 2, 1)
            continue
        if kept and kept.get(t.name) and "{expert}" in name:  # [E, N, K]
            w = gguf_blocks.decode(t.data, int(t.tensor_type), shape[0] * shape[1], shape[2])
            for j, one in enumerate(gguf_blocks.split(w, shape[0])):
                yield name.format(expert=j), gguf_blocks.as_ours(one, kept[t.name])
            continue
        if kept and kept.get(t.name):
            w = gguf_blocks.decode(t.data, int(t.tensor_type), *shape)
            if heads:
                w = dataclasses.replace(w, q=_unpermute(w.q, heads),
                                        scales=_unpermute(w.scales, heads),
                                        zeros=None if w.zeros is None
                                        else _unpermute(w.zeros, heads))
            yield name, gguf_blocks.as_ours(w, kept[t.name])
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        if heads:
            w = _unpermute(w, heads)
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            w = w - 1  # llama.cpp's converter stores Gemma's norms as 1 + weight
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # one output: the file keeps it as a vector
        if "{expert}" in name:
            for j in range(w.shape[0]):
                yield name.format(expert=j), w[j]
            continue
        yield name, w


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (a GGUF file of one stores none):
    every split of a token into two tokens of the vocabulary is a merge, ranked by the
    token's score, best first (ties: the longer left piece first, then the longer right,
    then by the pieces' ids), as SentencePiece-to-BPE conversions rank them."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score in dict(zip(tokens, scores)).items():
        pieces = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ids and token[i:] in ids]
        ranked += [(a, b, score) for a, b in sorted(pieces, key=lambda p: (ids[p[0]], ids[p[1]]))]
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in ranked]


def _byte_level_bpe(reader, tokens: list[str], types: list[int]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    split = _field(reader, "tokenizer.ggml.pre", "default")
    if split not in GPT2_SPLITS and split not in REGEX_SPLITS:
        raise ValueError(f"tokenizer.ggml.pre {split!r}: the text splitting of "
                         f"{sorted(GPT2_SPLITS | set(REGEX_SPLITS))} is supported in GGUF "
                         "files yet")
    spelling = gpt2_byte_table()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
             for i, t in enumerate(tokens)}
    # (none: a vocabulary of single bytes and added tokens, as a BPE without merges)
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split in REGEX_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(REGEX_SPLITS[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel (transformers skips
    # it too: adding it would grow the vocabulary past the model's).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types)
                            if kind == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab])
    return tok


def _sentencepiece_bpe(reader, tokens: list[str], types: list[int]):
    """Llama 2's, Mistral's and TinyLlama's vocabularies: SentencePiece BPE with byte
    fallback (`<0x0A>` tokens), "▁" for a space and one before the text. Gemma's (by
    `general.architecture`): no "▁" before the text, spaces made "▁" by a normalizer and
    the text split after each, tokens of only spaces spelled with "▁" (as Gemma's
    tokenizer looks them up), and merges ranked by the tokens' order in the file (its
    scores do not follow the merge order), as transformers' GGUF loader builds it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    gemma = _field(reader, "general.architecture") in GEMMA
    if gemma:
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    else:
        scores = list(_required(reader, "tokenizer.ggml.scores"))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores),
                               fuse_unk=True, byte_fallback=True,
                               unk_token=None if unk is None else tokens[int(unk)]))
    replace = decoders.Replace("▁", " ")
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse()])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
        tok.decoder = decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return tok


def _add_bos_eos(tok, reader, tokens: list[str], add_bos: bool, add_eos: bool) -> None:
    """The file's `add_bos_token` / `add_eos_token` as tokenizer.json's post-processor
    (what decides what encode adds, as in transformers)."""
    from tokenizers import processors

    marks = []
    for key, wanted in (("bos", add_bos), ("eos", add_eos)):
        index = _field(reader, f"tokenizer.ggml.{key}_token_id")
        marks.append(tokens[int(index)] if wanted and index is not None else None)
    bos, eos = marks
    if bos is None and eos is None:
        return

    def template(piece: str, seq: int) -> str:
        return " ".join(([f"{bos}:{seq}"] if bos else []) + [f"{piece}:{seq}"]
                        + ([f"{eos}:{seq}"] if eos else []))

    tok.post_processor = processors.TemplateProcessing(
        single=template("$A", 0), pair=f"{template('$A', 0)} {template('$B', 1)}",
        special_tokens=[(t, tokens.index(t)) for t in (bos, eos) if t])


def tokenizer_files(reader) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json of the file's vocabulary."""
    kind = _required(reader, "tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ValueError(f"tokenizer.ggml.model {kind!r}: byte-level BPE (\"gpt2\") and "
                         "SentencePiece BPE (\"llama\") vocabularies are supported in GGUF "
                         "files yet")
    tokens = list(_required(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = builders[kind](reader, tokens, types)
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    config = {"add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token",
                                           kind == "llama")),
              "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False))}
    _add_bos_eos(tok, reader, tokens, config["add_bos_token"], config["add_eos_token"])
    for key in ("bos", "eos", "unknown", "padding"):
        index = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            name = {"unknown": "unk", "padding": "pad"}.get(key, key)
            config[f"{name}_token"] = tokens[int(index)]
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {"tokenizer.json": json.loads(tok.to_str()), "tokenizer_config.json": config}


def metadata_dir(path: str | os.PathLike) -> Path:
    """A directory with the file's config.json, tokenizer.json and tokenizer_config.json
    (written once, named for the file's path, size and modification time and for
    METADATA_VERSION)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{METADATA_VERSION}:{path}:{stat.st_size}:{stat.st_mtime_ns}"
                         .encode()).hexdigest()[:16]
    from jaxserve.demo import cache_root

    out = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (out / "tokenizer.json").is_file():
        return out
    reader = _reader(path)
    files = {"config.json": hf_config(reader), **tokenizer_files(reader)}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return out


def open_weights(path: str | os.PathLike, keep: bool = False, keep_head: bool = True
                 ) -> Iterator[tuple[str, np.ndarray]]:
    """The file's weights, as `tensors` yields them."""
    reader = _reader(Path(path))
    return tensors(reader, hf_config(reader), keep, keep_head)
