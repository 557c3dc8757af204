"""Expert weights `[G, K, N]` (one `[K, N]` weight per group), float or quantized.

A quantized stack is each group's weight in a format of pallas_kernels/quantized_matmul
(int8, int4, fp8, fp4), stacked: values `[G, K, N]` (int4, fp4: `[G, K // 2, N]`) and scales
`[G, K // group_size, N]` (`[G, 1, N]` per channel), with zero points `[G, 2, K //
group_size, N]`. Float weights have no scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import formats as single


def quantize(w: jax.Array, kind: str, group_size: int | None = None,
             zero_points: bool = False) -> tuple[jax.Array, jax.Array]:
    """(values, scales) of a float stack `w[G, K, N]`, each group quantized on its own."""
    if w.ndim != 3:
        raise ValueError(f"grouped quantize expects a [G, K, N] weight, got shape {w.shape}")
    return jax.vmap(lambda one: single.quantize(one, kind, group_size, zero_points))(w)


def dequantize(values: jax.Array, scales: jax.Array | None, kind: str | None,
               dtype=jnp.float32) -> jax.Array:
    """The float stack `[G, K, N]` in `dtype` (a float stack is only cast)."""
    if kind is None:
        return values.astype(dtype)
    return jax.vmap(lambda v, s: single.dequantize(v, s, kind, dtype))(values, scales)


def quantized_shapes(g: int, k: int, n: int, kind: str, group_size: int | None = None,
                     zero_points: bool = False):
    """((values shape, dtype), (scales shape, dtype)) of a quantized `[G, K, N]` stack."""
    (vs, vd), (ss, sd) = single.quantized_shapes(k, n, kind, group_size, zero_points)
    return ((g, *vs), vd), ((g, *ss), sd)


def check_operands(x: jax.Array, values: jax.Array, scales: jax.Array | None,
                   group_sizes: jax.Array, kind: str | None) -> int:
    """Validate a grouped matmul's operands; returns K."""
    if x.ndim != 2 or values.ndim != 3 or group_sizes.shape != values.shape[:1]:
        raise ValueError(f"grouped_matmul expects x[M, K], w[G, K, N] and group_sizes[G]; "
                         f"got {x.shape}, {values.shape}, {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes.dtype}")
    if kind is None:
        if scales is not None:
            raise ValueError("scales were given for a float weight: pass kind as well")
        if x.shape[1] != values.shape[1]:
            raise ValueError(f"x[M, {x.shape[1]}] does not fit w {values.shape}")
        return x.shape[1]
    if scales is None or scales.ndim not in (3, 4) or scales.shape[0] != values.shape[0]:
        raise ValueError(f"a {kind} stack needs scales [G, ., N] (with zero points "
                         f"[G, 2, ., N]); got {None if scales is None else scales.shape}")
    return single.check_operands(x, values[0], scales[0], kind)


def layout(kind: str | None, k: int, scales: jax.Array | None) -> tuple[int, bool, bool]:
    """(rows per group the kernels walk, whether grouped, whether with zero points) of a
    stack (a float one: (1, False, False)); see quantized_matmul.formats."""
    if kind is None:
        return 1, False, False
    one = scales[0]
    return single.kernel_group(kind, k, one), single.grouped(kind, one), \
        single.has_zero_points(one)


def pad_operands(x: jax.Array, values: jax.Array, scales: jax.Array | None, kind: str | None,
                 m: int, k: int, n: int):
    """Zero-pad x to `[m, k]` and each group's weight to `[k, n]` (grouped: K by whole groups;
    see quantized_matmul.formats.pad_operands). Kernels pick blocks that divide the real
    shapes where they can, so the stack is copied only for shapes no block divides."""
    xp = jnp.pad(x, ((0, m - x.shape[0]), (0, k - x.shape[1])))
    if kind is None:
        return xp, jnp.pad(values, ((0, 0), (0, k - values.shape[1]),
                                    (0, n - values.shape[2]))), None
    if (k, n) == (x.shape[1], values.shape[2]):
        return xp, values, scales
    values, scales = jax.vmap(
        lambda v, s: single.pad_operands(x, v, s, kind, m, k, n)[1:])(values, scales)
    return xp, values, scales
