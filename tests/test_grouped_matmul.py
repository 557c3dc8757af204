"""Grouped matmul (the experts' projections): the reference and the CPU loop against a
numpy loop over the groups in float64, the Pallas TPU and GPU kernels (interpret mode)
against the reference, for float and quantized stacks, with empty groups, one group
taking every row, group sizes that are not multiples of the blocks, and rows past the
last group; the TPU kernel compiled ahead of time for v5e and v6e at Mixtral's shapes,
the GPU kernel lowered to Triton.

Tolerances: float32 everywhere. All paths compute exact f32 products of the same f32
(dequantized) weights and differ only in summation order: 1e-5 of max |y| (the quantized
matmul's tests derive the same bound).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import kernel_interpret
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.grouped_matmul import cpu, formats, tpu
from pallas_kernels.grouped_matmul.visits import num_visits, plan_visits

# Group sizes over 4 groups: random-ish, empty groups, one group takes every row, a row
# tile shared by three groups, all empty; each with 3 rows past the last group.
SIZES = {"mixed": [5, 0, 19, 9], "one group takes all": [0, 0, 37, 0],
         "small groups": [1, 2, 3, 1], "all empty": [0, 0, 0, 0]}
# Float, the three kinds, and the checkpoints' variants: "-g" group scales, "-zp" groups
# with zero points (AWQ / GPTQ / compressed-tensors experts), and GGUF's small groups
# (a number: rows per group; Q4_K's int4 in 32s with zero points, Q6_K's int8 in 16s);
# fp4 in MXFP4's groups of 32 (gpt-oss's experts).
KINDS = [None, "int8", "int4", "fp8", "int8-g", "int4-zp", "int8-zp", "int4-zp32", "int8-g16",
         "fp4"]


def base(kind):
    return kind and kind.split("-")[0]


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def draw(rng, sizes, k: int, n: int, kind, group_size: int = 64):
    m = sum(sizes) + 3
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    w = rng.standard_normal((len(sizes), k, n), dtype=np.float32)
    if kind is None:
        return x, jnp.asarray(w), None, jnp.asarray(sizes, jnp.int32)
    zp = "zp" in kind
    if zp:  # off zero, so that the zero points differ from group to group
        w += rng.uniform(-2, 2, size=(len(sizes), 1, n)).astype(np.float32)
    digits = kind.partition("-")[2].lstrip("gzp")  # "int4-zp32" -> "32"
    group = (int(digits) if digits else
             group_size if kind.startswith("int4") or "-" in kind else None)
    values, scales = formats.quantize(jnp.asarray(w), base(kind), group, zero_points=zp)
    return x, values, scales, jnp.asarray(sizes, jnp.int32)


def numpy_grouped(x, values, scales, sizes, kind) -> np.ndarray:
    """A loop over the groups in float64: each group's rows times its dequantized weight."""
    w = np.asarray(formats.dequantize(values, scales, base(kind)), np.float64)
    x = np.asarray(x, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, size in enumerate(np.asarray(sizes)):
        out[start:start + size] = x[start:start + size] @ w[g]
        start += size
    return out


def assert_close(y, want):
    y = np.asarray(y, np.float64)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * max(np.abs(want).max(), 1.0))


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_plain_jax_paths_against_a_numpy_loop(rng, impl, kind):
    for name, sizes in SIZES.items():
        x, values, scales, gs = draw(rng, sizes, 128, 96, kind)
        y = gm.grouped_matmul(x, values, gs, scales, kind=base(kind), impl=impl, block_m=8)
        assert y.shape == (x.shape[0], 96) and y.dtype == jnp.float32
        assert_close(y, numpy_grouped(x, values, scales, gs, kind))
        assert not np.asarray(y[sum(sizes):]).any(), f"{name}: rows past the groups"


# Small explicit blocks: several row tiles, N and K blocks, int4 groups of 64 (two per K
# block); K = 384 and N = 200 are not multiples of the blocks (padded).
BLOCKS = {"tpu": dict(block_m=16, block_n=128, block_k=256),
          "gpu": dict(block_m=16, block_n=64, block_k=128)}


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_kernels_match_the_reference(rng, impl, kind):
    for name, sizes in SIZES.items():
        x, values, scales, gs = draw(rng, sizes, 384, 200, kind)
        y = gm.grouped_matmul(x, values, gs, scales, kind=base(kind), impl=impl,
                              interpret=kernel_interpret(impl), **BLOCKS[impl])
        ref = gm.grouped_matmul(x, values, gs, scales, kind=base(kind), impl="reference")
        assert y.shape == ref.shape, name
        assert_close(y, np.asarray(ref, np.float64))


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernels_with_default_blocks_and_bf16(rng, impl):
    """The blocks the kernels pick themselves, bfloat16 rows and weights, one group past
    the end of a tile: within bf16's rounding of the output (2^-8 |y|) plus f32 sums."""
    sizes = [3, 0, 30, 1]
    x, w, _, gs = draw(rng, sizes, 256, 200, None)  # TPU: N = 200 as one whole block
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    y = gm.grouped_matmul(x, w, gs, impl=impl, interpret=kernel_interpret(impl))
    want = numpy_grouped(x.astype(jnp.float32), w, None, gs, None)
    sigma = numpy_grouped(jnp.abs(x.astype(jnp.float32)), jnp.abs(w), None, gs, None)
    err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - want)
    assert y.dtype == jnp.bfloat16
    assert np.all(err <= 2.0**-8 * np.abs(want) + 2.0**-14 * sigma), err.max()


def test_visit_plan():
    """Every (group, tile) pair with rows is visited once, in order; the rest repeat."""
    sizes = np.array([5, 0, 19, 9, 0, 1])
    m, bm = 40, 8
    plan = jax.tree.map(np.asarray, plan_visits(jnp.asarray(sizes), m, bm))
    ends = np.cumsum(sizes)
    want = [(g, t) for g, (s, e) in enumerate(zip(ends - sizes, ends)) if e > s
            for t in range(s // bm, (e - 1) // bm + 1)]
    active = int(plan.active[0])
    assert list(zip(plan.group[:active], plan.tile[:active])) == want
    assert len(plan.group) == num_visits(m, len(sizes), bm) == 5 + 5
    assert (plan.group[active:] == want[-1][0]).all() and (plan.tile[active:] == want[-1][1]).all()
    np.testing.assert_array_equal(plan.offsets, np.concatenate([[0], ends]))


def test_dispatch_and_bad_operands(rng):
    x, values, scales, gs = draw(rng, [2, 2], 128, 128, "int8")
    with jax.default_device(jax.devices("cpu")[0]):  # a GPU host's CPU device too
        assert gm.choose_impl("int8") == "cpu" and gm.choose_impl(None) == "cpu"
    with pytest.raises(ValueError, match="explicit impl"):
        gm.grouped_matmul(x, values, gs, scales, kind="int8", interpret=True)
    with pytest.raises(ValueError, match="unknown impl"):
        gm.grouped_matmul(x, values, gs, scales, kind="int8", impl="cuda")
    with pytest.raises(ValueError, match="scales"):
        gm.grouped_matmul(x, values, gs, kind="int8")
    with pytest.raises(ValueError, match="group_sizes"):
        gm.grouped_matmul(x, values.astype(jnp.float32), gs[:1])


def test_block_rules():
    # TPU blocks take a whole dimension up to 512 (a quarter of Qwen3-30B-A3B's 768-wide
    # experts: 192, not padded to 256), else divide it: 768 -> 384, not 512 padded to 1024.
    assert tpu.block_sizes(16, 2048, 768, None, 1, jnp.bfloat16) == (16, 384, 512)
    assert tpu.block_sizes(16, 2048, 192, None, 1, jnp.bfloat16) == (16, 192, 512)
    assert tpu.block_sizes(16, 192, 2048, "int8", 1, jnp.bfloat16) == (16, 512, 192)
    assert tpu.block_sizes(300, 4096, 14336, "int8", 1, jnp.bfloat16) == (128, 512, 512)
    assert tpu.block_sizes(8, 768, 2048, "int4", 128, jnp.bfloat16) == (16, 512, 768)
    # CPU: tiles of about the mean group's rows.
    assert cpu.block_m_for(2, 8) == 8 and cpu.block_m_for(128, 128) == 8
    assert cpu.block_m_for(4096, 128) == 32 and cpu.block_m_for(4096, 8) == 128


# --- the GPU kernel lowers to Triton, the TPU kernel compiles (no accelerator needed) ------

MIXTRAL_UP = (2, 8, 4096, 14336)  # 1 decode token x top-2 rows, 8 experts, [4096, 14336]


def abstract(m, g, k, n, kind, sharding=None):
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sharding)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32, sharding=sharding)
    if kind is None:
        return x, jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=sharding), sizes, None
    digits = kind.partition("-")[2].lstrip("gzp")  # "int4-zp32": GGUF's groups of 32
    (vs, vd), (ss, sd) = formats.quantized_shapes(
        g, k, n, base(kind), int(digits) if digits else 128 if "-" in kind else None,
        zero_points="zp" in kind)
    return (x, jax.ShapeDtypeStruct(vs, vd, sharding=sharding), sizes,
            jax.ShapeDtypeStruct(ss, sd, sharding=sharding))


@pytest.mark.parametrize("kind", ["int8", "int4", "int4-zp", "int8-zp", "int4-zp32", "int8-g16",
                                  "fp4", None], ids=str)
def test_gpu_kernel_lowers_to_triton_for_mixtral(kind):
    from pallas_kernels.grouped_matmul import gpu

    fn = jax.jit(lambda x, v, s, sc: gpu.grouped_matmul(x, v, s, sc, kind=base(kind)))
    exported = jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*abstract(*MIXTRAL_UP, kind))
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1
    # One program per (visit, 128 columns): 1 row tile + 7 group boundaries.
    assert f"grid_x = {num_visits(2, 8, 16)} : i32" in text
    assert f"grid_y = {14336 // 128} : i32" in text


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8", "int4-zp", "int8-zp", "int4-zp32",
                                  "int8-g16", "fp4", None], ids=str)
def test_tpu_kernel_compiles_with_the_stack_quantized_in_hbm(chip, kind):
    """Mosaic accepts the kernel on v5e and v6e at Mixtral's shapes, and the program's
    arguments are x, the stack as stored and its scales: no dequantized copy of an
    expert, not even as a temporary."""
    from jax.sharding import SingleDeviceSharding

    m, g, k, n = MIXTRAL_UP
    args = abstract(m, g, k, n, kind, SingleDeviceSharding(chip))
    with jax.default_device(chip):
        assert gm.choose_impl(base(kind), 128) == "tpu"
        compiled = jax.jit(lambda x, v, s, sc: gm.grouped_matmul(x, v, s, sc, kind=base(kind))
                           ).lower(*args).compile()
    mem = compiled.memory_analysis()
    stack = g * k * n * {None: 2, "int8": 1, "fp8": 1, "int4": 0.5, "fp4": 0.5}[base(kind)]
    scales = 0 if kind is None else args[3].size * args[3].dtype.itemsize  # fp4's: bf16
    # group_sizes (int32[8]) takes one 512-byte tile on the chip.
    assert mem.argument_size_in_bytes == m * k * 2 + stack + scales + 512
    assert mem.temp_size_in_bytes < k * n // 16  # less than a 16th of ONE expert
    assert "tpu_custom_call" in compiled.as_text()


GPT_OSS_20B_EXPERT = (16, 32, 2880, 2880)  # 4 decode tokens x top-4 rows, 32 experts


def test_tpu_kernel_compiles_for_gpt_oss_mxfp4_experts(chip):
    """gpt-oss-20b's expert stack as its checkpoint holds it (MXFP4: fp4 in groups of 32;
    K = N = 2880, no multiple of 128): Mosaic compiles the kernel with the stack an
    argument as stored, half a byte a weight and a bf16 scale per 32 (4.5 bits), read in
    place with ragged edge blocks: no padded copy of it (~150 MB a call when it was).
    (120b's 128 experts: XLA's default TPU layout for that stack puts the experts minor,
    and the kernel's operand is copied into row-major order every call; not yet mended.)"""
    from jax.sharding import SingleDeviceSharding

    m, g, k, n = GPT_OSS_20B_EXPERT
    args = abstract(m, g, k, n, "fp4", SingleDeviceSharding(chip))
    assert args[3].shape == (g, k // 32, n) and args[3].dtype == jnp.bfloat16
    with jax.default_device(chip):
        compiled = jax.jit(lambda x, v, s, sc: gm.grouped_matmul(x, v, s, sc, kind="fp4")
                           ).lower(*args).compile()
    mem = compiled.memory_analysis()
    # 4.5 bits a weight, plus the tiles' padding of 2880 columns to 2944 (2.2%).
    stored = m * k * 2 + g * k * n * 4.5 / 8 + 512
    assert stored <= mem.argument_size_in_bytes <= stored * 2944 / 2880
    assert mem.temp_size_in_bytes < k * n // 16
    assert "tpu_custom_call" in compiled.as_text()


RAGGED_BLOCKS = {"tpu": dict(block_n=128, block_k=512), "gpu": dict(block_n=64, block_k=512)}


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("kind", [None, "int8", "fp8", "int4-zp32", "int8-zp", "fp4"], ids=str)
def test_kernels_read_ragged_edges_in_place(rng, impl, kind):
    """K = 640 and N = 320 under 512-row K blocks: the last K block runs 384 rows past
    the stack and the last N block past its columns. The stack is read in place (not
    padded): what lies past it (NaN in interpret mode, ints at their minimum) must not
    reach the output: the TPU kernel zeroes the rows past K and their groups' scales, the
    GPU kernel's loads are masked."""
    from pallas_kernels.grouped_matmul import tpu

    x, values, scales, gs = draw(rng, SIZES["mixed"], 640, 320, kind, group_size=32)
    group, is_grouped, _ = formats.layout(base(kind), 640, scales)
    assert tpu.reads_ragged(values, scales, base(kind), 640, 512, group, is_grouped)
    y = gm.grouped_matmul(x, values, gs, scales, kind=base(kind), impl=impl,
                          interpret=kernel_interpret(impl), **RAGGED_BLOCKS[impl])
    ref = gm.grouped_matmul(x, values, gs, scales, kind=base(kind), impl="reference")
    assert np.isfinite(np.asarray(y)).all()
    assert_close(y, np.asarray(ref, np.float64))


def test_gpu_kernel_lowers_for_gpt_oss_mxfp4_experts_unpadded():
    """The Triton lowering takes gpt-oss-20b's fp4 expert stack (K = N = 2880, no power
    of two) as it is: the kernel's operand is the stored `u8[32, 1440, 2880]` (masked
    loads at the edges), not a padded copy."""
    from pallas_kernels.grouped_matmul import gpu

    fn = jax.jit(lambda x, v, s, sc: gpu.grouped_matmul(x, v, s, sc, kind="fp4"))
    exported = jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*abstract(*GPT_OSS_20B_EXPERT, "fp4"))
    text = exported.mlir_module()
    call = next(line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line)
    assert "tensor<32x1440x2880xui8>" in call and "tensor<32x90x2880xbf16>" in call
    assert "1440x2944" not in text and "1472x" not in text  # no padded stack anywhere
