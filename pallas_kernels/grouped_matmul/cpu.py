"""The grouped matmul for XLA:CPU, in plain JAX: a loop over the visits (visits.py), each
one row tile times one group's weight, so only the groups that have rows are read (and
dequantized, for a quantized stack), once per tile they touch. XLA:CPU's own ragged_dot
multiplies every row by every group's weight instead (reference.py).

An int4 or fp4 stack, or one with zero points, goes through the native quantized kernel
(pallas_kernels/quantized_matmul/cpu.py) on each visit, reading the group's weight as
stored where it lies in the stack (`expert`: a sliced-out group was a copy of its weight
every visit) and the visit's own rows alone: XLA:CPU's dequantization of a dynamically
sliced group, which it fuses, costs 0.6-1 ms for a [1024, 768] weight where the same
dequantization of a whole array takes 0.1. Qwen3-30B-A3B's experts (128 of [2048, 768],
top 8, float32 activations, 2 Zen 4 cores, 2026-12-07), 1 / 16 tokens: fp4 3.3-3.4 /
36.6-37.2 ms with whole tiles and sliced weights, 2.0-2.3 / 26.2-27.2 now; int4 in groups
of 32 with zero points 3.5-3.7 / 38.5-38.8, now 3.1-4.0 / 32.8-36.3. Earlier, on 2 Zen 5
cores, a SwiGLU of 64 experts [1024, 768], top 8 (moe.grouped_glu): 1 / 64 / 512 tokens,
int4 in groups of 32 with zero points 2.0-3.2 / 25-43 / 117-180 ms against 23-29 /
305-311 / 441-460 through XLA; int8 with zero points 2.1 / 29 / 128 against 16 / 220-232
/ 346-388; float32 3-5 / 40-45 / 150.
Symmetric int8 stays with XLA (per channel 2.0 / 25 / 132, the kernel 2.3-3.2 / 26-27 /
119-131)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import formats
from pallas_kernels.grouped_matmul.visits import plan_visits
from pallas_kernels.quantized_matmul import cpu as native_quantized
from pallas_kernels.quantized_matmul import formats as single
from pallas_kernels.tiling import round_up

MAX_BLOCK_M = 128  # measured: 1024 rows x 8 groups of [1024, 2816] in 32 ms at 128, 44 at 256


def block_m_for(m: int, num_groups: int) -> int:
    """Rows per tile: about the mean group's rows (a multiple of 8, from 8 to 128). Every
    visit computes a whole tile, so tiles much larger than the groups waste the work:
    measured with 128 groups of [2048, 768] f32 and 128 rows (16 tokens x top-8), 20 ms a
    projection with 8-row tiles and 102 ms with 128-row ones; the weights read are the same."""
    return min(max(round_up(-(-m // num_groups), 8), 8), MAX_BLOCK_M)


@functools.partial(jax.jit, static_argnames=("kind", "block_m"))
def grouped_matmul(x: jax.Array, values: jax.Array, group_sizes: jax.Array,
                   scales: jax.Array | None = None, *, kind: str | None = None,
                   block_m: int | None = None, **unused_kernel_options) -> jax.Array:
    """`y[i] = x[i] @ w[g(i)]` for the rows of each group; rows past the groups: zeros."""
    formats.check_operands(x, values, scales, group_sizes, kind)
    m = x.shape[0]
    bm = block_m or block_m_for(m, values.shape[0])
    mp = round_up(m, bm)
    tiles = jnp.pad(x, ((0, mp - m), (0, 0))).reshape(mp // bm, bm, x.shape[1])
    plan = plan_visits(group_sizes, m, bm)

    def weight(g):
        if kind is None:
            return values[g].astype(x.dtype)
        return single.dequantize(values[g], scales[g], kind, x.dtype)

    # int4, fp4 and zero points: the native kernel on the group's weight as stored (module
    # doc).
    native = (kind in ("int4", "fp4") or (kind == "int8" and single.has_zero_points(scales[0]))) \
        and native_quantized.supports(x, kind)

    def visit(i, out):
        g, t = plan.group[i], plan.tile[i]
        y = jnp.dot(tiles[t], weight(g), preferred_element_type=jnp.float32)
        rows = t * bm + jnp.arange(bm)[:, None]
        mine = (rows >= plan.offsets[g]) & (rows < plan.offsets[g + 1])
        return out.at[t].set(jnp.where(mine, y.astype(out.dtype), out[t]))

    # The native kernel takes the visit's own rows alone: the group's rows in the tile,
    # from the first (`rows` of them computed, the rest of the block unwritten). Running
    # the whole tile cost a token's top-8 visits 8 rows each: 8x the work at one token.
    xp = jnp.pad(x, ((0, mp - m + bm), (0, 0)))  # bm rows past any visit's first one

    def visit_native(i, out):
        g, t = plan.group[i], plan.tile[i]
        start = jnp.maximum(plan.offsets[g], t * bm)
        count = jnp.minimum(plan.offsets[g + 1], (t + 1) * bm) - start
        y = native_quantized.quantized_matmul(
            jax.lax.dynamic_slice_in_dim(xp, start, bm), values, scales, kind=kind,
            rows=count, expert=g)  # the group's weight read in the stack, not sliced out
        old = jax.lax.dynamic_slice_in_dim(out, start, bm)
        new = jnp.where(jnp.arange(bm)[:, None] < count, y.astype(out.dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, start, axis=0)

    if native:
        out = jnp.zeros((mp + bm, values.shape[2]), x.dtype)
        step = visit_native
    else:
        out = jnp.zeros((mp // bm, bm, values.shape[2]), x.dtype)
        step = visit
    out = jax.lax.fori_loop(
        0, plan.group.shape[0],
        lambda i, out: jax.lax.cond(i < plan.active[0], step, lambda i, o: o, i, out), out)
    return out.reshape(-1, values.shape[2])[:m]
