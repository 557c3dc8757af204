"""Weight formats of the quantized matmul: quantize, pack, dequantize, check, pad.

The formats are described in this package's `__init__`. Loading quantizes with these, the
reference dequantizes with them, and the kernels check and pad their operands with them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KINDS = ("int8", "int4", "fp8")
INT8_MAX = 127
INT4_MAX = 7  # symmetric: -8 is representable but never produced by quantize
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = jnp.float8_e4m3fn


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown quantization kind {kind!r}: use one of {', '.join(KINDS)}")


def int4_group(k: int, group_size: int) -> int:
    """The int4 group size actually used for K rows: min(group_size, K), validated."""
    if group_size <= 0:
        raise ValueError(f"int4 group_size must be positive, got {group_size}")
    g = min(group_size, k)
    if k % g or g % 2:
        raise ValueError(
            f"int4 needs K ({k}) to be a multiple of an even group size; got group size {g}: "
            "pick a group_size that divides K (128 and 64 are usual)")
    return g


ShapeDtype = tuple[tuple[int, ...], jnp.dtype]


def quantized_shapes(k: int, n: int, kind: str, group_size: int = 128,
                     zero_points: bool = False) -> tuple[ShapeDtype, ShapeDtype]:
    """((values shape, dtype), (scales shape, dtype)) of a quantized `[K, N]` weight;
    `zero_points` (int4 only): scales `[2, K // G, N]`, each group's scale and zero point.

    Lets a model be built abstractly (jax.ShapeDtypeStruct) without quantizing anything.
    """
    check_kind(kind)
    if zero_points and kind != "int4":
        raise ValueError(f"zero points are an int4 format; {kind} is symmetric")
    if kind == "int8":
        return ((k, n), jnp.dtype(jnp.int8)), ((1, n), jnp.dtype(jnp.float32))
    if kind == "fp8":
        return ((k, n), jnp.dtype(FP8_DTYPE)), ((1, n), jnp.dtype(jnp.float32))
    g = int4_group(k, group_size)
    lead = (2,) if zero_points else ()
    return ((k // 2, n), jnp.dtype(jnp.uint8)), (lead + (k // g, n), jnp.dtype(jnp.float32))


def has_zero_points(scales: jax.Array) -> bool:
    """Whether int4 scales carry zero points (`[2, K // G, N]` rather than `[K // G, N]`)."""
    return scales.ndim == 3


def _safe_scale(amax: jax.Array, qmax: float) -> jax.Array:
    # An all-zero column (or group) quantizes to zeros whatever the scale; 1 keeps the
    # division finite instead of producing 0/0 = NaN.
    return jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)


def pack_int4(q: jax.Array, group: int) -> jax.Array:
    """Signed 4-bit ints `[K, N]` (in [-8, 7]) to bytes `[K // 2, N]`.

    Within each group of `group` rows, byte row j holds row j in the low nibble and row
    j + group/2 in the high one, so a kernel unpacks a group into two contiguous halves.
    """
    k, n = q.shape
    q = q.astype(jnp.int32).reshape(k // group, 2, group // 2, n)
    low, high = q[:, 0] & 0xF, q[:, 1] & 0xF
    return (low | (high << 4)).astype(jnp.uint8).reshape(k // 2, n)


def unpack_int4(values: jax.Array, group: int) -> jax.Array:
    """Bytes `[K // 2, N]` back to signed ints `[K, N]` (int32): the inverse of pack_int4."""
    half, n = values.shape
    v = values.astype(jnp.int32).reshape(2 * half // group, 1, group // 2, n)
    # Shift the nibble to the top of the int32, then shift back arithmetically: that
    # sign-extends two's complement without a branch.
    low = (v << 28) >> 28
    high = (v << 24) >> 28
    return jnp.concatenate([low, high], axis=1).reshape(2 * half, n)


def quantize(w: jax.Array, kind: str, group_size: int = 128,
             zero_points: bool = False) -> tuple[jax.Array, jax.Array]:
    """Quantize a float weight `w[K, N]`; returns (values, scales) as described in __init__.
    `zero_points` (int4): each group's range [min(w, 0), max(w, 0)] onto the 16 levels
    (asymmetric, GPTQ's scheme: 0.0 stays in range, so the zero point is one of the
    levels) instead of [-max|w|, max|w|] onto 15."""
    check_kind(kind)
    if zero_points and kind != "int4":
        raise ValueError(f"zero points are an int4 format; {kind} is symmetric")
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a [K, N] weight, got shape {w.shape}")
    w = w.astype(jnp.float32)
    k, n = w.shape
    if kind == "int8":
        scales = _safe_scale(jnp.max(jnp.abs(w), axis=0, keepdims=True), INT8_MAX)
        values = jnp.clip(jnp.round(w / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return values, scales
    if kind == "fp8":
        scales = _safe_scale(jnp.max(jnp.abs(w), axis=0, keepdims=True), FP8_MAX)
        # float8_e4m3fn has no infinity: anything rounding past 448 would become NaN.
        values = jnp.clip(w / scales, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
        return values, scales
    g = int4_group(k, group_size)
    grouped = w.reshape(k // g, g, n)
    if zero_points:
        low = jnp.minimum(jnp.min(grouped, axis=1), 0.0)
        high = jnp.maximum(jnp.max(grouped, axis=1), 0.0)
        scales = _safe_scale(high - low, 2 * INT4_MAX + 1)
        # The zero point is the level of 0.0: low maps to -8, high to 7 (up to rounding).
        zeros = jnp.clip(-8 - jnp.round(low / scales), -8, 7)
        q = jnp.clip(jnp.round(grouped / scales[:, None, :]) + zeros[:, None, :], -8, 7)
        return pack_int4(q.reshape(k, n), g), jnp.stack([scales, zeros])
    scales = _safe_scale(jnp.max(jnp.abs(grouped), axis=1), INT4_MAX)
    q = jnp.clip(jnp.round(grouped / scales[:, None, :]), -INT4_MAX, INT4_MAX)
    return pack_int4(q.reshape(k, n), g), scales


def dequantize(values: jax.Array, scales: jax.Array, kind: str,
               dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The float weight `[K, N]` in `dtype` (scaled in float32, then cast)."""
    check_kind(kind)
    if kind in ("int8", "fp8"):
        return (values.astype(jnp.float32) * scales).astype(dtype)
    k, n = 2 * values.shape[0], values.shape[1]
    g = k // scales.shape[-2]
    q = unpack_int4(values, g).astype(jnp.float32).reshape(k // g, g, n)
    if has_zero_points(scales):
        scales, zeros = scales[0], scales[1]
        q = q - zeros[:, None, :]  # exact: small integers
    return (q * scales[:, None, :]).reshape(k, n).astype(dtype)


def check_operands(x: jax.Array, values: jax.Array, scales: jax.Array, kind: str) -> int:
    """Validate shapes and dtypes of a quantized matmul; returns K."""
    check_kind(kind)
    zero_points = kind == "int4" and scales.ndim == 3
    if x.ndim != 2 or values.ndim != 2 or scales.ndim != 2 + zero_points:
        raise ValueError(f"quantized_matmul expects x[M, K], values 2-D and scales 2-D (or "
                         f"[2, K / G, N] for int4 with zero points); got "
                         f"{x.shape}, {values.shape}, {scales.shape}")
    k = values.shape[0] * (2 if kind == "int4" else 1)
    want = quantized_shapes(k, values.shape[1], kind,
                            group_size=k // max(scales.shape[-2], 1), zero_points=zero_points)
    if x.shape[1] != k or (values.shape, values.dtype) != want[0] or \
            (scales.shape, scales.dtype) != want[1]:
        raise ValueError(
            f"{kind} operands do not fit together: x {x.shape}, values {values.shape} "
            f"{values.dtype}, scales {scales.shape} {scales.dtype}; expected x[M, {k}] with "
            f"values {want[0][0]} {want[0][1]} and scales {want[1][0]} {want[1][1]}")
    return k


def pad_operands(x: jax.Array, values: jax.Array, scales: jax.Array, kind: str,
                 m: int, k: int, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Zero-pad the operands of a quantized matmul to x[m, k] and a weight of [k, n].

    The kernels pad to whole blocks. For int4, k - K must be whole groups, so that the
    padding forms groups of its own and leaves the byte layout of the real ones alone.
    Padded weights are zero bytes with zero scales and zero points (zero in every format),
    so they add nothing to the dot.
    """
    big_k, big_n = x.shape[1], values.shape[1]
    values_rows = k // 2 if kind == "int4" else k
    x = jnp.pad(x, ((0, m - x.shape[0]), (0, k - big_k)))
    values = jnp.pad(values, ((0, values_rows - values.shape[0]), (0, n - big_n)))
    if kind == "int4":
        group = big_k // scales.shape[-2]
        if (k - big_k) % group:
            raise ValueError(f"int4 K padding must be whole groups: {big_k} -> {k}, group {group}")
        pad = ((0, k // group - scales.shape[-2]), (0, n - big_n))
        scales = jnp.pad(scales, ((0, 0),) * (scales.ndim - 2) + pad)
    else:
        scales = jnp.pad(scales, ((0, 0), (0, n - big_n)))
    return x, values, scales
