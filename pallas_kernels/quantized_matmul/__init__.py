"""Weight-only quantized matmul (W8A16, W4A16, W8A16-fp8): `y[M, N] = x[M, K] @ w[K, N]`.

Weight formats (K = in-features, N = out-features; scales float32 but fp4's; symmetric
unless they carry zero points):

- "int8": values int8 `[K, N]`; scales `[K // G, N]` = max|w| over the group / 127, with
  G = K by default (one scale per output channel, `[1, N]`) or G = min(group_size, K)
  (K % G == 0: GPTQ 8-bit, compressed-tensors' int8 groups, GGUF's Q8_0 with G = 32). An
  all-zero column (or group) gets scale 1.
- "int4": group-wise along K with G = min(group_size, K) rows per group (default 128;
  K % G == 0, G even). values uint8 `[K // 2, N]`, two signed 4-bit two's-complement
  values per byte (range [-8, 7], quantize produces [-7, 7]); scales `[K // G, N]` =
  max|w| over the group / 7. Packing: within each group of G rows, byte row j
  (0 <= j < G/2) of that group holds row j in the LOW nibble and row j + G/2 in the HIGH
  nibble, so a kernel unpacks a group into two contiguous halves without interleaving.
- Zero points (int8 and int4; asymmetric checkpoints: AWQ, GPTQ, compressed-tensors):
  scales are `[2, K // G, N]`: `[0]` the group scales, `[1]` the group zero points z
  (float32, integers in the values' range as checkpoints store them, offset like the
  values), and w = (q - z) * scale. A checkpoint's unsigned b-bit value u with zero point
  u0 is q = u - 2^(b-1), z = u0 - 2^(b-1): the same integers minus the same offset, so
  nothing rounds.
- "fp8": values float8_e4m3fn `[K, N]`, scales `[1, N]` = max|w| over K / 448, or
  `[K // G, N]` by groups of rows (block-wise FP8 checkpoints: each block's scale repeated
  over its columns).
- "fp4": MXFP4 (OCP microscaling; gpt-oss's experts): values uint8 `[K // 2, N]` packed
  as int4's (a group's first half in the low nibbles), each nibble an e2m1 code (sign,
  2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives);
  scales bfloat16 `[K // G, N]`, powers of two 2^(floor(log2 max|w|) - 2) (a checkpoint's
  e8m0 exponents, exact in bf16), G = 32 by default; 4.5 bits a weight (the file's 4.25).
  The scales' dtype tells fp4 from int4 (formats.kind_of).

formats.py quantizes, packs, dequantizes, checks and pads them.

Implementations, all with the signature of `reference.quantized_matmul`:

- "reference" (reference.py): dequantize to x's dtype, one XLA dot accumulating in
  float32. The truth, and the CPU path.
- "tpu" (tpu.py): Pallas Mosaic kernel, grid (M, N, K blocks), f32 VMEM accumulator.
  Compiles ahead of time for v5e and v6e for every kind: Mosaic accepts the
  float8_e4m3fn -> f32 conversion on both, though neither has fp8 arithmetic (the
  kernel never asks for any: fp8 is a storage format here, as the others are).
- "cpu" (cpu.py): the native CPU kernel, int8, int4 and fp4, the weight read as stored
  and converted in registers; the reference for anything else (fp8).
- "gpu" (gpu.py): Pallas Triton kernel, grid (M, N blocks), K loop in a fori_loop. fp8
  needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper) for the conversion (Pallas
  refuses it below); groups must be powers of two (int4 / fp4 >= 32, int8 / fp8 >= 16).
  Where either fails, `impl=None` uses the reference instead (XLA converts fp8 on any GPU).

`impl=None` picks by platform: the default device's if one is set (as when compiling
ahead of time under `jax.default_device(tpu_device)`), else `jax.default_backend()`; on a
CPU the native kernel where it applies, else the reference.

Block sizes (override with block_m / block_n / block_k), from the shapes only:
- TPU: bm = min(round_up(M, 8 for f32 / 16 for bf16), 256); bn = min(round_up(N, 128),
  512); bk = min(round_up(K, u), max(u, L rounded down to a multiple of u)) with
  L = 512 for 8-bit or 1024 for int4 / fp4 (256 KiB of weight per 512 columns per step) and
  u = lcm(128, G) for grouped weights, else 128.
- GPU: powers of two; bm = clamp(next_pow2(M), 16, 64); bn = clamp(next_pow2(N), 16, 128);
  bk = clamp(next_pow2(K), 16, 128), at least G for grouped weights.
Both pad operands to whole blocks (K by whole groups) and slice the result.
"""

from __future__ import annotations

import jax

from pallas_kernels.platform import GPU_PLATFORMS, current_platform
from pallas_kernels.quantized_matmul import cpu, gpu, reference, tpu
from pallas_kernels.quantized_matmul.formats import (
    check_operands, dequantize, kernel_group, pack_strips, packable, quantize, quantized_shapes,
    unpack_strips)

IMPLS = ("reference", "cpu", "tpu", "gpu")
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)


def gpu_converts_fp8(compute_capability: str) -> bool:
    """Whether Pallas's Triton lowering converts float8_e4m3fn on a GPU reporting this
    compute capability: CUDA "major.minor" >= 8.9 (Ada, Hopper and later). ROCm reports
    gfx names, whose fp8 support this does not try to judge: the reference runs there."""
    major, _, minor = str(compute_capability).partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return False
    return (int(major), int(minor)) >= FP8_MIN_COMPUTE_CAPABILITY


def _default_device() -> jax.Device:
    dev = jax.config.jax_default_device
    return jax.devices()[0] if dev is None or isinstance(dev, str) else dev


def choose_impl(kind: str, group: int) -> str:
    """The implementation impl=None runs for this format on the current platform."""
    platform = current_platform()
    if platform == "tpu":
        return "tpu"
    if platform not in GPU_PLATFORMS or not gpu.supports(kind, group):
        return "reference"
    if kind == "fp8":
        cc = getattr(_default_device(), "compute_capability", "")
        return "gpu" if gpu_converts_fp8(cc) else "reference"
    return "gpu"


def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, kind: str,
                     impl: str | None = None, interpret: bool = False,
                     rows: jax.Array | None = None, packed: bool = False,
                     **block_sizes: int) -> jax.Array:
    """`x[M, K] @ dequantize(values, scales)` -> `[M, N]` in x's dtype.

    impl: "reference", "cpu", "tpu", "gpu", or None to pick by platform (module doc).
    rows: the real rows (a traced int32 scalar) of a bucket-padded x; the native CPU kernel
      leaves the others unwritten, every other implementation computes them.
    interpret: run a Pallas kernel in interpret mode (CPU tests); needs an explicit impl,
      since "whichever kernel this platform runs" is the reference on a CPU.
    packed: values and scales in the native CPU kernel's layout (formats.pack_strips; only
      where that kernel runs, one CPU device); the other implementations unpack them first.
    block_sizes: block_m / block_n / block_k for the kernels (the reference ignores them).
    """
    k = check_operands(x, values, scales, kind)
    if impl is None:
        if interpret:
            raise ValueError("interpret=True needs an explicit impl ('tpu' or 'gpu')")
        impl = choose_impl(kind, kernel_group(kind, k, scales))
        if impl == "reference" and current_platform() == "cpu" and cpu.supports(x, kind):
            impl = "cpu"
    if impl == "cpu":
        return cpu.quantized_matmul(x, values, scales, kind=kind, rows=rows, packed=packed)
    if packed:
        values, scales = unpack_strips(values), unpack_strips(scales)
    if impl == "reference":
        return reference.quantized_matmul(x, values, scales, kind=kind)
    if impl == "tpu":
        return tpu.quantized_matmul(x, values, scales, kind=kind, interpret=interpret,
                                    **block_sizes)
    if impl == "gpu":
        return gpu.quantized_matmul(x, values, scales, kind=kind, interpret=interpret,
                                    **block_sizes)
    raise ValueError(f"unknown impl {impl!r}: use one of {', '.join(IMPLS)} or None")


__all__ = ["quantized_matmul", "quantize", "dequantize", "quantized_shapes", "choose_impl",
           "current_platform", "gpu_converts_fp8", "pack_strips", "packable", "unpack_strips"]
