"""Weight formats of the quantized matmul: quantize, pack, dequantize, check, pad.

The formats are described in this package's `__init__`. Loading quantizes with these, the
reference dequantizes with them, and the kernels check and pad their operands with them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KINDS = ("int8", "int4", "fp8", "fp4")
NIBBLE_KINDS = ("int4", "fp4")  # two values a byte, a group's halves in the low / high nibbles
INT8_MAX = 127
INT4_MAX = 7  # symmetric: -8 is representable but never produced by quantize
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = jnp.float8_e4m3fn
INT_RANGE = {"int8": (-128, 127), "int4": (-8, 7)}  # the stored integers (two's complement)
DEFAULT_INT4_GROUP = 128
DEFAULT_FP4_GROUP = 32  # MXFP4's block
FP4_EMAX = 2  # e2m1's largest exponent: a group's scale is 2^(floor(log2 max|w|) - 2)


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown quantization kind {kind!r}: use one of {', '.join(KINDS)}")


def kind_of(values: jax.Array, scales: jax.Array) -> str:
    """A quantized weight's kind, read from its dtypes: values int8, float8_e4m3fn, or
    uint8 (two nibbles a byte): int4 with float32 scales, fp4 with bfloat16 ones."""
    kinds = {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.uint8): "int4",
             jnp.dtype(FP8_DTYPE): "fp8"}
    if jnp.dtype(values.dtype) not in kinds:
        raise ValueError(f"quantized values must be int8, uint8 (int4, fp4) or "
                         f"{jnp.dtype(FP8_DTYPE)}; got {values.dtype}")
    kind = kinds[jnp.dtype(values.dtype)]
    return "fp4" if kind == "int4" and jnp.dtype(scales.dtype) == jnp.dtype(jnp.bfloat16) else kind


def rows_stored(k: int, kind: str | None) -> int:
    """The rows of a `[K, N]` weight's values: K (float too), or K / 2 for two nibbles a byte."""
    return k // 2 if kind in NIBBLE_KINDS else k


def group_rows(k: int, kind: str, group_size: int | None = None) -> int:
    """The rows G per scale group actually used for a weight of K rows, validated.

    int4: min(group_size or 128, K), even; fp4 the same with 32. int8 and fp8:
    min(group_size, K), or all of K (one scale per output channel) when group_size is None.
    """
    check_kind(kind)
    if group_size is None:
        group_size = {"int4": DEFAULT_INT4_GROUP, "fp4": DEFAULT_FP4_GROUP}.get(kind, k)
    if group_size <= 0:
        raise ValueError(f"{kind} group_size must be positive, got {group_size}")
    g = min(group_size, k)
    if k % g or (kind in NIBBLE_KINDS and g % 2):
        raise ValueError(
            f"{kind} needs K ({k}) to be a multiple of the group size"
            + (" (an even one)" if kind in NIBBLE_KINDS else "")
            + f"; got group size {g}: pick a group_size that divides K (128, 64 and 32 "
            "are usual)")
    return g


ShapeDtype = tuple[tuple[int, ...], jnp.dtype]


def quantized_shapes(k: int, n: int, kind: str, group_size: int | None = None,
                     zero_points: bool = False) -> tuple[ShapeDtype, ShapeDtype]:
    """((values shape, dtype), (scales shape, dtype)) of a quantized `[K, N]` weight;
    `zero_points` (int8, int4): scales `[2, K // G, N]`, each group's scale and zero point.

    Lets a model be built abstractly (jax.ShapeDtypeStruct) without quantizing anything.
    """
    g = group_rows(k, kind, group_size)
    if zero_points and kind in ("fp8", "fp4"):
        raise ValueError(f"zero points are an integer format; {kind} is symmetric")
    lead = (2,) if zero_points else ()
    scales = (lead + (k // g, n), jnp.dtype(jnp.bfloat16 if kind == "fp4" else jnp.float32))
    if kind == "int8":
        return ((k, n), jnp.dtype(jnp.int8)), scales
    if kind == "fp8":
        return ((k, n), jnp.dtype(FP8_DTYPE)), scales
    return ((k // 2, n), jnp.dtype(jnp.uint8)), scales


def has_zero_points(scales: jax.Array) -> bool:
    """Whether scales carry zero points (`[2, K // G, N]` rather than `[K // G, N]`)."""
    return scales.ndim == 3


def scale_groups(scales: jax.Array) -> int:
    """K // G: how many groups of rows the weight's scales cover."""
    return scales.shape[-2]


def _safe_scale(amax: jax.Array, qmax: float) -> jax.Array:
    # An all-zero column (or group) quantizes to zeros whatever the scale; 1 keeps the
    # division finite instead of producing 0/0 = NaN.
    return jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)


def pack_int4(q: jax.Array, group: int) -> jax.Array:
    """Signed 4-bit ints `[K, N]` (in [-8, 7]), or e2m1 codes (in [0, 15]), to bytes
    `[K // 2, N]`.

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
    return jnp.concatenate(_nibbles(v), axis=1).reshape(2 * half, n)


def _nibbles(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The signed low and high nibbles of int32 bytes: each shifted to the top of the
    int32, then back arithmetically, which sign-extends two's complement without a branch."""
    return (v << 28) >> 28, (v << 24) >> 28


def e2m1_values(codes: jax.Array) -> jax.Array:
    """float32 values of e2m1 codes (int32, 0-15; bit 3 the sign, bits 2-1 the exponent,
    bit 0 the mantissa): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Selects and
    arithmetic only (no gather, no bitcast), so every backend's kernels run it as is:
    magnitude code u = 0..7 gives u / 2 below 4, u - 2 for 4-5, 2u - 8 for 6-7."""
    u = (codes & 7).astype(jnp.float32)
    magnitude = jnp.where(u < 4, 0.5 * u, jnp.where(u < 6, u - 2.0, 2.0 * u - 8.0))
    return jnp.where((codes & 8) != 0, -magnitude, magnitude)


def nibble_values(v: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """The low and high nibbles of bytes (int32) as the float32 numbers they store: int4's
    signed integers or fp4's e2m1 values."""
    if kind == "fp4":
        return e2m1_values(v & 0xF), e2m1_values((v >> 4) & 0xF)
    low, high = _nibbles(v)
    return low.astype(jnp.float32), high.astype(jnp.float32)


def _fp4_codes(x: jax.Array) -> jax.Array:
    """The e2m1 code (int32) nearest each float32 of x, ties to the even code (OCP MX's
    round-to-nearest-even), beyond 6 clamped to 6."""
    a = jnp.abs(x)
    # Midpoints between the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; at a midpoint the even
    # code (mantissa bit 0) wins: <= toward even codes, < toward odd ones.
    u = ((a > 0.25).astype(jnp.int32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
         + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    return jnp.where(x < 0, u | 8, u)


def quantize(w: jax.Array, kind: str, group_size: int | None = None,
             zero_points: bool = False) -> tuple[jax.Array, jax.Array]:
    """Quantize a float weight `w[K, N]`; returns (values, scales) as described in __init__.
    `zero_points` (int8, int4): each group's range [min(w, 0), max(w, 0)] onto all the
    levels (asymmetric, GPTQ's scheme: 0.0 stays in range, so the zero point is one of the
    levels) instead of [-max|w|, max|w|] onto the symmetric ones."""
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a [K, N] weight, got shape {w.shape}")
    k, n = w.shape
    (_, vdtype), _ = quantized_shapes(k, n, kind, group_size, zero_points)
    g = group_rows(k, kind, group_size)
    grouped = w.astype(jnp.float32).reshape(k // g, g, n)
    if kind == "fp4":
        # OCP MX: a power-of-two scale per group, 2^(floor(log2 max|w|) - emax), so the
        # largest magnitude lands in [4, 8) (above 6 it rounds down to 6).
        amax = jnp.max(jnp.abs(grouped), axis=1)
        exponent = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - FP4_EMAX
        scales = jnp.exp2(jnp.clip(exponent, -126, 127)).astype(jnp.float32)
        codes = _fp4_codes(grouped / scales[:, None, :]).reshape(k, n)
        return pack_int4(codes, g), scales.astype(jnp.bfloat16)
    if kind == "fp8":
        scales = _safe_scale(jnp.max(jnp.abs(grouped), axis=1), FP8_MAX)
        # float8_e4m3fn has no infinity: anything rounding past 448 would become NaN.
        values = jnp.clip(grouped / scales[:, None, :], -FP8_MAX, FP8_MAX)
        return values.reshape(k, n).astype(FP8_DTYPE), scales
    lo, hi = INT_RANGE[kind]
    if zero_points:
        low = jnp.minimum(jnp.min(grouped, axis=1), 0.0)
        high = jnp.maximum(jnp.max(grouped, axis=1), 0.0)
        scales = _safe_scale(high - low, hi - lo)
        # The zero point is the level of 0.0: low maps to the lowest level, high to the
        # highest (up to rounding).
        zeros = jnp.clip(lo - jnp.round(low / scales), lo, hi)
        q = jnp.clip(jnp.round(grouped / scales[:, None, :]) + zeros[:, None, :], lo, hi)
        scales = jnp.stack([scales, zeros])
    else:
        scales = _safe_scale(jnp.max(jnp.abs(grouped), axis=1), hi)
        q = jnp.clip(jnp.round(grouped / scales[:, None, :]), -hi, hi)
    q = q.reshape(k, n)
    values = pack_int4(q, g) if kind == "int4" else q.astype(vdtype)
    return values, scales


# The native CPU kernel's packed layout (pallas_kernels/cpu/quantized.h): the rows of
# each strip of STRIP columns one after another, for the values and for the scales (each
# plane of `[2, G', N]`), so that the kernel's tile, which owns a strip, reads its weight
# and its scales as sequential streams. Row-major `[K', N]` values (K' = K, int4's K / 2)
# put each of a tile's rows in another cache line, N bytes apart, and its scales N floats
# apart, which the hardware prefetchers do not follow (docs/kernels.md has the numbers).
# STRIP is the kernel's kQmmCols.
STRIP = 32


def packable(values: jax.Array) -> bool:
    """Whether an int8 / int4 weight (its values; the caller knows it is not fp4) can be
    packed: N a multiple of STRIP."""
    return (values.ndim == 2 and values.dtype in (jnp.int8, jnp.uint8)
            and values.shape[1] % STRIP == 0)


def pack_strips(a: jax.Array) -> jax.Array:
    """Values `[K', N]` or scales `[G', N]` / `[2, G', N]` in the packed layout (the same
    shape, each plane's elements reordered)."""
    *lead, k, n = a.shape
    return a.reshape(*lead, k, n // STRIP, STRIP).swapaxes(-3, -2).reshape(a.shape)


def unpack_strips(a: jax.Array) -> jax.Array:
    """`pack_strips` undone: the row-major array."""
    *lead, k, n = a.shape
    return a.reshape(*lead, n // STRIP, k, STRIP).swapaxes(-3, -2).reshape(a.shape)


def integers(values: jax.Array, kind: str, group: int) -> jax.Array:
    """The stored integers (int8, int4) or floats (fp8, fp4) `[K, N]`, unscaled, as
    float32."""
    if kind in NIBBLE_KINDS:
        half, n = values.shape
        v = values.astype(jnp.int32).reshape(2 * half // group, 1, group // 2, n)
        return jnp.concatenate(nibble_values(v, kind), axis=1).reshape(2 * half, n)
    return values.astype(jnp.float32)


def dequantize(values: jax.Array, scales: jax.Array, kind: str,
               dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The float weight `[K, N]` in `dtype` (scaled in float32, then cast)."""
    check_kind(kind)
    k = values.shape[0] * (2 if kind in NIBBLE_KINDS else 1)
    n = values.shape[1]
    groups = scale_groups(scales)
    g = k // groups
    q = integers(values, kind, g).reshape(groups, g, n)
    scales = scales.astype(jnp.float32)
    if has_zero_points(scales):
        scales, zeros = scales[0], scales[1]
        q = q - zeros[:, None, :]  # exact: small integers
    return (q * scales[:, None, :]).reshape(k, n).astype(dtype)


def dequantize_rows(values: jax.Array, scales: jax.Array, kind: str,
                    dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """`dequantize` of a weight held transposed, by rows: values `[N, K']` and scales
    `[N, K / G]` (`[2, N, K / G]` with zero points) give the float `[N, K]` (an embedding
    table's looked-up rows: each row's groups contiguous, so no transpose on the way)."""
    check_kind(kind)
    n, k = values.shape[0], values.shape[1] * (2 if kind in NIBBLE_KINDS else 1)
    groups = scales.shape[-1]
    g = k // groups
    if kind in NIBBLE_KINDS:
        v = values.astype(jnp.int32).reshape(n, groups, 1, g // 2)
        q = jnp.concatenate(nibble_values(v, kind), axis=2)
    else:
        q = values.astype(jnp.float32)
    q = q.reshape(n, groups, g)
    scales = scales.astype(jnp.float32)
    if has_zero_points(scales):
        scales, zeros = scales[0], scales[1]
        q = q - zeros[..., None]
    return (q * scales[..., None]).reshape(n, k).astype(dtype)


def check_operands(x: jax.Array, values: jax.Array, scales: jax.Array, kind: str) -> int:
    """Validate shapes and dtypes of a quantized matmul; returns K."""
    check_kind(kind)
    if x.ndim != 2 or values.ndim != 2 or scales.ndim not in (2, 3):
        raise ValueError(f"quantized_matmul expects x[M, K], values 2-D and scales [K / G, N] "
                         f"(or [2, K / G, N] with zero points); got "
                         f"{x.shape}, {values.shape}, {scales.shape}")
    k, n = values.shape[0] * (2 if kind in NIBBLE_KINDS else 1), values.shape[1]
    groups = max(scale_groups(scales), 1)
    want = quantized_shapes(k, n, kind, max(k // groups, 1), zero_points=has_zero_points(scales))
    if x.shape[1] != k or (values.shape, values.dtype) != want[0] or \
            (scales.shape, scales.dtype) != want[1]:
        raise ValueError(
            f"{kind} operands do not fit together: x {x.shape}, values {values.shape} "
            f"{values.dtype}, scales {scales.shape} {scales.dtype}; expected x[M, {k}] with "
            f"values {want[0][0]} {want[0][1]} and scales {want[1][0]} {want[1][1]}")
    return k


def grouped(kind: str, scales: jax.Array) -> bool:
    """Whether the kernels scale each group of rows' partial sum (int4, fp4, and int8 /
    fp8 with group scales) rather than the finished sum once (per-channel 8-bit scales)."""
    return kind in NIBBLE_KINDS or scale_groups(scales) > 1


def kernel_group(kind: str, k: int, scales: jax.Array) -> int:
    """The rows per group a kernel walks: G when grouped, else 1 (no constraint on K)."""
    return k // scale_groups(scales) if grouped(kind, scales) else 1


def pad_operands(x: jax.Array, values: jax.Array, scales: jax.Array, kind: str,
                 m: int, k: int, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Zero-pad the operands of a quantized matmul to x[m, k] and a weight of [k, n].

    The kernels pad to whole blocks. For grouped weights (int4, fp4, 8-bit with group
    scales), k - K must be whole groups, so that the padding forms groups of its own (and,
    for two nibbles a byte, leaves the byte layout of the real ones alone). Padded weights
    are zero bytes with zero scales and zero points (zero in every format), and padded x
    is zero, so they add nothing to the dot.
    """
    big_k, big_n = x.shape[1], values.shape[1]
    values_rows = rows_stored(k, kind)
    x = jnp.pad(x, ((0, m - x.shape[0]), (0, k - big_k)))
    values = jnp.pad(values, ((0, values_rows - values.shape[0]), (0, n - big_n)))
    groups = scale_groups(scales)
    more = 0
    if grouped(kind, scales):
        group = big_k // groups
        if (k - big_k) % group:
            raise ValueError(f"{kind} K padding must be whole groups: {big_k} -> {k}, "
                             f"group {group}")
        more = k // group - groups
    scales = jnp.pad(scales, ((0, 0),) * (scales.ndim - 2) + ((0, more), (0, n - big_n)))
    return x, values, scales
