"""The grouped matmul as a Pallas Mosaic (TPU) kernel with group offsets.

Grid (N blocks, visits, K blocks), K innermost. The visit plan (visits.py) is prefetched
into SMEM and drives the index maps: visit v reads x's row tile `tile[v]` and group
`group[v]`'s weight block, accumulates over K in an f32 VMEM scratch, and at the last K
step stores the rows of the tile that are the group's (a select against what earlier
visits of the same tile stored: visits sharing a tile are consecutive, so the output
block stays in VMEM between them). Visits past the active ones do nothing; they repeat
the last active visit's block indices, so no DMA is issued for them either.

Weights are float (x's dtype) or quantized per group (formats.py); a quantized block is
dequantized in VMEM, as in quantized_matmul/tpu.py (whose tile helpers this shares), so
the stack stays quantized in HBM.

A stack whose K or N no block divides (gpt-oss's 2880: 22.5 lane tiles) is read as it is:
the last blocks run past it (Mosaic reads anything there and drops writes there), x is
padded with zeros, and a ragged last K block has its rows past K (and their groups'
scales) zeroed before the dot (`reads_ragged` says where the tiling allows it; elsewhere
the stack is padded, a copy every call: gpt-oss-20b's fp4 experts, ~150 MB a call).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_matmul import formats
from pallas_kernels.grouped_matmul.visits import plan_visits, zero_rows_outside_groups
from pallas_kernels.quantized_matmul.formats import rows_stored
from pallas_kernels.quantized_matmul.tpu import (
    LANES, MAX_BLOCK_K, block_dot, finish, k_unit, mask_rows, mxu_dot)
from pallas_kernels.tiling import round_up, sublane_tile

MAX_BLOCK_M = 128
MAX_BLOCK_N = 512
MAX_BLOCK_K_FLOAT = 512


def dividing_block(size: int, unit: int, most: int) -> int:
    """A block for a dimension of `size`: the whole dimension when it is no larger than
    `most` (Mosaic takes a block equal to the array's dimension whatever its tiling), else
    the largest multiple of `unit` up to `most` dividing `size` rounded up to `unit` (never
    a ragged edge for, say, the 192 rows each of 4 chips holds of a 768-wide expert), or,
    where only blocks under half of `most` divide it (gpt-oss's 2880 = 22.5 x 128), `most`
    itself: the last block ragged (`grouped_matmul` reads such edges in place)."""
    if size <= most:
        return size
    padded = round_up(size, unit)
    top = max(unit, most // unit * unit)
    for block in range(top, unit - 1, -unit):
        if padded % block == 0:
            return block if 2 * block >= top else top
    return top


def block_sizes(m: int, k: int, n: int, kind: str | None, group: int, dtype,
                block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None) -> tuple[int, int, int]:
    """(bm, bn, bk) from the shapes: bm = min(round_up(M, sublane tile), 128); bn and bk
    the whole of N and K up to 512 (int4's and fp4's K: 1024), else `dividing_block`'s
    multiples of 128 (K: of lcm(128, G) for grouped weights). Explicit sizes override,
    checked for the same alignment (a whole dimension is always allowed)."""
    sub = sublane_tile(dtype)
    unit = k_unit(group)
    bm = block_m or min(round_up(m, sub), MAX_BLOCK_M)
    bn = block_n or dividing_block(n, LANES, MAX_BLOCK_N)
    bk = block_k or dividing_block(k, unit, MAX_BLOCK_K[kind] if kind else MAX_BLOCK_K_FLOAT)
    if bm % sub or (bn % LANES and bn != n) or (bk % unit and bk != k):
        raise ValueError(f"TPU block sizes (block_m={bm}, block_n={bn}, block_k={bk}) must be "
                         f"multiples of ({sub}, {LANES}, {unit})")
    return bm, bn, bk


def _kernel(offsets_ref, group_ref, tile_ref, active_ref,  # the visit plan, in SMEM
            x_ref,  # [bm, bk]: the visit's row tile at this K step
            w_ref,  # [bk, bn] (float, int8, fp8) or [bk / 2, bn] (int4, fp4): its group's block
            *refs,  # (s_ref, if quantized: [1, bn] or [bk / G, bn] scales, with zero
                    # points [2, 1, bn] or [2, bk / G, bn]), o_ref, acc_ref
            kind: str | None, group: int, is_grouped: bool, zero_points: bool,
            ragged_k: int | None):
    s_ref, o_ref, acc_ref = refs if kind else (None, *refs)
    v, step = pl.program_id(1), pl.program_id(2)
    live = v < active_ref[0]
    # A last K block running past the stack's K rows (`ragged_k`: K): its rows there zeroed.
    rows_left = None if ragged_k is None else ragged_k - step * x_ref.shape[1]

    @pl.when(step == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live)
    def _accumulate():
        if kind:
            acc_ref[...] += block_dot(x_ref, w_ref, s_ref, kind, group, is_grouped,
                                      zero_points, rows_left)
        else:
            w = mask_rows(w_ref[...], rows_left)
            acc_ref[...] += mxu_dot(x_ref[...], w.astype(x_ref.dtype))

    @pl.when(live & (step == pl.num_programs(2) - 1))
    def _store():
        acc = acc_ref[...]
        if kind:
            acc = finish(acc, s_ref, is_grouped, zero_points)
        g = group_ref[v]
        rows = tile_ref[v] * acc.shape[0] + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
        mine = (rows >= offsets_ref[g]) & (rows < offsets_ref[g + 1])
        o_ref[...] = jnp.where(mine, acc.astype(o_ref.dtype), o_ref[...])


def reads_ragged(values: jax.Array, scales: jax.Array | None, kind: str | None, k: int,
                 bk: int, group: int, is_grouped: bool) -> bool:
    """Whether the kernel reads a stack whose K or N its blocks do not divide as it is
    (Mosaic's edge blocks: what lies past the array reads as anything, and writes there
    are dropped; N blocks are whole lane tiles): where K is ragged, the weight block's rows
    are whole sublane tiles of the values' dtype, and a grouped stack's scale blocks (bk /
    G rows of `[G, (2,) K / G, N]`) of the scales'. Else the stack is padded to whole
    blocks: a copy of it every call."""
    if k % bk == 0:
        return True
    rows = rows_stored(bk, kind)
    return rows % sublane_tile(values.dtype) == 0 and (
        not is_grouped or (bk // group) % sublane_tile(scales.dtype) == 0)


@functools.partial(jax.jit, static_argnames=("kind", "block_m", "block_n", "block_k",
                                             "interpret"))
def grouped_matmul(x: jax.Array, values: jax.Array, group_sizes: jax.Array,
                   scales: jax.Array | None = None, *, kind: str | None = None,
                   block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, interpret: bool = False) -> jax.Array:
    """`y[i] = x[i] @ w[g(i)]` for the rows of each group; rows past the groups: zeros."""
    k = formats.check_operands(x, values, scales, group_sizes, kind)
    m, n = x.shape[0], values.shape[2]
    group, is_grouped, zero_points = formats.layout(kind, k, scales)
    bm, bn, bk = block_sizes(m, k, n, kind, group, x.dtype, block_m, block_n, block_k)
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    ragged = (kp, np_) != (k, n) and reads_ragged(values, scales, kind, k, bk, group,
                                                  is_grouped)
    if ragged:  # x padded (zeros: small); the stack read as it is, edge blocks and all
        x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    else:
        x, values, scales = formats.pad_operands(x, values, scales, kind, mp, kp, np_)
    ragged_k = k if ragged and k % bk else None
    plan = plan_visits(group_sizes, m, bm)

    def w_index(n, v, s, offsets, groups, tiles, active):
        return groups[v], s, n

    in_specs = [pl.BlockSpec((bm, bk), lambda n, v, s, o, g, t, a: (t[v], s)),
                pl.BlockSpec((pl.squeezed, rows_stored(bk, kind), bn), w_index)]
    operands = [x, values]
    zp = (2,) if zero_points else ()  # scales and zero points: both at every index
    if is_grouped and ragged_k:  # bk // G rows of [G, (2,) K / G, N]: whole tiles (reads_ragged)
        in_specs.append(pl.BlockSpec((pl.squeezed, *zp, bk // group, bn),
                                     lambda n, v, s, o, g, t, a: (g[v], *(0,) * len(zp), s,
                                                                  n)))
        operands.append(scales)
    elif is_grouped:
        # One K step's group scales as the whole middle axis of a block (see
        # quantized_matmul/tpu.py: a [bk // G, bn] block of [K // G, N] breaks the 8-row rule).
        scales = scales.reshape(scales.shape[0], *zp, kp // bk, bk // group, scales.shape[-1])
        in_specs.append(pl.BlockSpec((pl.squeezed, *zp, pl.squeezed, bk // group, bn),
                                     lambda n, v, s, o, g, t, a: (g[v], *(0,) * len(zp), s,
                                                                  0, n)))
        operands.append(scales)
    elif kind:
        in_specs.append(pl.BlockSpec((pl.squeezed, *zp, 1, bn),
                                     lambda n, v, s, o, g, t, a: (g[v], *(0,) * len(zp), 0,
                                                                  n)))
        operands.append(scales)

    visits = plan.group.shape[0]
    itemsize = jnp.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * visits * bm * kp * np_, transcendentals=0,
        bytes_accessed=(values.size * values.dtype.itemsize
                        + visits * bm * kp * itemsize * (np_ // bn) + mp * np_ * itemsize))
    out = pl.pallas_call(
        functools.partial(_kernel, kind=kind, group=group, is_grouped=is_grouped,
                          zero_points=zero_points, ragged_k=ragged_k),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(np_ // bn, visits, kp // bk),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((bm, bn), lambda n, v, s, o, g, t, a: (t[v], n)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(
            # Visits that share a row tile accumulate into one output block in turn.
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="grouped_matmul",
    )(*plan, *operands)
    return zero_rows_outside_groups(out[:m, :n], plan.offsets)
