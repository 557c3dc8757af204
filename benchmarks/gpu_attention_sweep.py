"""The GPU attention kernel's launch choices, swept at benchmarks/kernel_speed.py's shapes.

For each case (decode 64 x 2048 and 4 x 8192, bf16 and int8 KV; prefill 512 at 512) every
combination of num_warps, num_stages, pages_per_block (key tile 64 or 128 tokens with
16-token pages) and, for the small batch, num_kv_splits is compiled, checked against the
reference (max abs diff) and timed as kernel_speed.py times (median of 20 samples of 10 calls).
Prints one table per case, fastest first, beside the bandwidth floor; the chosen rows go
to the table in pallas_kernels/ragged_paged_attention/gpu.py.

    JAX_PLATFORMS=cuda python benchmarks/gpu_attention_sweep.py
"""

from __future__ import annotations

import datetime
import itertools

import jax
import jax.numpy as jnp

from kernel_speed import (AttentionCase, attention_args, attention_fn, build_attention_batch,
                          machine, median_ms, page_size_for)
from offline_throughput import measure_bandwidth
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

CASES = [
    (AttentionCase("decode 64 x 2048", (1,) * 64, (2048,) * 64),
     dict(num_warps=(4, 8), num_stages=(2, 3, 4), pages_per_block=(4, 8))),
    (AttentionCase("decode 4 x 8192", (1,) * 4, (8192,) * 4),
     dict(num_warps=(4, 8), num_stages=(2, 3), pages_per_block=(8,),
          num_kv_splits=(None, 8, 16, 32))),
    (AttentionCase("decode 64 x 2048 int8", (1,) * 64, (2048,) * 64, kv_dtype="int8"),
     dict(num_warps=(4, 8), num_stages=(2, 3, 4), pages_per_block=(8,))),
    (AttentionCase("prefill 1 x 512 at ctx 512", (512,), (512,)),
     dict(num_warps=(4, 8), num_stages=(2, 3), pages_per_block=(4, 8))),
]


def main() -> None:
    bandwidth = measure_bandwidth()
    print(f"\n## GPU attention sweep, {datetime.date.today().isoformat()}\n")
    print(f"- {machine()}; jax {jax.__version__}; bandwidth {bandwidth / 1e9:.0f} GB/s\n")
    for i, (case, grid) in enumerate(CASES):
        batch = build_attention_batch(case, page_size_for(case.kv_dtype, "gpu"), i)
        args, scales = attention_args(batch)
        want = attention_fn("reference")(*args, **scales).astype(jnp.float32)
        floor_ms = 1e3 * case.kv_bytes_read() / bandwidth
        rows = []
        for values in itertools.product(*grid.values()):
            options = {k: v for k, v in zip(grid, values) if v is not None}
            fn = jax.jit(lambda *a, o=options: ragged_paged_attention(
                *a, sm_scale=128 ** -0.5, impl="gpu", **scales, **o))
            try:
                diff = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want)))
                ms = median_ms(lambda: fn(*args), 20)
            except Exception as e:  # a choice Triton rejects is a row, not the end
                rows.append((float("inf"), options, f"failed: {type(e).__name__}"))
                continue
            rows.append((ms, options, f"{diff:.2g}"))
        print(f"### {case.name} (floor {floor_ms:.3f} ms)\n")
        print("| options | ms | % floor | max abs diff |\n|---|---|---|---|")
        for ms, options, diff in sorted(rows, key=lambda r: r[0]):
            print(f"| {options} | {ms:.3f} | {100 * floor_ms / ms:.0f}% | {diff} |")
        print()


if __name__ == "__main__":
    main()
