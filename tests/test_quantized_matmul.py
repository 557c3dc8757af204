"""Weight-only quantized matmul: the reference against numpy float64, the Pallas TPU and GPU
kernels (interpret mode) against the reference, and both kernels compiled / lowered for
their real targets from this CPU machine.

Tolerances, derived rather than tuned (Σ below is the elementwise |x| @ |w_deq|, the sum of
absolute products each output element adds up):
- float32 x: both paths compute exact f32 products of f32 values and differ only in f32
  summation order, so they agree to 1e-5 of the output's magnitude (max |y|).
- bfloat16 x (8 significant bits, so rounding is relative 2^-8): the reference rounds every
  dequantized weight to bf16 (2^-8 Σ in all), sums in f32, and rounds y to bf16 (2^-8 |y|
  <= 2^-8 Σ): within 2^-7 Σ of the float64 oracle. The kernels keep int8 / int4 / fp8 / fp4
  values exact in bf16 (integers up to 256, e4m3's 4 and e2m1's 2 significant bits fit; products
  with x are exact in f32) and apply the scales in f32, so their only bf16 rounding is
  y's: within 2^-8 |y| + 2^-14 Σ (f32 summation) of the oracle, and within the sum of both
  bounds of the reference.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import kernel_interpret
from pallas_kernels import quantized_matmul as qmm
from pallas_kernels.quantized_matmul import cpu, formats, gpu, reference, tpu


@pytest.fixture
def rng(request):
    """A Generator seeded by the test's id: fresh draws per case, reproducible per case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def numpy_unpack_nibbles(values: np.ndarray, group: int) -> np.ndarray:
    """The 4-bit fields (0-15) of packed bytes in row order: an unpacker written from the
    format's description alone, byte by byte."""
    v = np.asarray(values, dtype=np.uint8)
    half, n = v.shape
    low = (v & 0x0F).astype(np.int16)
    high = (v >> 4).astype(np.int16)
    out = np.empty((2 * half, n), dtype=np.int16)
    per = group // 2
    for start in range(0, half, per):
        out[2 * start:2 * start + per] = low[start:start + per]
        out[2 * start + per:2 * start + group] = high[start:start + per]
    return out


def numpy_unpack_int4(values: np.ndarray, group: int) -> np.ndarray:
    """The signed ints (two's complement nibbles)."""
    u = numpy_unpack_nibbles(values, group)
    return np.where(u >= 8, u - 16, u)


def numpy_unpack_fp4(values: np.ndarray, group: int) -> np.ndarray:
    """The e2m1 values, decoded by ml_dtypes' float4_e2m1fn (the oracle)."""
    u = numpy_unpack_nibbles(values, group).astype(np.uint8)
    return u.view(ml_dtypes.float4_e2m1fn).astype(np.float64)


# Test variants of the kernels' kinds: "-g" int8 / fp8 with group scales, "-zp" with zero points
# (int8: grouped too), "-czp" int8 per channel with zero points.
VARIANTS = ["int8", "int8-g", "int8-zp", "int4", "int4-zp", "fp8", "fp8-g", "fp4"]


def base(kind: str) -> str:
    """The kernels' kind of a test variant."""
    return kind.split("-")[0]


def has_zp(kind: str) -> bool:
    return kind.endswith("zp")


def variant_group(kind: str, group_size: int = 128) -> int | None:
    """The group_size a variant quantizes with: int8 per channel unless "-g" / "-zp"; fp4
    in MXFP4's groups of 32."""
    if kind in ("int8", "int8-czp", "fp8"):
        return None
    return 32 if kind == "fp4" else group_size


def numpy_dequantize(values, scales, kind: str) -> np.ndarray:
    """float64 weight from the stored format, independently of formats.dequantize."""
    scales = np.asarray(scales.astype(jnp.float32), np.float64)
    scales, zeros = scales if has_zp(kind) else (scales, np.zeros_like(scales))
    if base(kind) in ("int4", "fp4"):
        unpack = numpy_unpack_int4 if base(kind) == "int4" else numpy_unpack_fp4
        q = unpack(np.asarray(values), 2 * values.shape[0] // scales.shape[0])
    else:
        q = np.asarray(values.astype(jnp.float32), np.float64)
    rep = lambda a: np.repeat(a, q.shape[0] // scales.shape[0], axis=0)  # noqa: E731
    return (q - rep(zeros)) * rep(scales)


def draw(rng, m: int, k: int, n: int, kind: str, dtype, group_size: int = 128):
    """Random normal x and a quantized random weight (never zeros; shifted off zero with
    zero points, so that the zero points differ from group to group)."""
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32), dtype)
    w = rng.standard_normal((k, n), dtype=np.float32)
    group = variant_group(kind, group_size)
    if has_zp(kind):
        g = min(group or k, k)
        w += rng.uniform(-2, 2, size=(k // g, 1, n)).repeat(g, axis=1).reshape(
            k, n).astype(np.float32)
    values, scales = formats.quantize(jnp.asarray(w), base(kind), group,
                                      zero_points=has_zp(kind))
    return x, values, scales


def oracle(x, values, scales, kind):
    """(y, Σ) in float64: the exact product with the dequantized weight, and |x| @ |w|."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = numpy_dequantize(values, scales, kind)
    return x64 @ w64, np.abs(x64) @ np.abs(w64)


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def assert_kernel_matches(y, x, values, scales, kind):
    """The kernel's output against the reference (and, for bf16, the float64 oracle)."""
    ref = f64(reference.quantized_matmul(x, values, scales, kind=base(kind)))
    y = f64(y)
    assert y.shape == ref.shape
    if x.dtype == jnp.float32:
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        return
    exact, sigma = oracle(x, values, scales, kind)
    kernel_bound = 2.0**-8 * np.abs(exact) + 2.0**-14 * sigma
    reference_bound = 2.0**-7 * sigma
    assert np.all(np.abs(y - exact) <= kernel_bound), np.abs(y - exact).max()
    assert np.all(np.abs(y - ref) <= kernel_bound + reference_bound), np.abs(y - ref).max()


# --- reference: formats and the truth ----------------------------------------------------


@pytest.mark.parametrize("kind", ["int8", "int8-g", "int4"])
def test_integer_quantization_error_is_at_most_half_a_step(rng, kind):
    """Round-to-nearest: every element is within scale/2 of its dequantized value."""
    w = rng.standard_normal((256, 96), dtype=np.float32) * 3
    w[:, 5] = 0.0  # an all-zero column must not divide by zero
    values, scales = formats.quantize(jnp.asarray(w), base(kind),
                                      variant_group(kind, group_size=64))
    deq = np.asarray(formats.dequantize(values, scales, base(kind), jnp.float32), np.float64)
    step = np.repeat(np.asarray(scales, np.float64), 256 // scales.shape[0], axis=0)
    assert np.all(np.isfinite(deq)) and np.all(deq[:, 5] == 0)
    # 1e-6 relative slack: w / scale and q * scale are each rounded once in float32.
    assert np.all(np.abs(w - deq) <= step / 2 * (1 + 1e-6) + 1e-6 * np.abs(w))
    assert scales.shape == ((1, 96) if kind == "int8" else (4, 96))


def test_fp8_quantization_relative_error(rng):
    """e4m3 has 3 mantissa bits: a normal value rounds within 2^-4 relative; values below
    its smallest normal (2^-6 in scaled units) within half a subnormal step, 2^-10 scaled."""
    w = rng.standard_normal((128, 64), dtype=np.float32)
    w[:, 3] = 0.0
    values, scales = formats.quantize(jnp.asarray(w), "fp8")
    deq = np.asarray(formats.dequantize(values, scales, "fp8", jnp.float32), np.float64)
    s = np.asarray(scales, np.float64)
    assert values.dtype == jnp.float8_e4m3fn and np.all(np.isfinite(deq))
    bound = np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * s) * (1 + 1e-6)
    assert np.all(np.abs(w - deq) <= bound)
    # The largest element of each column lands on 448, the top of the range.
    assert np.allclose(np.abs(deq).max(axis=0)[s[0] != 1], np.abs(w).max(axis=0)[s[0] != 1])


def test_int4_packing_round_trip_against_numpy(rng):
    """pack -> independent numpy unpack gives the ints back, and the reference unpack agrees."""
    group = 32
    q = rng.integers(-8, 8, size=(128, 48))
    packed = formats.pack_int4(jnp.asarray(q), group)
    assert packed.dtype == jnp.uint8 and packed.shape == (64, 48)
    np.testing.assert_array_equal(numpy_unpack_int4(np.asarray(packed), group), q)
    np.testing.assert_array_equal(np.asarray(formats.unpack_int4(packed, group)), q)
    # The layout by hand: byte row j of group 1 = row 32 + j (low), row 48 + j (high).
    byte = int(np.asarray(packed)[16 + 3, 7])
    assert (byte & 0xF) == q[32 + 3, 7] & 0xF and (byte >> 4) == q[48 + 3, 7] & 0xF


@pytest.mark.parametrize("kind, group, zp", [("int4", 32, True), ("int4", 16, False),
                                             ("int8", 32, True), ("int8", None, False),
                                             ("fp4", 32, False)])
def test_dequantize_rows_against_numpy(rng, kind, group, zp):
    """A weight held by rows (an embedding table: values `[N, K']`, scales `[(2,) N, G']`)
    dequantizes to the numpy unpacking of its integers, minus zero points, times scales."""
    w = rng.standard_normal((64, 24), dtype=np.float32)  # [K, N]
    values, scales = formats.quantize(jnp.asarray(w), kind, group, zero_points=zp)
    g = group or 64
    unpack = {"int4": numpy_unpack_int4, "fp4": numpy_unpack_fp4}.get(kind)
    q = unpack(np.asarray(values), g) if unpack else np.asarray(values)
    s = np.asarray(scales.astype(jnp.float32))
    scale, zero = (s[0], s[1]) if zp else (s, np.zeros_like(s))
    want = ((q.reshape(64 // g, g, 24) - zero[:, None]) * scale[:, None]).reshape(64, 24).T
    got = formats.dequantize_rows(values.T, jnp.swapaxes(scales, -1, -2), kind)
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))


def test_int4_quantize_matches_numpy_rounding(rng):
    w = rng.standard_normal((256, 40), dtype=np.float32)
    values, scales = formats.quantize(jnp.asarray(w), "int4", group_size=128)
    s = np.asarray(scales)
    expected = np.round(w.reshape(2, 128, 40) / s[:, None, :]).reshape(256, 40)
    np.testing.assert_array_equal(numpy_unpack_int4(np.asarray(values), 128), expected)


def test_fp4_quantize_is_mxfp4(rng):
    """fp4 as the OCP microscaling spec quantizes: each group of 32 under the power of two
    2^(floor(log2 max|w|) - 2) (so its largest value lands in [4, 8)), every element the
    e2m1 value nearest w / scale (ml_dtypes' float4_e2m1fn conversion, ties to even,
    saturating at 6); the scales are bf16, which is how kind_of tells fp4 from int4."""
    w = rng.standard_normal((128, 40), dtype=np.float32) * np.exp2(rng.integers(-9, 9, 40))
    w[:, 3] = 0.0
    w[:32, 5] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9] * 4  # ties, and past 6
    values, scales = formats.quantize(jnp.asarray(w), "fp4")
    assert values.dtype == jnp.uint8 and values.shape == (64, 40)
    assert scales.dtype == jnp.bfloat16 and scales.shape == (4, 40)
    assert formats.kind_of(values, scales) == "fp4"
    assert formats.kind_of(values, scales.astype(jnp.float32)) == "int4"
    s = np.asarray(scales.astype(jnp.float32), np.float64)
    amax = np.abs(w.reshape(4, 32, 40)).max(axis=1)
    want_s = np.exp2(np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2)
    np.testing.assert_array_equal(s, want_s)
    codes = (w.reshape(4, 32, 40) / s[:, None, :]).astype(ml_dtypes.float4_e2m1fn)
    want = codes.astype(np.float64) * s[:, None, :]
    np.testing.assert_array_equal(numpy_dequantize(values, scales, "fp4"), want.reshape(128, 40))
    np.testing.assert_array_equal(np.asarray(formats.dequantize(values, scales, "fp4")),
                                  want.reshape(128, 40).astype(np.float32))
    # max 7.9: scale 1; the ties to even, and 7.9 saturating at 6
    assert s[0, 5] == 1.0 and list(want[0, :8, 5]) == [0, 1, 1, 2, 2, 4, 4, 6]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_zero_points_quantize_a_shifted_group_within_half_a_step(rng, group):
    """Asymmetric int4: a group's [min, max] spans the 16 levels, every element lands within
    scale/2, and the zero points are integers in [-8, 7] (the level of 0.0)."""
    w = rng.uniform(0.5, 3.0, size=(256, 48)).astype(np.float32)  # all positive: symmetric
    w[:, 7] = 0.0                                                  # would waste half its range
    values, scales = formats.quantize(jnp.asarray(w), "int4", group, zero_points=True)
    assert scales.shape == (2, 256 // group, 48) and values.shape == (128, 48)
    s, z = np.asarray(scales, np.float64)
    deq = numpy_dequantize(values, scales, "int4-zp")
    # (q - z) * s: one float32 rounding of the exact float64 product.
    np.testing.assert_array_equal(np.asarray(formats.dequantize(values, scales, "int4")),
                                  deq.astype(np.float32))
    step = np.repeat(s, group, axis=0)
    assert np.all(np.abs(w - deq) <= step / 2 * (1 + 1e-6) + 1e-6 * np.abs(w))
    assert np.all(z == np.round(z)) and z.min() >= -8 and z.max() <= 7
    assert np.all(deq[:, 7] == 0)
    # The range, not max|w|, sets the step: about half the symmetric format's.
    _, sym = formats.quantize(jnp.asarray(w), "int4", group)
    assert np.median(s / np.asarray(sym)) < 0.6


@pytest.mark.parametrize("kind", VARIANTS + ["int8-czp"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_matmul_against_float64(rng, kind, dtype):
    x, values, scales = draw(rng, 7, 256, 72, kind, dtype)
    y = f64(qmm.quantized_matmul(x, values, scales, kind=base(kind), impl="reference"))
    exact, sigma = oracle(x, values, scales, kind)
    assert y.dtype == np.float64 and y.shape == (7, 72)
    # f32: summation order only (see the module doc); bf16: the reference's 2^-7 Σ bound.
    bound = 1e-5 * np.abs(exact).max() if dtype == jnp.float32 else 2.0**-7 * sigma
    assert np.all(np.abs(y - exact) <= bound), np.abs(y - exact).max()


@pytest.mark.parametrize("kind, k, n, group, zp, scales_shape", [
    ("int8", 100, 24, None, False, (1, 24)), ("int8", 96, 24, 32, False, (3, 24)),
    ("int8", 96, 24, 32, True, (2, 3, 24)), ("fp8", 100, 24, None, False, (1, 24)),
    ("int4", 96, 24, 32, False, (3, 24)), ("int4", 96, 24, None, True, (2, 1, 24)),
    ("fp8", 96, 24, 32, False, (3, 24)), ("fp4", 96, 24, None, False, (3, 24)),
    ("fp4", 96, 24, 96, False, (1, 24))])
def test_quantized_shapes_match_quantize(kind, k, n, group, zp, scales_shape):
    values, scales = formats.quantize(jnp.ones((k, n)), kind, group, zero_points=zp)
    (vs, vd), (ss, sd) = qmm.quantized_shapes(k, n, kind, group, zero_points=zp)
    assert (values.shape, values.dtype, scales.shape, scales.dtype) == (vs, vd, ss, sd)
    assert scales.shape == scales_shape


def test_bad_formats_say_what_to_do():
    with pytest.raises(ValueError, match="multiple of the group size"):
        formats.quantize(jnp.ones((192, 8)), "int4", group_size=128)  # 192 % 128
    with pytest.raises(ValueError, match="an even one"):
        formats.quantize(jnp.ones((9, 8)), "int4", group_size=128)  # G = 9
    with pytest.raises(ValueError, match="multiple of the group size"):
        formats.quantize(jnp.ones((100, 8)), "int8", group_size=32)
    with pytest.raises(ValueError, match="fp8 is symmetric"):
        formats.quantize(jnp.ones((64, 8)), "fp8", zero_points=True)
    with pytest.raises(ValueError, match="fp4 is symmetric"):
        formats.quantize(jnp.ones((64, 8)), "fp4", zero_points=True)
    with pytest.raises(ValueError, match="unknown quantization kind"):
        formats.quantize(jnp.ones((8, 8)), "int3")
    values, scales = formats.quantize(jnp.ones((128, 8)), "int8")
    with pytest.raises(ValueError, match="do not fit together"):
        qmm.quantized_matmul(jnp.ones((2, 64)), values, scales, kind="int8")


def test_dispatch_on_cpu_and_interpret_needs_an_impl(rng):
    x, values, scales = draw(rng, 3, 128, 16, "int8", jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):  # a GPU host's CPU device too
        assert qmm.choose_impl("int8", 1) == "reference"
        # A few rows take the native kernel where it is built (tests/test_cpu_kernels.py).
        want = cpu.quantized_matmul(x, values, scales, kind="int8")
        np.testing.assert_array_equal(
            np.asarray(qmm.quantized_matmul(x, values, scales, kind="int8")), np.asarray(want))
        assert_kernel_matches(want, x, values, scales, "int8")
    with pytest.raises(ValueError, match="explicit impl"):
        qmm.quantized_matmul(x, values, scales, kind="int8", interpret=True)
    with pytest.raises(ValueError, match="unknown impl"):
        qmm.quantized_matmul(x, values, scales, kind="int8", impl="cuda")


def test_fp8_on_gpu_needs_compute_capability_8_9():
    assert [qmm.gpu_converts_fp8(cc) for cc in ("8.0", "8.6", "8.9", "9.0", "10.0", "gfx942")] \
        == [False, False, True, True, True, False]


# --- kernels in interpret mode against the reference --------------------------------------

# (M, K, N): decode-sized and odd M, K and N that are and are not block multiples.
SHAPES = [(1, 128, 128), (5, 256, 200), (16, 256, 256), (37, 384, 200)]


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_reference(rng, impl, kind, dtype):
    for m, k, n in SHAPES:
        x, values, scales = draw(rng, m, k, n, kind, dtype)
        y = qmm.quantized_matmul(x, values, scales, kind=base(kind), impl=impl,
                                 interpret=kernel_interpret(impl))
        assert y.dtype == dtype and y.shape == (m, n)
        assert_kernel_matches(y, x, values, scales, kind)


# Small explicit blocks: several M, N and K blocks, K padded by a whole block (384 -> 512),
# and int4 groups of 64, two per K block.
FORCED_BLOCKS = {"tpu": dict(block_m=16, block_n=128, block_k=256),
                 "gpu": dict(block_m=16, block_n=64, block_k=256)}


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("kind", VARIANTS + ["int8-czp"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_with_many_blocks(rng, impl, kind, dtype):
    x, values, scales = draw(rng, 37, 384, 256, kind, dtype, group_size=64)
    y = qmm.quantized_matmul(x, values, scales, kind=base(kind), impl=impl,
                             interpret=kernel_interpret(impl),
                             **FORCED_BLOCKS[impl])
    assert_kernel_matches(y, x, values, scales, kind)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("kind", ["int4-zp", "int8-zp"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_kernel_with_zero_points_at_each_group_size(rng, impl, kind, group):
    """AWQ / GPTQ / GGUF group sizes: several groups per K block, K = 384 padded to whole
    blocks."""
    x, values, scales = draw(rng, 5, 384, 200, kind, jnp.bfloat16, group_size=group)
    y = qmm.quantized_matmul(x, values, scales, kind=base(kind), impl=impl,
                             interpret=kernel_interpret(impl))
    assert_kernel_matches(y, x, values, scales, kind)


def test_block_rules():
    # TPU: decode batch -> one bf16 tile of rows; big weights -> 512-wide N, 512/1024 K.
    assert tpu.block_sizes(16, 4096, 14336, "int8", 1, jnp.bfloat16) == (16, 512, 512)
    assert tpu.block_sizes(16, 4096, 14336, "int4", 128, jnp.bfloat16) == (16, 512, 1024)
    assert tpu.block_sizes(5, 384, 200, "fp8", 1, jnp.float32) == (8, 256, 384)
    assert tpu.block_sizes(1000, 96, 8, "int4", 96, jnp.bfloat16) == (256, 128, 384)
    with pytest.raises(ValueError, match="multiples"):
        tpu.block_sizes(16, 256, 256, "int4", 128, jnp.bfloat16, block_k=64)
    # GPU: powers of two >= 16, K blocks hold whole int4 groups.
    assert gpu.block_sizes(1, 4096, 14336, "int8", 1) == (16, 128, 128)
    assert gpu.block_sizes(37, 384, 200, "int4", 256) == (64, 128, 256)
    assert not gpu.supports("int4", 96) and not gpu.supports("int4", 16)
    with pytest.raises(ValueError, match="powers of two"):
        gpu.block_sizes(16, 256, 256, "int8", 1, block_n=96)
    # GPU split-K: only when the (M, N) blocks fill at most half of the 132 SMs.
    assert gpu.default_num_k_splits(4096 // 128, 14336 // 128) == 5  # Llama-3-8B down, M <= 64
    assert gpu.default_num_k_splits(14336 // 128, 4096 // 128) == 1  # up / gate: 112 blocks
    assert gpu.default_num_k_splits(12, 2) == 2  # never more splits than K steps
    assert gpu.default_num_k_splits(1, 1) == 1


@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_gpu_split_k_matches_reference(rng, kind, splits):
    """K = 640 in 128-wide steps: 5 steps over 2 splits (3 + 2) or 4 (2 + 2 + 1 + 0: one
    split empty), int4 groups of 128; f32 partials summed."""
    x, values, scales = draw(rng, 5, 640, 200, kind, jnp.bfloat16, group_size=128)
    y = gpu.quantized_matmul(x, values, scales, kind=base(kind), block_k=128, num_k_splits=splits,
                             interpret=kernel_interpret("gpu"))
    assert y.dtype == jnp.bfloat16 and y.shape == (5, 200)
    assert_kernel_matches(y, x, values, scales, kind)


# --- the GPU kernel lowers to Triton (no GPU needed) --------------------------------------

LLAMA3_8B_MLP = [(16, 4096, 14336), (16, 14336, 4096)]  # x[16, K] @ W[K, N]


def abstract_operands(m: int, k: int, n: int, kind: str, sharding=None, dtype=jnp.bfloat16):
    (vs, vd), (ss, sd) = formats.quantized_shapes(k, n, base(kind),
                                                  variant_group(kind),
                                                  zero_points=has_zp(kind))
    return (jax.ShapeDtypeStruct((m, k), dtype, sharding=sharding),
            jax.ShapeDtypeStruct(vs, vd, sharding=sharding),
            jax.ShapeDtypeStruct(ss, sd, sharding=sharding))


def export_gpu_kernel(m: int, k: int, n: int, kind: str) -> jax.export.Exported:
    """The GPU kernel at x[M, K] @ W[K, N], exported for CUDA (Triton IR; no GPU needed)."""
    fn = jax.jit(lambda x, v, s: gpu.quantized_matmul(x, v, s, kind=base(kind)))
    return jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*abstract_operands(m, k, n, kind))


@pytest.mark.parametrize("kind", VARIANTS)
def test_gpu_kernel_lowers_to_triton_for_llama3_8b(kind):
    """Pallas's Triton lowering (jaxpr -> Triton IR, as for compute capability 9.0 when no
    GPU is present) accepts the kernel at real shapes: one program per 128 output columns."""
    m, k, n = LLAMA3_8B_MLP[0]
    text = export_gpu_kernel(m, k, n, kind).mlir_module()
    assert "__gpu$xla.gpu.triton" in text
    assert f"grid_y = {n // 128} : i32" in text


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_gpu_kernel_lowers_with_k_splits_for_llama3_8b_down(kind):
    """The down projection [14336, 4096] at M = 16 lowers as 32 N blocks x 5 K splits."""
    m, k, n = LLAMA3_8B_MLP[1]
    exported = export_gpu_kernel(m, k, n, kind)
    text = exported.mlir_module()
    assert f"grid_y = {n // 128} : i32" in text and "grid_z = 5 : i32" in text
    assert exported.out_avals[0].shape == (m, n)


# --- the TPU kernel compiled ahead of time for real TPU generations -----------------------

def compile_on_chip(fn, args, dev):
    with jax.default_device(dev):
        return jax.jit(fn).lower(*args).compile()


@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("m, k, n", LLAMA3_8B_MLP, ids=["up", "down"])
def test_tpu_kernel_compiles_with_weights_quantized_in_hbm(chip, kind, m, k, n):
    """Mosaic accepts the kernel on v5e and v6e (fp8 included), and the compiled program's
    arguments are exactly x + the quantized weight + scales: no dequantized copy of the
    weight exists in HBM, not even as a temporary."""
    from jax.sharding import SingleDeviceSharding

    args = abstract_operands(m, k, n, kind, SingleDeviceSharding(chip))
    compiled = compile_on_chip(
        lambda x, v, s: qmm.quantized_matmul(x, v, s, kind=base(kind), impl="tpu"), args, chip)
    mem = compiled.memory_analysis()
    weight_bytes = k * n // (2 if base(kind) in ("int4", "fp4") else 1)
    scale_bytes = args[2].size * args[2].dtype.itemsize  # fp4's bf16, else float32
    assert mem.argument_size_in_bytes == m * k * 2 + weight_bytes + scale_bytes
    assert mem.output_size_in_bytes == m * n * 2
    assert mem.temp_size_in_bytes < weight_bytes // 16
    assert "tpu_custom_call" in compiled.as_text()


# GGUF files' formats (loading/gguf_blocks.py): Q4_0, Q4_1 / Q4_K, Q8_0 / IQ4_XS, Q5_1 / Q5_K,
# Q6_K, Q2_K, Q3_K.
GGUF_FORMATS = [("int4", 32, False), ("int4", 32, True), ("int8", 32, False), ("int8", 32, True),
                ("int8", 16, False), ("int4", 16, True), ("int4", 16, False)]


@pytest.mark.parametrize("kind, group, zp", GGUF_FORMATS)
def test_tpu_kernel_compiles_for_gguf_groups(chip, kind, group, zp):
    """Mosaic accepts the kernel with GGUF's small groups (16 and 32 rows: a dot per group)
    at Llama-3-8B's up projection, weights read as stored (no dequantized copy)."""
    from jax.sharding import SingleDeviceSharding

    m, k, n = LLAMA3_8B_MLP[0]
    (vs, vd), (ss, sd) = formats.quantized_shapes(k, n, kind, group, zp)
    placed = SingleDeviceSharding(chip)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=placed),
            jax.ShapeDtypeStruct(vs, vd, sharding=placed),
            jax.ShapeDtypeStruct(ss, sd, sharding=placed))
    compiled = compile_on_chip(
        lambda x, v, s: qmm.quantized_matmul(x, v, s, kind=kind, impl="tpu"), args, chip)
    weight_bytes = k * n // (2 if kind == "int4" else 1)
    assert compiled.memory_analysis().temp_size_in_bytes < weight_bytes // 16
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("kind, group, zp", [f for f in GGUF_FORMATS
                                             if gpu.supports(f[0], f[1])])
def test_gpu_kernel_lowers_to_triton_for_gguf_groups(kind, group, zp):
    """The Triton lowering takes the GGUF groups the GPU kernel supports (int4's groups of
    16 are left to the reference: half a group is 8 rows, under a dot's least block)."""
    m, k, n = LLAMA3_8B_MLP[0]
    (vs, vd), (ss, sd) = formats.quantized_shapes(k, n, kind, group, zp)
    fn = jax.jit(lambda x, v, s: gpu.quantized_matmul(x, v, s, kind=kind))
    exported = jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct(vs, vd),
      jax.ShapeDtypeStruct(ss, sd))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
    assert exported.out_avals[0].shape == (m, n)


def kernel_dot_precisions(fn, *args) -> list:
    """The precision of every dot in `fn`'s jaxpr, Pallas kernel bodies included."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)
    return [e.params["precision"] for e in walk(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_tpu_kernel_asks_for_full_float32_passes_for_float32_x(kind):
    """float32 activations take the MXU's full-precision (HIGHEST) path, as the reference
    does; bf16 activations leave the precision to Mosaic. (On a CPU the interpreter's dots
    are exact either way, so this reads the kernel body the TPU would compile.)"""
    highest = (jax.lax.Precision.HIGHEST,) * 2
    for dtype, want in ((jnp.float32, highest), (jnp.bfloat16, None)):
        (vs, vd), (ss, sd) = formats.quantized_shapes(256, 256, kind)
        args = (jax.ShapeDtypeStruct((16, 256), dtype), jax.ShapeDtypeStruct(vs, vd),
                jax.ShapeDtypeStruct(ss, sd))
        precisions = kernel_dot_precisions(
            lambda x, v, s: tpu.quantized_matmul(x, v, s, kind=kind), *args)
        assert precisions and all(p == want for p in precisions), (dtype, precisions)


def test_tpu_kernel_compiles_for_float32_x(chip):
    """Mosaic accepts the HIGHEST-precision float32 path on v5e and v6e."""
    from jax.sharding import SingleDeviceSharding

    m, k, n = LLAMA3_8B_MLP[0]
    args = abstract_operands(m, k, n, "int4", SingleDeviceSharding(chip), jnp.float32)
    compiled = compile_on_chip(
        lambda x, v, s: qmm.quantized_matmul(x, v, s, kind="int4", impl="tpu"), args, chip)
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.memory_analysis().output_size_in_bytes == m * n * 4


def test_dispatch_picks_the_tpu_kernel_under_a_tpu_default_device(chip):
    """impl=None follows the default device, as the planner's AOT compile sets it."""
    with jax.default_device(chip):
        assert qmm.current_platform() == "tpu"
        assert qmm.choose_impl("fp8", 1) == "tpu"
    assert qmm.choose_impl("fp8", 1) == "reference"
