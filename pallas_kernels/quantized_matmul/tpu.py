"""Weight-only quantized matmul as a Pallas Mosaic (TPU) kernel.

Grid (M blocks, N blocks, K blocks), K innermost so an f32 accumulator in VMEM scratch
carries the partial sums across it. Each step loads an x tile `[bm, bk]` and a quantized
weight tile, dequantizes the tile in VMEM to x's dtype and feeds the MXU; the weight stays
quantized in HBM, which is the point: decode is bound by weight bytes read.

Scales: a per-channel scale (int8, fp8) is the same for every K, so it multiplies the
accumulator once, at the last K step. A group scale (int4, fp4; int8 with group scales) changes
every G rows, so each group gets its own dot and its scale multiplies that partial sum
inside the K step. A zero point is subtracted from the integers before the dot (exact:
|q - z| <= 255 is exact in bf16 too).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quantized_matmul.formats import (
    NIBBLE_KINDS, check_operands, grouped, has_zero_points, kernel_group, nibble_values,
    pad_operands, rows_stored)
from pallas_kernels.tiling import round_up, sublane_tile

MAX_BLOCK_M = 256
MAX_BLOCK_N = 512
# K per step: 512 rows of 8-bit weights or 1024 rows of int4 are both 256 KiB of weight
# per 512 columns, large enough to hide the ~0.35 us fixed cost of a grid step behind
# the DMA of the next tile on v5e/v6e HBM.
MAX_BLOCK_K = {"int8": 512, "fp8": 512, "int4": 1024, "fp4": 1024}
LANES = 128


def k_unit(group: int) -> int:
    """bk must hold whole lane tiles of x and whole groups (group 1: per channel)."""
    return math.lcm(LANES, group)


def block_sizes(m: int, k: int, n: int, kind: str, group: int, dtype: jnp.dtype,
                block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None) -> tuple[int, int, int]:
    """(bm, bn, bk) from the shapes alone (never the default device, which is the host CPU
    when compiling ahead of time).

    bm = min(round_up(M, sublane tile), 256): decode batches get one M block padded to a tile.
    bn = min(round_up(N, 128), 512).
    bk = min(round_up(K, unit), the largest multiple of unit <= 512 (8-bit) or 1024 (int4)),
    unit = lcm(128, G) for grouped weights (int4, group-scaled int8), else 128.
    Explicit block_m / block_n / block_k override, checked for the same alignment.
    """
    sub, unit = sublane_tile(dtype), k_unit(group)
    bm = block_m or min(round_up(m, sub), MAX_BLOCK_M)
    bn = block_n or min(round_up(n, LANES), MAX_BLOCK_N)
    bk = block_k or min(round_up(k, unit), max(unit, MAX_BLOCK_K[kind] // unit * unit))
    if bm % sub or bn % LANES or bk % unit:
        raise ValueError(
            f"TPU block sizes (block_m={bm}, block_n={bn}, block_k={bk}) must be multiples "
            f"of ({sub}, {LANES}, {unit}) for {kind} with x {jnp.dtype(dtype).name}"
            + (f" and group {group}" if group > 1 else ""))
    return bm, bn, bk


def mxu_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    # float32 x asks for full f32 passes: Mosaic's default contraction precision is its
    # own choice, and the reference computes float32 at HIGHEST.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)


def dequantize_8bit_tile(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    # Through float32: every int8 and every float8_e4m3fn value is exact there and in
    # bf16, and f32 is the conversion every TPU generation's VPU has.
    return w.astype(jnp.float32).astype(dtype)


def grouped_block_dot(x_ref, w_ref, s_ref, kind: str, group: int, zero_points: bool,
                      rows_left: jax.Array | None = None) -> jax.Array:
    """Sum over the block's groups of (x_group @ (w_group - zero_group)) * scale_group, in
    float32; `s_ref` holds the block's group scales `[bk / G, bn]` (fp4's in bf16), or
    with zero points scales and zero points `[2, bk / G, bn]`. `rows_left`: the weight's
    rows from this block's first on, where the block may run past them (`mask_rows`)."""
    nibbles = kind in NIBBLE_KINDS
    if nibbles:
        half = group // 2
        low, high = nibble_values(w_ref[...].astype(jnp.int32), kind)
    else:
        dense = w_ref[...].astype(jnp.float32)
    total = None
    for g in range(x_ref.shape[1] // group):
        if nibbles:
            # The format puts a group's first half in the low nibbles and its second half
            # in the high ones, so the group is two contiguous pieces: no interleave.
            rows = slice(g * half, (g + 1) * half)
            w = jnp.concatenate([low[rows], high[rows]], axis=0)
        else:
            w = dense[g * group:(g + 1) * group]
        if zero_points:
            w = w - s_ref[1, g:g + 1, :]
        scale = (s_ref[0, g:g + 1, :] if zero_points else s_ref[g:g + 1, :]).astype(jnp.float32)
        if rows_left is not None:  # K is whole groups: a group is all in or all past it
            w = mask_rows(w, rows_left - g * group)
            scale = mask_rows(scale, rows_left - g * group)
        part = mxu_dot(x_ref[:, g * group:(g + 1) * group], w.astype(x_ref.dtype)) * scale
        total = part if total is None else total + part
    return total


def mask_rows(w: jax.Array, rows_left: jax.Array | None) -> jax.Array:
    """A weight block whose rows from `rows_left` on lie past the weight (a ragged last K
    block: whatever memory held there, NaN as like as not) zeroed; x's columns there are
    zero padding, but 0 x NaN is NaN."""
    if rows_left is None:
        return w
    rows = jax.lax.broadcasted_iota(jnp.int32, w.shape, 0)
    return jnp.where(rows < rows_left, w, jnp.zeros((), w.dtype))


def block_dot(x_ref, w_ref, s_ref, kind: str, group: int, is_grouped: bool,
              zero_points: bool, rows_left: jax.Array | None = None) -> jax.Array:
    """One K step's float32 contribution: the groups' scaled dots when grouped, else the
    block's dot (scaled once at the end: `finish`), zero points off the integers first.
    `rows_left`: see `mask_rows` (None: the block is all inside the weight)."""
    if is_grouped:
        return grouped_block_dot(x_ref, w_ref, s_ref, kind, group, zero_points, rows_left)
    if zero_points:  # per channel: the column's zero point off every row
        w = w_ref[...].astype(jnp.float32) - s_ref[1]
        return mxu_dot(x_ref[...], mask_rows(w, rows_left).astype(x_ref.dtype))
    w = dequantize_8bit_tile(w_ref[...], x_ref.dtype)
    return mxu_dot(x_ref[...], mask_rows(w, rows_left))


def finish(acc: jax.Array, s_ref, is_grouped: bool, zero_points: bool) -> jax.Array:
    """The accumulator times the per-channel scales (grouped: already scaled)."""
    if is_grouped:
        return acc
    return acc * (s_ref[0] if zero_points else s_ref[...])


def _kernel(x_ref,  # [bm, bk] VMEM: x's tile at (M block, K step)
            w_ref,  # [bk, bn] (int8, fp8) or [bk / 2, bn] (int4, fp4: packed) VMEM
            s_ref,  # [1, bn] channel scales ([2, 1, bn] with zero points), or grouped:
                    # [bk / G, bn] group scales ([2, bk / G, bn] with zero points), VMEM
            o_ref,  # [bm, bn] VMEM, written at the last K step
            acc_ref,  # [bm, bn] float32 VMEM scratch, carried over the K steps
            *, kind: str, group: int, is_grouped: bool, zero_points: bool):
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += block_dot(x_ref, w_ref, s_ref, kind, group, is_grouped, zero_points)

    @pl.when(step == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = finish(acc_ref[...], s_ref, is_grouped, zero_points).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("kind", "block_m", "block_n", "block_k",
                                             "interpret"))
def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, kind: str,
                     block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, interpret: bool = False) -> jax.Array:
    """`x[M, K] @ dequantize(values, scales)` -> `[M, N]` in x's dtype, on a TPU core.

    Operands are zero-padded to whole blocks here (K by whole groups) and the result
    sliced back, so any M, K, N the format allows works.
    """
    k = check_operands(x, values, scales, kind)
    m, n = x.shape[0], values.shape[1]
    group, is_grouped = kernel_group(kind, k, scales), grouped(kind, scales)
    zero_points = has_zero_points(scales)
    bm, bn, bk = block_sizes(m, k, n, kind, group, x.dtype, block_m, block_n, block_k)
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    x, values, scales = pad_operands(x, values, scales, kind, mp, kp, np_)

    w_spec = pl.BlockSpec((rows_stored(bk, kind), bn), lambda i, j, s: (s, j))
    if is_grouped:
        # One K step's group scales as a block whose rows are the whole (middle) axis:
        # a [bk // G, bn] block of a 2-D array would break the 8-row tiling rule.
        if zero_points:  # scales and zero points: [2, K steps, bk // G, N]
            scales = scales.reshape(2, kp // bk, bk // group, np_)
            s_spec = pl.BlockSpec((2, pl.squeezed, bk // group, bn),
                                  lambda i, j, s: (0, s, 0, j))
        else:
            scales = scales.reshape(kp // bk, bk // group, np_)
            s_spec = pl.BlockSpec((pl.squeezed, bk // group, bn), lambda i, j, s: (s, 0, j))
    elif zero_points:
        s_spec = pl.BlockSpec((2, 1, bn), lambda i, j, s: (0, 0, j))
    else:
        s_spec = pl.BlockSpec((1, bn), lambda i, j, s: (0, j))

    itemsize = jnp.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * mp * kp * np_, transcendentals=0,
        bytes_accessed=(values.size * values.dtype.itemsize * (mp // bm)
                        + x.size * itemsize * (np_ // bn) + mp * np_ * itemsize))
    out = pl.pallas_call(
        functools.partial(_kernel, kind=kind, group=group, is_grouped=is_grouped,
                          zero_points=zero_points),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, s: (i, s)), w_spec, s_spec],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, s: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="quantized_matmul",
    )(x, values, scales)
    return out[:m, :n]
