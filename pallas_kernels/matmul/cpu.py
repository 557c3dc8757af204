"""Float matmul as a native CPU kernel (pallas_kernels/cpu/matmul.h, `jaxserve_matmul`).

Same signature and result as reference.py; `matmuls` takes several weights sharing x in
one call. The kernel takes w as stored, in either layout (no pre-packed copy), accumulates
in float32 and rounds bf16 results to nearest even. Rows at or past `num_rows` (a traced
int32 scalar) are left unwritten and cost nothing, so a batch padded to a bucket pays
for its real tokens only (zeroing them cost a 32-token prompt in the 64-token bucket
about 4% of its TTFT, benchmarks/history/2026-11-21-to-29.md).

In the C++ (all of it picks its path per call from the CPU: AVX-512 + AVX512_BF16 here,
else AVX2+FMA, else plain C++):
- Few rows (decode, a verification of drafts) are bandwidth-bound, so the weight is read
  once, in memory order. A [K, N] weight (M <= 6) is split by rows of K over the threads
  (two parts each), every part streaming its rows four at a time across all N columns
  into its own float32 partial sums, added at the end; bf16 rows are paired in registers
  (vpunpck{l,h}wd) so one vdpbf16ps multiplies two rows of w by a broadcast pair of x. An
  [N, K] weight (M <= 24; the engine's layout on one CPU device) is dot products, one
  weight row after the other (1 x 16, 2 x 8 or 4 x 4 tiles), every row of x against each
  tile of weight rows while it is in L1.
- More rows are compute-bound: a task takes a 64-column strip of w and a block of up to
  128 rows, copies the strip once into a panel laid out for the micro-kernel (bf16: each
  pair of K rows interleaved into 32-bit pairs; an [N, K] weight transposed), and runs
  6 x 64 register tiles (24 accumulators) of vdpbf16ps / FMAs over its rows. f32 [K, N]
  strips are read in place.
- An [N, K] weight packed at load (`packed_w`, packed.py: its strips stored as those
  panels; the engine's layout on one CPU device with these instruction sets) runs the
  panel tiles in place for every row count: no copy per call; few rows prefetch their own
  strip ahead, one run of whole strips per thread, the strips left over split by K.
- Without those instruction sets (AVX2+FMA), [N, K] weights on the real rows: 1 to 8 rows
  (3-8 while they fit in 24 KiB of L1) are dot products in 8-lane FMAs, each weight row
  read once (bf16 x converted to float32 first; one row reads a task's block of weight
  rows as 8 (bf16) or 4 (f32) streams side by side); more rows pack 16 weight rows at a
  time into a float32 panel [K][16] (transposed, bf16 widened once; each panel once per
  call) and run 6 x 16 register tiles (12 accumulators, an element of x broadcast) over
  every row of x against it, in blocks of 48 rows, K in slices of 256 that stay in L1
  (float32 with K up to 256: the tiles written straight into y).
  [K, N] weights are generic loops, which is why `faster_than_xla` sends those to XLA's
  dot.
The weight is never required in a packed layout: without `packed_w`, any packing is per
call, per strip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu as native

TARGET = "jaxserve_matmul"
DTYPES = ("float32", "bfloat16")


# Below these instruction-set levels the kernel runs AVX2 paths for [N, K] weights (1-8 rows
# stream each weight row once; more rows run packed panels) on the real rows only,
# while XLA's dot computes every row of the bucket. Measured on a 2-core AVX2 EPYC (no
# AVX-512), smollm2-135m's [N, K] weights, ms per matmul (native / XLA's dot): bf16 M = 1:
# 0.09-0.10 / 1.5-1.6 (XLA reads bf16 matrix-vector products at ~4% of bandwidth), 8 rows:
# 0.25-0.39 / 0.57-0.70, 32 real rows of 64: 0.61-0.75 / 1.2-1.8, 128 of 512: 2.5-2.9 /
# 5.6-6.9, 512 of 512: 8.6-10 / 5.5-8.3; f32 M = 1: 0.17-0.19 / 0.13-0.15 (so XLA's), 8
# rows: 0.29 / 0.28-0.49, 32 real rows of 64: 0.50-0.69 / 1.1-1.3, 512 of 512: 6.5-7.9 /
# 6.4-10. XLA was faster only for a single float32 row and, by 10-50%, for a full bucket;
# since 2026-11-26 one row reads 4-8 streams of weight rows at once (a model's worth of f32
# matrix-vector products 15.9-20.8 ms against XLA's 19.3; packed panels for more rows:
# 0.88-1.5x XLA on a full bucket), so every [N, K] matmul goes native with AVX2.
# Below AVX2, and for [K, N] weights, the kernel's generic loops (1/3 of the bandwidth at
# 1-2 bf16 rows, 5-17x slower than XLA's dot past them) keep only bf16 with 1-2 rows.
TUNED_ISA = {"float32": "avx512", "bfloat16": "avx512_bf16"}
NATIVE_ROWS_BELOW_AVX2 = {"float32": 0, "bfloat16": 2}


def faster_than_xla(x: jax.Array, transpose_w: bool = False) -> bool:
    """Whether the default dispatch should take the kernel for x's dtype and rows on this
    CPU (measured above): always with its AVX-512 paths; with AVX2, for [N, K] weights;
    else (generic loops) only bf16 with 1-2 rows."""
    level, dtype = native.isa(), x.dtype.name
    if level is None or dtype not in TUNED_ISA:
        return False
    if native.ISA_LEVELS[level] >= native.ISA_LEVELS[TUNED_ISA[dtype]]:
        return True
    if transpose_w and native.ISA_LEVELS[level] >= native.ISA_LEVELS["avx2"]:
        return True
    return x.shape[0] <= NATIVE_ROWS_BELOW_AVX2[dtype]


def supports(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> bool:
    """Whether the kernel takes these operands: 2-D, one dtype (float32 or bfloat16),
    matching inner dimensions."""
    return (x.ndim == 2 and w.ndim == 2 and x.dtype == w.dtype and x.dtype.name in DTYPES
            and x.shape[1] == w.shape[1 if transpose_w else 0])


def matmul(x: jax.Array, w: jax.Array, num_rows: jax.Array | int | None = None, *,
           transpose_w: bool = False, packed_w: bool = False) -> jax.Array:
    """See reference.matmul; raises if the native kernels are unavailable or the operands
    are not ones it takes (`supports`). `packed_w`: w is `[N, K]` in packed.py's layout."""
    return matmuls(x, [w], num_rows, transpose_w=transpose_w, packed_w=packed_w)[0]


def matmuls(x: jax.Array, ws: list[jax.Array], num_rows: jax.Array | int | None = None, *,
            transpose_w: bool = False, packed_w: bool = False) -> list[jax.Array]:
    """`[matmul(x, w) for w in ws]` in one kernel call: with few rows the weights are
    streamed together, so the threads split their bytes once instead of once each."""
    if not native.available():
        raise RuntimeError(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    for w in ws:
        if not supports(x, w, transpose_w):
            raise ValueError(
                f"cpu matmul: needs 2-D float32 or bfloat16 operands of one dtype and "
                f"matching K, got x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)} "
                f"(transpose_w={transpose_w})")
    rows = jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32).reshape(())
    shapes = [jax.ShapeDtypeStruct((x.shape[0], w.shape[0] if transpose_w else w.shape[1]),
                                   x.dtype) for w in ws]
    call = jax.ffi.ffi_call(TARGET, shapes)
    return list(call(x, rows, *ws, transpose_w=bool(transpose_w) or packed_w,
                     packed_w=bool(packed_w)))
