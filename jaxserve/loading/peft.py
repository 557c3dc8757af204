"""LoRA adapters from PEFT directories (`adapter_config.json` and
`adapter_model.safetensors`, or `adapter_model.bin` through torch's `weights_only`
loader), checked against the base model's shapes and laid out as models/lora.py's stacks
read them: per (layer, module), `A [in, r]` and `B [r, out]` in float32 with the
adapter's scale folded into B.

Supported: LoRA (`peft_type` "LORA") on q/k/v/o and gate/up/down projections, fused
`qkv_proj` / `gate_up_proj` (their B split among the modules, which share A), any rank per
module (`rank_pattern` and `alpha_pattern` as PEFT matches them), rsLoRA
(`use_rslora`: alpha / sqrt(rank)) and `layers_to_transform` (the tensors present).
Refused with a message: DoRA, bias training, `modules_to_save`, embedding or LM-head
targets, and MLP targets in MoE layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loading.safetensors import FUSED, read_tensors
from jaxserve.models.lora import MODULES, dense_layers, module_shapes

CONFIG = "adapter_config.json"
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


@dataclasses.dataclass
class Adapter:
    """One adapter's weights: `weights[(layer, module)] = (A [in, r], B [r, out] x scale)`,
    float32; `rank` the largest r of its modules."""

    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _pattern_value(pattern: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of
    the module's dotted name."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?{key}$", name):
            return value
    return default


def _read(path: Path) -> dict[str, np.ndarray]:
    file = path / "adapter_model.safetensors"
    if file.is_file():
        return {name: np.asarray(t, np.float32) for name, t in read_tensors(file)}
    file = path / "adapter_model.bin"
    if file.is_file():
        try:
            import torch
        except ImportError as e:
            raise ValueError(f"{file}: reading a .bin adapter needs torch installed; or "
                             "save it as adapter_model.safetensors") from e
        state = torch.load(file, map_location="cpu", weights_only=True)
        return {name: t.float().numpy() for name, t in state.items()}
    raise ValueError(f"adapter {path} has no adapter_model.safetensors (or .bin)")


def load_adapter(path: str | Path, cfg: ModelConfig) -> Adapter:
    """Read and check a PEFT LoRA directory for the base model `cfg` (ValueError naming
    what does not fit)."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise ValueError(f"{path} is not a PEFT adapter directory (no {CONFIG})")
    try:
        conf = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / CONFIG} is not valid JSON: {e}") from e
    if conf.get("peft_type", "LORA").upper() != "LORA":
        raise ValueError(f"adapter {path}: peft_type {conf.get('peft_type')!r} is not LoRA")
    if conf.get("use_dora"):
        raise ValueError(f"adapter {path}: DoRA adapters are not supported")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"adapter {path}: trained biases (bias={conf['bias']!r}) are not "
                         "supported")
    if conf.get("modules_to_save"):
        raise ValueError(f"adapter {path}: modules_to_save {conf['modules_to_save']} (whole "
                         "trained copies of base modules) are not supported")
    shapes, dense = module_shapes(cfg), dense_layers(cfg)
    alpha, rslora = conf.get("lora_alpha", 8), bool(conf.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, t in _read(path).items():
        m = _TENSOR.match(name)
        if m is None:
            raise ValueError(f"adapter {path}: tensor {name!r} is not a LoRA weight of a "
                             f"supported module ({', '.join(MODULES)}, qkv_proj, gate_up_proj)")
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in shapes and module not in FUSED:
            raise ValueError(f"adapter {path}: tensor {name!r} targets {module!r}; supported: "
                             f"{', '.join(MODULES)}, qkv_proj, gate_up_proj")
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"adapter {path}: tensor {name!r} is for layer {layer}; the "
                             f"model has {cfg.num_layers}")
        if t.ndim != 2:
            raise ValueError(f"adapter {path}: tensor {name!r} has shape {t.shape}; a LoRA "
                             "weight is 2-D")
        pairs.setdefault((layer, module), {})[which] = (name, t)
    weights, rank = {}, 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            (name, _), = ab.values()
            raise ValueError(f"adapter {path}: tensor {name!r} has no lora_"
                             f"{'B' if 'A' in ab else 'A'} partner")
        (a_name, a), (b_name, b) = ab["A"], ab["B"]
        parts = FUSED.get(module, (module,))
        if not dense[layer] and module in _MLP:
            raise ValueError(f"adapter {path}: tensor {a_name!r} targets the MLP of MoE layer "
                             f"{layer}; adapters on experts are not supported")
        r, d_in = a.shape
        want_in = shapes[parts[0]][0]
        outs = [shapes[p][1] for p in parts]
        if d_in != want_in:
            raise ValueError(f"adapter {path}: tensor {a_name!r} has shape {a.shape}; "
                             f"the model's {module} takes {want_in} inputs (rank x {want_in})")
        if b.shape != (sum(outs), r):
            raise ValueError(f"adapter {path}: tensor {b_name!r} has shape {b.shape}; "
                             f"expected ({sum(outs)}, {r}) for {module} of rank {r}")
        block = "mlp" if module in _MLP else "self_attn"
        dotted = f"model.layers.{layer}.{block}.{module}"
        r_conf = _pattern_value(conf.get("rank_pattern"), dotted, conf.get("r", r))
        if r_conf != r:
            raise ValueError(f"adapter {path}: tensor {a_name!r} has rank {r}; its config "
                             f"says {r_conf}")
        a_mod = _pattern_value(conf.get("alpha_pattern"), dotted, alpha)
        scale = a_mod / (math.sqrt(r) if rslora else r)
        bt = b.T * np.float32(scale)  # [r, out]
        start = 0
        for part, n in zip(parts, outs):
            weights[layer, part] = (np.ascontiguousarray(a.T),
                                    np.ascontiguousarray(bt[:, start:start + n]))
            start += n
        rank = max(rank, r)
    if not weights:
        raise ValueError(f"adapter {path} holds no LoRA weights")
    return Adapter(str(path), rank, weights)
