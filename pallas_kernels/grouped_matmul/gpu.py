"""The grouped matmul as a Pallas GPU kernel (Triton lowering).

One program per (visit, N block) of the visit plan (visits.py): it reads its visit's
group and row tile from the plan, walks K in a `lax.fori_loop` (x tile times the group's
weight tile, dequantized in registers for a quantized stack, float32 accumulation) and
stores the tile's rows that are the group's with a masked store; programs of visits that
share a tile write disjoint rows. Programs past the active visits return at once.

Triton has no scalar prefetch, so every operand is passed whole and the kernel indexes it
with the plan's values; its block rules and int4 limits are quantized_matmul/gpu.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_matmul import formats
from pallas_kernels.grouped_matmul.visits import plan_visits, zero_rows_outside_groups
from pallas_kernels.quantized_matmul.gpu import (
    block_sizes, int4_halves, require_support, tile_dot)
from pallas_kernels.tiling import round_up


def _kernel(offsets_ref, group_ref, tile_ref, active_ref,  # the visit plan
            x_ref,  # [Mp, Kp] whole
            w_ref,  # [G, Kp, Np] (float, int8, fp8) or [G, Kp / 2, Np] (int4) whole
            *refs,  # (s_ref: [G, 1, Np] or [G, Kp / Gs, Np] scales, if quantized), o_ref
            kind: str | None, group: int, block_m: int, block_n: int, block_k: int):
    s_ref, o_ref = refs if kind else (None, *refs)
    v, j = pl.program_id(0), pl.program_id(1)  # (read outside the branch, as interpret needs)

    @pl.when(v < active_ref[0])
    def _visit():
        g, t = group_ref[v], tile_ref[v]
        rows, cols = pl.ds(t * block_m, block_m), pl.ds(j * block_n, block_n)

        def dense_step(step, acc):
            ks = pl.ds(step * block_k, block_k)
            return acc + tile_dot(x_ref[rows, ks], w_ref[g, ks, cols])

        def int4_step(step, acc):
            half = group // 2
            for q in range(block_k // group):
                start = step * block_k + q * group
                low, high = int4_halves(w_ref[g, pl.ds(start // 2, half), cols])
                part = (tile_dot(x_ref[rows, pl.ds(start, half)], low.astype(jnp.float32))
                        + tile_dot(x_ref[rows, pl.ds(start + half, half)],
                               high.astype(jnp.float32)))
                acc = acc + part * s_ref[g, pl.ds(start // group, 1), cols]
            return acc

        acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k,
                                int4_step if kind == "int4" else dense_step,
                                jnp.zeros((block_m, block_n), jnp.float32))
        if kind in ("int8", "fp8"):
            acc = acc * s_ref[g, pl.ds(0, 1), cols]
        ids = t * block_m + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
        mine = (ids >= offsets_ref[g]) & (ids < offsets_ref[g + 1])
        plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=mine)


@functools.partial(jax.jit, static_argnames=("kind", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def grouped_matmul(x: jax.Array, values: jax.Array, group_sizes: jax.Array,
                   scales: jax.Array | None = None, *, kind: str | None = None,
                   block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
                   interpret: bool = False) -> jax.Array:
    """`y[i] = x[i] @ w[g(i)]` for the rows of each group; rows past the groups: zeros."""
    k = formats.check_operands(x, values, scales, group_sizes, kind)
    m, n = x.shape[0], values.shape[2]
    group = k // scales.shape[1] if kind == "int4" else 1
    require_support(kind, group)
    bm, bn, bk = block_sizes(m, k, n, kind, group, block_m, block_n, block_k)
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    x, values, scales = formats.pad_operands(x, values, scales, kind, mp, kp, np_)
    plan = plan_visits(group_sizes, m, bm)
    out = pl.pallas_call(
        functools.partial(_kernel, kind=kind, group=group, block_m=bm, block_n=bn,
                          block_k=bk),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        grid=(plan.group.shape[0], np_ // bn),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(*plan, x, values, *([scales] if kind else []))
    return zero_rows_outside_groups(out[:m, :n], plan.offsets)
