"""The model's forward pass alone (no engine, no sampler), jitted, on a preset's random
checkpoint: what one decode step costs on the device before the engine's host work.

For a decode batch of 1 sequence at context 33 and of 64 at context 200 (workloads (a)
and (b) of offline_throughput.py), times the forward pass plus the LM head over every
row, each call waited for (synced) and 20 calls dispatched back to back (divided), beside
the bandwidth floor of reading the weights once. The gap between this and
offline_throughput.py's ms per output token is the engine's own per-step cost.

    JAX_PLATFORMS=cuda python benchmarks/forward_step.py [--preset configs/models/llama3-8b.yaml]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import peers
from offline_throughput import measure_bandwidth
from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.loading.safetensors import load_checkpoint
from jaxserve.models.transformer import AttentionMetadata, kv_cache_layout
from sharding.mesh import make_mesh
from sharding.rules import ShardingContext

PAGE_SIZE, NUM_PAGES, CALLS = 16, 1024, 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="configs/models/llama3-8b.yaml")
    args = ap.parse_args()
    model_dir = peers.checkpoint(args.preset)
    cfg = ModelConfig.from_file(model_dir)
    graphdef, params = load_checkpoint(model_dir, cfg, jnp.bfloat16,
                                       ShardingContext(make_mesh()), ModelOptions())
    layout = kv_cache_layout(cfg, NUM_PAGES, PAGE_SIZE, jnp.bfloat16)
    caches = [tuple(jnp.zeros(shape, dtype) for shape, dtype, _ in layout)
              for _ in range(cfg.num_layers)]

    @jax.jit
    def forward(params, ids, pos, caches, meta):
        model = nnx.merge(graphdef, params)
        return model.logits(model(ids, pos, caches, meta)[0])

    bandwidth = measure_bandwidth()
    weight_bytes = 2 * (cfg.num_params() - (0 if cfg.tie_word_embeddings
                                            else cfg.vocab_size * cfg.hidden_size))
    print(f"\n## forward step, {datetime.date.today().isoformat()}\n")
    print(f"- {jax.devices()[0].device_kind}; jax {jax.__version__}; {args.preset}, bf16; "
          f"bandwidth {bandwidth / 1e9:.0f} GB/s; weights read per step "
          f"{weight_bytes / 1e9:.2f} GB = {1e3 * weight_bytes / bandwidth:.2f} ms\n")
    print("| decode batch | context | ms synced | ms back to back |\n|---|---|---|---|")
    for num_seqs, context in ((1, 33), (64, 200)):
        per_seq = -(-context // PAGE_SIZE)
        table = np.arange(num_seqs * per_seq).reshape(num_seqs, per_seq) % NUM_PAGES
        last = context - 1
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(table[:, last // PAGE_SIZE] * PAGE_SIZE + last % PAGE_SIZE,
                                     jnp.int32),
            cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32),
            kv_lens=jnp.full((num_seqs,), context, jnp.int32),
            page_indices=jnp.asarray(table, jnp.int32),
            num_seqs=jnp.array([num_seqs], jnp.int32))
        call_args = (params, jnp.ones((num_seqs,), jnp.int32),
                     jnp.full((num_seqs,), last, jnp.int32), caches, meta)
        jax.block_until_ready(forward(*call_args))
        synced = []
        for _ in range(CALLS):
            start = time.perf_counter()
            jax.block_until_ready(forward(*call_args))
            synced.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(CALLS):
            out = forward(*call_args)
        jax.block_until_ready(out)
        back_to_back = (time.perf_counter() - start) / CALLS
        print(f"| {num_seqs} | {context} | {1e3 * statistics.median(synced):.2f} | "
              f"{1e3 * back_to_back:.2f} |")


if __name__ == "__main__":
    main()
