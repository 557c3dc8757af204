"""Medusa heads from their published layout (FasterDecoding/Medusa): a directory with
config.json (`medusa_num_heads`, `medusa_num_layers`) and `medusa_lm_head.safetensors`
(or `medusa_lm_head.pt`, read only through torch's `weights_only` loader, never plain
pickle). Head h is `medusa_num_layers` residual blocks, `x + silu(x @ W.T + b)` (tensors
`{h}.{l}.linear.weight` [D, D] and `.bias`), then a linear map to the vocabulary
(`{h}.{medusa_num_layers}.weight` [V, D]), applied to the base model's final hidden
state after its last norm."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxserve.loading.safetensors import read_tensors, read_torch_file


@dataclasses.dataclass
class MedusaCheckpoint:
    """The heads' weights, stacked over heads and blocks, laid out for `x @ w`."""

    block_weights: np.ndarray  # [heads, layers, D in, D out]
    block_biases: np.ndarray  # [heads, layers, D]
    lm_heads: np.ndarray  # [heads, D, V]


def load_medusa(path: str | Path, hidden_size: int, vocab_size: int) -> MedusaCheckpoint:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"speculative_config: {path} has no config.json (Medusa heads need "
                         "medusa_num_heads and medusa_num_layers)")
    config = json.loads(config_file.read_text())
    try:
        heads, layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"speculative_config: {config_file} lacks medusa_num_heads / "
                         "medusa_num_layers") from None
    tensors = _read(path)
    d, v = hidden_size, vocab_size

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"speculative_config: Medusa heads in {path} lack tensor {name!r}")
        array = np.asarray(tensors[name], dtype=np.float32)
        if array.shape != shape:
            raise ValueError(f"speculative_config: Medusa tensor {name!r} has shape "
                             f"{array.shape}; this target needs {shape} (hidden {d}, "
                             f"vocabulary {v})")
        return array

    return MedusaCheckpoint(
        block_weights=np.stack([np.stack([get(f"{h}.{j}.linear.weight", (d, d)).T
                                          for j in range(layers)]) for h in range(heads)])
        if layers else np.zeros((heads, 0, d, d), np.float32),
        block_biases=np.stack([np.stack([get(f"{h}.{j}.linear.bias", (d,))
                                         for j in range(layers)]) for h in range(heads)])
        if layers else np.zeros((heads, 0, d), np.float32),
        lm_heads=np.stack([get(f"{h}.{layers}.weight", (v, d)).T for h in range(heads)]))


def _read(path: Path) -> dict[str, np.ndarray]:
    file = path / "medusa_lm_head.safetensors"
    if file.exists():
        return dict(read_tensors(file))
    file = path / "medusa_lm_head.pt"
    if not file.exists():
        raise ValueError(f"speculative_config: {path} has neither medusa_lm_head.safetensors "
                         "nor medusa_lm_head.pt")
    return read_torch_file(file, "speculative_config")
