"""Writing torch modules as published speculative-decoding heads ship them (Medusa,
EAGLE); no side effects on import (benchmarks/speculative.py uses it through
eagle_reference.py)."""

from __future__ import annotations

from pathlib import Path


def save_module(module, path: Path, name: str, torch_name: str, torch_file: bool) -> None:
    """A torch module's state in safetensors `name`, or in torch's own file `torch_name`
    when `torch_file`."""
    import torch
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in module.state_dict().items()}
    if torch_file:
        torch.save(state, path / torch_name)
    else:
        save_file(state, str(path / name))
