"""Weight-only quantized matmul as a Pallas GPU kernel (Triton lowering).

One program per (M block, N block[, K split]); a `lax.fori_loop` walks K, loading an x tile
and a quantized weight tile per step, dequantizing the tile in registers to x's dtype and
accumulating `tl.dot` results in float32. Triton has no scratch memory, so the
accumulator is the loop carry, and no tensor slicing, so every piece the kernel needs is
loaded from its ref directly (an int4 or fp4 group as its low-nibble and high-nibble
halves).

Split-K. A decode batch (one M block) over a narrow weight has few programs: Llama-3-8B's
down projection [14336, 4096] is 32 N blocks for an H100's 132 SMs, and there the kernel
ran at 0.46-0.88x the bf16 dot (benchmarks/history/2026-11-21-to-29.md, "GPU bring-up on
an H100"). When the (M, N) blocks are at most half the SMs, K's steps are divided into
`ceil(132 / blocks)` contiguous ranges (never more than the steps), one program each,
writing float32 partials that XLA sums; the sum is one pass over `splits x M x N` floats,
small beside the weight. Not yet timed on a GPU.

Triton shapes are powers of two and `dot` needs every dimension >= 16, which fixes the
block rule and limits groups to powers of two: int4 / fp4 >= 32 (each half a dot operand),
int8 / fp8 >= 16 (see `supports`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quantized_matmul.formats import (
    NIBBLE_KINDS, check_operands, grouped, has_zero_points, kernel_group, nibble_values,
    pad_operands, rows_stored)
from pallas_kernels.tiling import is_power_of_2, next_power_of_2, round_up

MIN_BLOCK = 16  # smallest dimension Triton's dot accepts
MAX_BLOCK_M = 64
MAX_BLOCK_N = 128
MAX_BLOCK_K = 128
NUM_SMS = 132  # H100 / H200 SXM


def default_num_k_splits(num_blocks: int, k_steps: int, num_sms: int = NUM_SMS) -> int:
    """K splits for `num_blocks` (M x N) programs over `k_steps` K steps (module doc)."""
    if num_blocks > num_sms // 2:
        return 1
    return max(1, min(-(-num_sms // num_blocks), k_steps))


def _clamped_power_of_2(n: int, most: int) -> int:
    return min(max(next_power_of_2(n), MIN_BLOCK), most)


def supports(kind: str, group: int) -> bool:
    """Whether this kernel handles the format (`group` 1: per-channel scales): a group is
    a dot operand, an int4 / fp4 group's halves each."""
    if group == 1:
        return True
    return is_power_of_2(group) and rows_stored(group, kind) >= MIN_BLOCK


def require_support(kind: str | None, group: int) -> None:
    if not supports(kind, group):
        least = 2 * MIN_BLOCK if kind in NIBBLE_KINDS else MIN_BLOCK
        raise ValueError(f"the GPU kernel needs a {kind} group size that is a power of two "
                         f">= {least}, got {group}: use impl='reference'")


def block_sizes(m: int, k: int, n: int, kind: str, group: int,
                block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None) -> tuple[int, int, int]:
    """(bm, bn, bk), powers of two, from the shapes.

    bm = clamp(next_pow2(M), 16, 64): decode batches waste little of a 16-row tile.
    bn = clamp(next_pow2(N), 16, 128): N blocks are the parallelism when M is small.
    bk = clamp(next_pow2(K), 16, 128), and at least one group (a multiple of G).
    Explicit block_m / block_n / block_k override, checked for the same rules.
    """
    bm = block_m or _clamped_power_of_2(m, MAX_BLOCK_M)
    bn = block_n or _clamped_power_of_2(n, MAX_BLOCK_N)
    bk = block_k or max(_clamped_power_of_2(k, MAX_BLOCK_K), group)
    if not all(is_power_of_2(b) and b >= MIN_BLOCK for b in (bm, bn, bk)) or bk % group:
        raise ValueError(
            f"GPU block sizes (block_m={bm}, block_n={bn}, block_k={bk}) must be powers of "
            f"two >= {MIN_BLOCK}" + (f", block_k a multiple of the group {group}"
                                     if group > 1 else ""))
    return bm, bn, bk


def tile_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x's tile times a (dequantized) weight tile in x's dtype, accumulated in float32."""
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Loads:
    """How a kernel reads its operands for `k_step` (each a function of pl.ds slices):
    `x(ks)` x's tile over the K slice, `w(rows)` the weight's (packed: int4, fp4) rows,
    `s(part, groups)` the scales' group rows (part 0) or zero points' (part 1)."""

    x: Callable
    w: Callable
    s: Callable


def k_step(loads: Loads, kind: str, group: int, is_grouped: bool, zero_points: bool,
           block_k: int) -> Callable:
    """The fori_loop body adding one K step to the float32 accumulator: one dot per group
    scaled by the group's scale when grouped (int4, fp4; int8 / fp8 with group scales), else one
    dot of the block (scaled once at the end: `finish`). Zero points come off the integers
    before the dot (exact: |q - z| <= 255)."""
    def zero(start):
        return loads.s(1, pl.ds(start // group, 1))

    def scale(start):  # fp4's are bf16
        return loads.s(0, pl.ds(start // group, 1)).astype(jnp.float32)

    def dense_step(step, acc):
        ks = pl.ds(step * block_k, block_k)
        # int8 -> float via the dtype conversion; fp8 -> x's dtype is a native convert
        # on sm89+ (Ada, Hopper), which the dispatcher checks.
        w = loads.w(ks)
        if zero_points:  # per channel: the column's zero point off every row
            w = w.astype(jnp.float32) - loads.s(1, pl.ds(0, 1))
        return acc + tile_dot(loads.x(ks), w)

    def groups_step_8bit(step, acc):
        for g in range(block_k // group):
            start = step * block_k + g * group
            w = loads.w(pl.ds(start, group)).astype(jnp.float32)
            if zero_points:
                w = w - zero(start)
            acc = acc + tile_dot(loads.x(pl.ds(start, group)), w) * scale(start)
        return acc

    def nibbles_step(step, acc):
        half = group // 2
        for g in range(block_k // group):
            start = step * block_k + g * group
            # uint8 -> int32 zero-extends; nibble_values sign-extends int4's nibbles or
            # reads fp4's e2m1 codes.
            low, high = nibble_values(loads.w(pl.ds(start // 2, half)).astype(jnp.int32), kind)
            if zero_points:
                low, high = low - zero(start), high - zero(start)
            part = (tile_dot(loads.x(pl.ds(start, half)), low)
                    + tile_dot(loads.x(pl.ds(start + half, half)), high))
            acc = acc + part * scale(start)
        return acc

    if not is_grouped:
        return dense_step
    return nibbles_step if kind in NIBBLE_KINDS else groups_step_8bit


def finish(acc: jax.Array, loads: Loads, is_grouped: bool) -> jax.Array:
    """The accumulator times the per-channel scales (grouped: already scaled)."""
    return acc if is_grouped else acc * loads.s(0, pl.ds(0, 1))


def _kernel(x_ref,  # [bm, K]: this program's rows of x, all of K (the loop slices it)
            w_ref,  # [K, bn] (int8, fp8) or [K / 2, bn] (int4, fp4: packed): its columns
            s_ref,  # [K / G, bn] scales (per channel: [1, bn]), with zero points
                    # [2, K / G, bn]
            o_ref,  # [bm, bn], or with K splits this split's float32 partial
            *, kind: str, group: int, is_grouped: bool, zero_points: bool, block_k: int,
            num_splits: int):
    bm, bn = o_ref.shape
    steps = x_ref.shape[1] // block_k
    first, last = 0, steps
    if num_splits > 1:  # this program's contiguous share of the K steps
        per_split = (steps + num_splits - 1) // num_splits
        first = jnp.minimum(pl.program_id(2) * per_split, steps)
        last = jnp.minimum(first + per_split, steps)
    loads = Loads(x=lambda ks: x_ref[:, ks], w=lambda rows: w_ref[rows, :],
                  s=lambda part, g: s_ref[part, g, :] if zero_points else s_ref[g, :])
    body = k_step(loads, kind, group, is_grouped, zero_points, block_k)
    acc = jax.lax.fori_loop(first, last, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = finish(acc, loads, is_grouped).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("kind", "block_m", "block_n", "block_k",
                                             "num_k_splits", "num_warps", "num_stages",
                                             "interpret"))
def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, kind: str,
                     block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, num_k_splits: int | None = None,
                     num_warps: int = 4, num_stages: int = 3,
                     interpret: bool = False) -> jax.Array:
    """`x[M, K] @ dequantize(values, scales)` -> `[M, N]` in x's dtype, on a GPU.

    Operands are zero-padded to whole blocks (K by whole groups) and the result
    sliced back. `num_k_splits` overrides default_num_k_splits.
    """
    k = check_operands(x, values, scales, kind)
    m, n = x.shape[0], values.shape[1]
    group, is_grouped = kernel_group(kind, k, scales), grouped(kind, scales)
    zero_points = has_zero_points(scales)
    require_support(kind, group)
    bm, bn, bk = block_sizes(m, k, n, kind, group, block_m, block_n, block_k)
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    x, values, scales = pad_operands(x, values, scales, kind, mp, kp, np_)

    # Each program sees its rows of x and its columns of the weight over all of K; the
    # K loop slices them. Block shapes need not be powers of two, only what is loaded.
    splits = num_k_splits or default_num_k_splits((mp // bm) * (np_ // bn), kp // bk)
    if splits > 1:
        out_shape = jax.ShapeDtypeStruct((splits, mp, np_), jnp.float32)
        out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((mp, np_), x.dtype)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, *_: (i, j))
    out = pl.pallas_call(
        functools.partial(_kernel, kind=kind, group=group, is_grouped=is_grouped,
                          zero_points=zero_points, block_k=bk, num_splits=splits),
        out_shape=out_shape,
        grid=(mp // bm, np_ // bn) + ((splits,) if splits > 1 else ()),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j, *_: (i, 0)),
                  pl.BlockSpec((values.shape[0], bn), lambda i, j, *_: (0, j)),
                  pl.BlockSpec(scales.shape[:-1] + (bn,),
                               lambda i, j, *_: (0,) * (scales.ndim - 1) + (j,))],
        out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(x, values, scales)
    if splits > 1:
        out = out.sum(axis=0).astype(x.dtype)
    return out[:m, :n]
