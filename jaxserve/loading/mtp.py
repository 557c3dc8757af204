"""DeepSeek-V3's multi-token-prediction layer (models/mtp.py) out of the target's own
checkpoint: the layer `model.layers.{num_hidden_layers}.*` (config.json's
`num_nextn_predict_layers`; the first is read), which serving the model alone leaves out
(safetensors.decoder_tensors).

Its tensors: `enorm`, `hnorm`, `eh_proj` (`[hidden, 2 x hidden]`), `shared_head.norm`,
and a decoder block under a decoder layer's own names (`self_attn.*`, `mlp.*`,
`input_layernorm`, `post_attention_layernorm`), read as a decoder's layer 0 is, quantized
as the target's are (`--quantization`, or DeepSeek's FP8 blocks as stored).
`shared_head.head` and `embed_tokens` are copies of the target's and are not read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.loading import prequantized
from jaxserve.loading.safetensors import checkpoint_files, load_checkpoint, read_tensors
from jaxserve.models.mtp import MtpHead
from sharding.rules import ShardingContext

_OWN = {"enorm.weight": ("enorm",), "hnorm.weight": ("hnorm",), "eh_proj.weight": ("eh_proj",),
        "shared_head.norm.weight": ("head_norm",)}
_SKIPPED = ("embed_tokens.", "shared_head.head.")


@dataclasses.dataclass
class MtpCheckpoint:
    """The layer's config (the target's, cut to that layer) and the target layers it reads
    (the final normed hidden state, as an EAGLE-1 head)."""

    cfg: ModelConfig
    features_from: tuple[int, ...]


def read_mtp(model_dir: str | Path, target: ModelConfig) -> MtpCheckpoint:
    """The MTP layer's config (`target`'s, with the block kind of its layer index), or a
    ValueError saying why `model_dir` has none."""
    model_dir = Path(model_dir)
    hf = json.loads((model_dir / "config.json").read_text())
    if not target.kv_lora_rank or not hf.get("num_nextn_predict_layers"):
        raise ValueError("speculative_config: method 'mtp' drafts with a DeepSeek-V3 "
                         "checkpoint's own multi-token-prediction layer; this model has none "
                         "(config.json's num_nextn_predict_layers)")
    n = target.num_layers
    full = ModelConfig.from_file(model_dir, {"num_hidden_layers": n + 1})
    cfg = dataclasses.replace(target, num_layers=1, layer_types=full.layer_types[n:],
                              sparse_layers=full.sparse_layers[n:])
    return MtpCheckpoint(cfg, features_from=(n,))


def _layer_tensors(model_dir: Path, layer: int) -> Iterator[tuple[str, np.ndarray]]:
    """The layer's tensors, its own by their names and its block's as a decoder's layer 0
    (from the files the index puts them in)."""
    prefix = f"model.layers.{layer}."
    index = model_dir / "model.safetensors.index.json"
    files = checkpoint_files(model_dir)
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for name, f in weight_map.items()
                        if name.startswith(prefix)})
    found = False
    for file in files:
        for name, x in read_tensors(file):
            if not name.startswith(prefix):
                continue
            found = True
            rest = name[len(prefix):]
            if not rest.startswith(_SKIPPED):
                yield (rest if rest in _OWN else "model.layers.0." + rest), x
    if not found:
        raise ValueError(f"speculative_config: {model_dir} has no tensors of its "
                         f"multi-token-prediction layer ({prefix}*)")


def _own(name: str, x) -> tuple | None:
    if name not in _OWN:
        return None
    return _OWN[name], (x.T if name == "eh_proj.weight" else x), None


def load_mtp(model_dir: str | Path, ckpt: MtpCheckpoint, dtype, shard: ShardingContext,
             options: ModelOptions) -> tuple[nnx.GraphDef, nnx.State]:
    """The layer's weights placed as `shard` (the target's strategy on the layer's config)
    says, its block quantized as the target's."""
    model_dir = Path(model_dir)
    module = nnx.split(nnx.eval_shape(lambda: MtpHead(ckpt.cfg, dtype, shard, options)))
    tensors = _layer_tensors(model_dir, ckpt.features_from[0])
    stored = prequantized.read(model_dir)
    if stored is not None:
        tensors = prequantized.tensors(tensors, stored)
    return load_checkpoint(model_dir, ckpt.cfg, dtype, shard, options, tensors, module, _own)

