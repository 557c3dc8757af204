"""EAGLE heads from their published layouts (SafeAILab/EAGLE and the checkpoints vLLM and
SGLang serve): a directory with config.json (a Llama config of the one draft layer; an
EAGLE-3 head adds `draft_vocab_size`) and its weights in `model.safetensors` or
`pytorch_model.bin` (read only through torch's `weights_only` loader).

EAGLE-1 tensors: `fc.weight` [hidden, 2 x hidden] (and `fc.bias` in the first
checkpoints), `layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj
.weight`, `layers.0.post_attention_layernorm.weight`.
EAGLE-3 tensors: `fc.weight` [hidden, 3 x hidden], `midlayer.*` (the layer: its q/k/v
projections read 2 x hidden, plus `input_layernorm`, `hidden_norm`,
`post_attention_layernorm`), `norm.weight`, `lm_head.weight` [draft vocab, hidden], `d2t`
[draft vocab] (target id = draft id + d2t[draft id]).
Either may carry `embed_tokens.weight` (a copy of the target's, which the head shares) and
EAGLE-3 `t2d`: both are skipped. Names may start with `model.`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.loading.safetensors import (
    fill_state, is_kv_param, place_weight, read_tensors, read_torch_file, repeat_kv_heads)
from jaxserve.models.eagle import EagleHead, feature_layers
from sharding.rules import ShardingContext

_SKIPPED = re.compile(r"(model\.)?(embed_tokens\.weight|t2d)$")


@dataclasses.dataclass
class EagleCheckpoint:
    """A head's config, the target layers it reads, and its tensors (HF names)."""

    cfg: ModelConfig  # the draft layer's (its vocab_size: the logits' width)
    version: int  # 1 or 3
    features_from: tuple[int, ...]  # Transformer.__call__'s
    fc_bias: bool
    tensors: dict[str, np.ndarray]


def read_eagle(path: str | Path, version: int, target: ModelConfig) -> EagleCheckpoint:
    """Read and check a head for `target` (hidden size and vocabulary must match)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"speculative_config: {path} has no config.json (an EAGLE head is a "
                         "directory with config.json and model.safetensors or "
                         "pytorch_model.bin)")
    hf = json.loads((path / "config.json").read_text())
    try:
        cfg = ModelConfig.from_hf({**hf, "model_type": "llama", "num_hidden_layers": 1})
    except (KeyError, ValueError) as e:
        raise ValueError(f"speculative_config: {path}/config.json is not an EAGLE head's "
                         f"config: {e}") from None
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"speculative_config: {path} has {hf['num_hidden_layers']} draft "
                         "layers; EAGLE heads of one layer are supported")
    if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the EAGLE head in {path} is for hidden size "
                         f"{cfg.hidden_size} and vocabulary {cfg.vocab_size}; the target has "
                         f"{target.hidden_size} and {target.vocab_size}")
    tensors = _read(path)
    draft_vocab = hf.get("draft_vocab_size") or cfg.vocab_size
    if version == 3:
        cfg = dataclasses.replace(cfg, vocab_size=draft_vocab)
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or ()
    tensors = {re.sub(r"^model\.", "", name): t for name, t in tensors.items()
               if not _SKIPPED.fullmatch(name)}
    return EagleCheckpoint(cfg, version, feature_layers(version, target.num_layers, tuple(aux)),
                           "fc.bias" in tensors, tensors)


def load_eagle(ckpt: EagleCheckpoint, target: ModelConfig, dtype, shard: ShardingContext,
               options: ModelOptions) -> tuple[nnx.GraphDef, nnx.State]:
    """The head's weights (never quantized; the target's kernels), placed on the devices
    as `shard` (the target's strategy applied to the head's config) says."""
    feature_size = len(ckpt.features_from) * target.hidden_size
    options = dataclasses.replace(options, quantization=None)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: EagleHead(
        ckpt.cfg, ckpt.version, feature_size, ckpt.fc_bias, ckpt.cfg.vocab_size, dtype,
        shard, options)))
    expected = dict(nnx.to_flat_state(abstract))
    loaded = {}
    for name, tensor in ckpt.tensors.items():
        path, array = _to_ours(name, np.asarray(tensor), ckpt, shard.rules.kv_head_replicas)
        if path not in expected:
            raise ValueError(f"speculative_config: unexpected tensor {name!r} in the EAGLE-"
                             f"{ckpt.version} head")
        var = expected[path]
        if tuple(array.shape) != tuple(var.shape):
            raise ValueError(f"speculative_config: EAGLE tensor {name!r} has shape "
                             f"{tuple(tensor.shape)}; this target needs {tuple(var.shape)} "
                             "after conversion")
        loaded.update(place_weight(path, array, expected, shard, options))
    missing = sorted(".".join(map(str, p)) for p in expected if p not in loaded)
    if missing:
        raise ValueError(f"speculative_config: the EAGLE-{ckpt.version} head lacks tensors "
                         f"for {missing}")
    return graphdef, fill_state(abstract, loaded)


def _to_ours(name: str, x: np.ndarray, ckpt: EagleCheckpoint, kv_replicas: int
             ) -> tuple[tuple, np.ndarray]:
    """(our parameter path, array in our layout) of one tensor; an unknown name gets a
    path no head has."""
    cfg = ckpt.cfg
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if name == "fc.weight":
        return ("fc",), x.T
    if name == "fc.bias":
        return ("fc_bias",), x
    if ckpt.version == 3 and name in ("norm.weight", "lm_head.weight", "d2t"):
        return {"norm.weight": (("norm",), x), "lm_head.weight": (("lm_head",), x.T),
                "d2t": (("draft_to_target",), x.astype(np.int32))}[name]
    m = re.fullmatch(r"(?:layers\.0|midlayer)\.(.+)", name)
    rest = m.group(1) if m else ""
    table = {
        "post_attention_layernorm.weight": ("post_attn_norm",),
        "mlp.gate_proj.weight": ("mlp", "gate_proj"),
        "mlp.up_proj.weight": ("mlp", "up_proj"),
        "mlp.down_proj.weight": ("mlp", "down_proj"),
        "self_attn.o_proj.weight": ("attn", "o_proj"),
    }
    if ckpt.version == 3:
        table |= {"input_layernorm.weight": ("input_norm",),
                  "hidden_norm.weight": ("hidden_norm",)}
    heads = {"q": hq, "k": hkv, "v": hkv}
    for p in heads:
        table[f"self_attn.{p}_proj.weight"] = ("attn", f"{p}_proj")
        table[f"self_attn.{p}_proj.bias"] = ("attn", f"{p}_bias")
    if rest not in table:
        return ("unexpected", name), x
    path = table[rest]
    if rest == "self_attn.o_proj.weight":
        x = x.T.reshape(hq, d, -1)
    elif rest.startswith("mlp."):
        x = x.T
    elif rest.startswith("self_attn."):
        h = heads[rest[len("self_attn.")]]
        x = x.reshape(h, d) if rest.endswith("bias") else x.T.reshape(-1, h, d)
    if is_kv_param(path):
        x = repeat_kv_heads(x, path, kv_replicas, d, xp=np)
    return path, x


def _read(path: Path) -> dict[str, np.ndarray]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return {name: t for f in files for name, t in read_tensors(f)}
    for name in ("pytorch_model.bin", "model.pt"):
        if (path / name).exists():
            return read_torch_file(path / name, "speculative_config")
    raise ValueError(f"speculative_config: {path} has no model.safetensors or "
                     "pytorch_model.bin")

