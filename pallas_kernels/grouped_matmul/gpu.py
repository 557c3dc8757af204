"""The grouped matmul as a Pallas GPU kernel (Triton lowering).

One program per (visit, N block) of the visit plan (visits.py): it reads its visit's
group and row tile from the plan, walks K in a `lax.fori_loop` (x tile times the group's
weight tile, dequantized in registers for a quantized stack, float32 accumulation) and
stores the tile's rows that are the group's with a masked store; programs of visits that
share a tile write disjoint rows. Programs past the active visits return at once.

Triton has no scalar prefetch, so every operand is passed whole and the kernel indexes it
with the plan's values; its K step (`k_step`), block rules and group limits are
quantized_matmul/gpu.py's. A stack whose K or N the blocks do not divide (gpt-oss's 2880)
is read as it is, with masked loads (zeros past its rows and columns), and x alone is
padded: no copy of the stack per call.
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
    Loads, block_sizes, finish, k_step, require_support, tile_dot)
from pallas_kernels.tiling import round_up


def _kernel(offsets_ref, group_ref, tile_ref, active_ref,  # the visit plan
            x_ref,  # [Mp, Kp] whole
            w_ref,  # [G, K, N] (float, int8, fp8) or [G, K / 2, N] (int4, fp4) whole
            *refs,  # (s_ref: [G, K / Gs, N] scales, [G, 2, K / Gs, N] with zero points,
                    # if quantized), o_ref
            kind: str | None, group: int, is_grouped: bool, zero_points: bool,
            block_m: int, block_n: int, block_k: int, ragged: bool):
    s_ref, o_ref = refs if kind else (None, *refs)
    v, j = pl.program_id(0), pl.program_id(1)  # (read outside the branch, as interpret needs)

    @pl.when(v < active_ref[0])
    def _visit():
        g, t = group_ref[v], tile_ref[v]
        rows, cols = pl.ds(t * block_m, block_m), pl.ds(j * block_n, block_n)

        def load(ref, lead: tuple, ks: pl.Slice):
            """Rows `ks` of the stack's (or scales') columns `cols`: where the blocks run
            past it (`ragged`), masked to zeros there."""
            if not ragged:
                return ref[(*lead, ks, cols)]
            r = ks.start + jax.lax.broadcasted_iota(jnp.int32, (ks.size, 1), 0)
            c = j * block_n + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
            inside = (r < ref.shape[-2]) & (c < ref.shape[-1])
            return plgpu.load(ref.at[(*lead, ks, cols)], mask=inside, other=0)

        loads = Loads(x=lambda ks: x_ref[rows, ks], w=lambda ks: load(w_ref, (g,), ks),
                      s=lambda part, gs: load(s_ref, (g, jnp.int32(part)) if zero_points
                                              else (g,), gs))
        if kind:
            body = k_step(loads, kind, group, is_grouped, zero_points, block_k)
        else:
            def body(step, acc):
                ks = pl.ds(step * block_k, block_k)
                return acc + tile_dot(loads.x(ks), loads.w(ks))
        acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, body,
                                jnp.zeros((block_m, block_n), jnp.float32))
        if kind:
            acc = finish(acc, loads, is_grouped)
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
    group, is_grouped, zero_points = formats.layout(kind, k, scales)
    require_support(kind, group)
    bm, bn, bk = block_sizes(m, k, n, kind, group, block_m, block_n, block_k)
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    x = jnp.pad(x, ((0, mp - m), (0, kp - k)))  # zeros: small; the stack is read as it is
    plan = plan_visits(group_sizes, m, bm)
    out = pl.pallas_call(
        functools.partial(_kernel, kind=kind, group=group, is_grouped=is_grouped,
                          zero_points=zero_points, block_m=bm, block_n=bn, block_k=bk,
                          ragged=(kp, np_) != (k, n)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        grid=(plan.group.shape[0], np_ // bn),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(*plan, x, values, *([scales] if kind else []))
    return zero_rows_outside_groups(out[:m, :n], plan.offsets)
