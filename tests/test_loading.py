"""Checkpoint loading: sharded safetensors with an index, bf16 files, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_checkpoint
from test_parity import ragged_prompt_logits


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The tiny Llama saved in shards of at most 100 kB, with model.safetensors.index.json."""
    path = tmp_path_factory.mktemp("sharded")
    model = make_checkpoint("llama", path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(path, max_shard_size="100KB")
    return path, model


def test_sharded_checkpoint_loads_every_shard(sharded, prompts):
    path, model = sharded
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    got = ragged_prompt_logits(path, prompts[:2])
    for prompt, logits in zip(prompts[:2], got):
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)


def test_bf16_checkpoint(tmp_path, prompts):
    """BF16 tensors are read without torch; compared with HF on the same rounded weights."""
    model = make_checkpoint("qwen2", tmp_path)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    header_len = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((tmp_path / "model.safetensors").read_bytes()[8:8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    # The oracle: a fresh float32 model holding the bf16-rounded weights. (Converting the
    # model back with .to(float32) would keep its rotary inv_freq buffer rounded to bf16.)
    rounded = type(model)(model.config).eval()
    rounded.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    got = ragged_prompt_logits(tmp_path, prompts[:2])
    for prompt, logits in zip(prompts[:2], got):
        with torch.no_grad():
            want = rounded(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)


def test_missing_and_mismatched_tensors_are_clear_errors(tmp_path):
    from jaxserve.config import ModelConfig
    from jaxserve.loading.safetensors import load_checkpoint
    from sharding.mesh import make_mesh
    from sharding.rules import ShardingContext

    make_checkpoint("llama", tmp_path)
    cfg = ModelConfig.from_file(tmp_path)
    shard = ShardingContext(make_mesh())
    wrong = ModelConfig.from_hf({**json.loads((tmp_path / "config.json").read_text()),
                                 "intermediate_size": 96})
    with pytest.raises(ValueError, match="shape"):
        load_checkpoint(tmp_path, wrong, np.float32, shard)
    deeper = ModelConfig.from_hf({**json.loads((tmp_path / "config.json").read_text()),
                                  "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="lacks tensors"):
        load_checkpoint(tmp_path, deeper, np.float32, shard)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path, cfg, np.float32, shard)
