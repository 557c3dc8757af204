"""What a `--model` names, opened: its config, where its tokenizer lies, the weights to read
and the engine settings its own quantization fixes. Serving, `jaxserve convert` and
`jaxserve plan` all start here (our converted checkpoints aside: loading/converted.py).

- a GGUF file: its metadata written out as files (gguf.metadata_dir), its tensors as the
  `gguf` package reads them; linear layers of the legacy and K-quant types kept quantized
  as stored unless a `quantization` is asked for (gguf.stored_settings, gguf_blocks.py);
- a Hugging Face directory with an AWQ, GPTQ or compressed-tensors `quantization_config`:
  its tensors repacked as stored (prequantized.py), with the settings that serve them;
- anything else (a float checkpoint, a model preset): its config, nothing fixed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loading import gguf, prequantized
from jaxserve.loading.safetensors import decoder_tensors


@dataclasses.dataclass
class Checkpoint:
    model_dir: Path  # config.json and the tokenizer's files
    config: ModelConfig
    settings: dict  # EngineConfig fields its quantization fixes ({}: none)
    tensors: Iterable[tuple[str, np.ndarray]] | None  # None: the directory's own files
    method: str | None  # "gguf", "awq", "gptq", "compressed-tensors" or None


def open_checkpoint(model: str | Path, quantization: str | None,
                    lm_head_quantization: str | None = None,
                    hf_overrides: dict | None = None) -> Checkpoint:
    """`model` opened (module doc); `quantization` and `lm_head_quantization`: what the
    caller asked for (a checkpoint quantized by its makers refuses another; a GGUF file's
    layers or head are then dequantized and quantized so); `hf_overrides`: keys set over
    its config.json."""
    if gguf.is_gguf(model):
        keep_head = lm_head_quantization is None
        settings = (None if quantization else gguf.stored_settings(model, keep_head)) or {}
        model_dir = gguf.metadata_dir(model)
        return Checkpoint(model_dir, ModelConfig.from_file(model_dir, hf_overrides), settings,
                          gguf.open_weights(model, bool(settings), keep_head), "gguf")
    model_dir = Path(model)
    config = ModelConfig.from_file(model_dir, hf_overrides)
    stored = prequantized.read(model_dir) if model_dir.is_dir() else None
    if stored is None:
        return Checkpoint(model_dir, config, {}, None, None)
    return Checkpoint(model_dir, config, stored.settings(quantization, config),
                      prequantized.tensors(decoder_tensors(model_dir, config), stored),
                      stored.method)
