"""Tensor (and sequence) parallelism over 8 CPU devices gives the single-device tokens.

The runs happen in a subprocess (tests/multidevice_check.py) started with 8 CPU devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    path, _ = checkpoints("llama8")
    out = tmp_path_factory.mktemp("tp") / "runs.json"
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    script = Path(__file__).parent / "multidevice_check.py"
    proc = subprocess.run([sys.executable, str(script), str(path), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mesh", ['{"model": 2}', '{"model": 4}', '{"model": 8}',
                                  '{"model": 4} tp+sp', '{"model": 2} tpu-kernels',
                                  '{"model": 8} tpu-kernels'])
def test_tensor_parallel_matches_one_device(runs, mesh):
    one, tp = runs["null"], runs[mesh]
    assert tp["tokens"] == one["tokens"]
    # float32 logprobs: sharded matmuls sum in a different order; 1e-4 as in test_parity.
    for seq_one, seq_tp in zip(one["logprobs"], tp["logprobs"]):
        for step_one, step_tp in zip(seq_one, seq_tp):
            assert step_one.keys() == step_tp.keys()
            for t in step_one:
                assert abs(step_one[t] - step_tp[t]) < 1e-4
    assert tp["leaked_pages"] == 0 and tp["compiles_after_warmup"] == 0


@pytest.mark.parametrize("mesh,kv_spec", [('{"model": 2}', "P('model', None, None, None)"),
                                          ('{"model": 4}', "P(None, None, None, None)"),
                                          ('{"model": 8}', "P(None, None, None, None)")])
def test_weights_split_not_gathered(runs, mesh, kv_spec):
    """q_proj is split by heads; KV heads (2) are split at TP=2 and replicated beyond; the
    compiled step all-reduces and never all-gathers a weight back to its full shape."""
    tp = runs[mesh]
    assert tp["q_proj_sharding"] == "P(None, 'model', None)"
    assert tp["kv_cache_sharding"] == kv_spec
    assert tp["all_reduces"] >= 2 * 2  # attention out and MLP down, per layer
    full = {tuple(s) for s in tp["param_shapes"]}
    assert not [s for s in tp["all_gather_shapes"] if tuple(s) in full]



def test_sequence_parallel_reduce_scatters_instead_of_all_reducing(runs):
    """The compiled 64-token step (hidden 64, 2 layers, TP=4): under TP every layer
    all-reduces its attention and MLP outputs [64, 64]; under TP+SP those become
    reduce-scatters to token shards [16, 64]. Left in both: the vocabulary-parallel
    embedding lookup's all-reduce."""
    tp, sp = runs['{"model": 4}'], runs['{"model": 4} tp+sp']
    layers = 2
    assert tp["all_reduce_shapes"].count([64, 64]) == 2 * layers + 1
    assert tp["reduce_scatter_shapes"] == []
    assert sp["all_reduce_shapes"].count([64, 64]) == 1
    assert sp["reduce_scatter_shapes"] == [[16, 64]] * (2 * layers)
