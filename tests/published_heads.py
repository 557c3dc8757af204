"""Speculative-decoding heads as torch modules, written as published heads ship them
(Medusa, EAGLE); no side effects on import (benchmarks/speculative.py uses it, also
through eagle_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_module(module, path: Path, name: str, torch_name: str, torch_file: bool) -> None:
    """A torch module's state in safetensors `name`, or in torch's own file `torch_name`
    when `torch_file`."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in module.state_dict().items()}
    if torch_file:
        torch.save(state, path / torch_name)
    else:
        save_file(state, str(path / name))


class ResBlock(torch.nn.Module):
    """Medusa's residual block as published (FasterDecoding/Medusa): x + silu(linear(x))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.linear(x))


def medusa_heads(hf_model, heads: int, layers: int, seed: int, copy_lm_head: bool = False):
    """Medusa heads in the published module layout: random blocks, and LM heads random or
    the target's own (as Medusa initialises them)."""
    torch.manual_seed(seed)
    d, v = hf_model.config.hidden_size, hf_model.config.vocab_size
    module = torch.nn.ModuleList([
        torch.nn.Sequential(*[ResBlock(d) for _ in range(layers)],
                            torch.nn.Linear(d, v, bias=False)) for _ in range(heads)])
    with torch.no_grad():
        for head in module:
            if copy_lm_head:
                head[-1].weight.copy_(hf_model.lm_head.weight)
                for block in head[:-1]:
                    torch.nn.init.zeros_(block.linear.weight)  # identity blocks
    return module


def write_medusa(path, module, layers: int, torch_file: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "medusa_num_heads": len(module), "medusa_num_layers": layers,
        "base_model_name_or_path": "tiny-llama"}))
    save_module(module, path, "medusa_lm_head.safetensors", "medusa_lm_head.pt", torch_file)
    return path
