"""Grouped matmul: `y[i] = x[i] @ w[g(i)]`, the experts' projections of a mixture of
experts. x `[M, K]` holds rows sorted by group (group g: the `group_sizes[g]` rows after
groups 0..g-1); w is a stack `[G, K, N]`, float or quantized per group (formats.py: the
int8 / int4 / fp8 / fp4 formats of pallas_kernels/quantized_matmul, with scales
`[G, ., N]`).
Rows past the last group come out as zeros (as `jax.lax.ragged_dot` gives). An empty
group costs nothing: no kernel reads its weight.

Implementations, one signature:
- "reference" (reference.py): `jax.lax.ragged_dot` over the dequantized stack. The truth.
- "cpu" (cpu.py): a loop in plain JAX over the (group, row tile) visits of visits.py,
  reading only the groups with rows. XLA:CPU's ragged_dot multiplies every row by every
  group (26 ms for 2 rows x 8 groups of [1024, 2816] f32 where this takes 2.6 ms).
- "tpu" (tpu.py): Pallas Mosaic kernel, grid (N blocks, visits, K blocks), the visit plan
  in SMEM (scalar prefetch) choosing each step's x tile and weight block.
- "gpu" (gpu.py): Pallas Triton kernel, one program per (visit, N block), masked stores.
  fp8 needs compute capability >= 8.9 and groups powers of two (int4 / fp4 >= 32, 8-bit
  >= 16), as the quantized matmul's kernel does; where either fails impl=None uses "cpu"'s
  loop (plain JAX, which XLA:GPU compiles too).

`impl=None` picks by platform (the default device's if one is set, as when compiling
ahead of time for a TPU): "tpu" on a TPU, "gpu" on a GPU where the format allows, else
"cpu".
"""

from __future__ import annotations

import jax

from pallas_kernels.grouped_matmul import cpu, formats, gpu, reference, tpu
from pallas_kernels.grouped_matmul.formats import dequantize, quantize, quantized_shapes
from pallas_kernels.platform import GPU_PLATFORMS, current_platform
from pallas_kernels.quantized_matmul import choose_impl as choose_quantized_impl

IMPLS = ("reference", "cpu", "tpu", "gpu")
_MODULES = {"reference": reference, "cpu": cpu, "tpu": tpu, "gpu": gpu}


def choose_impl(kind: str | None, group: int = 1) -> str:
    """The implementation impl=None runs for this weight format on the current platform."""
    platform = current_platform()
    if platform == "tpu":
        return "tpu"
    if platform in GPU_PLATFORMS and (kind is None or choose_quantized_impl(kind, group) == "gpu"):
        return "gpu"
    return "cpu"


def grouped_matmul(x: jax.Array, values: jax.Array, group_sizes: jax.Array,
                   scales: jax.Array | None = None, *, kind: str | None = None,
                   impl: str | None = None, interpret: bool = False,
                   **block_sizes: int) -> jax.Array:
    """`x[M, K]` (rows sorted by group) times the stack `values[G, K, N]` (with `scales`
    and `kind` when quantized) -> `[M, N]` in x's dtype.

    impl: one of IMPLS, or None to pick by platform (see the module doc).
    interpret: run a Pallas kernel in interpret mode (CPU tests); needs impl "tpu" or "gpu".
    block_sizes: block_m / block_n / block_k for the kernels (cpu takes block_m only).
    """
    k = formats.check_operands(x, values, scales, group_sizes, kind)
    if impl is None:
        if interpret:
            raise ValueError("interpret=True needs an explicit impl ('tpu' or 'gpu')")
        impl = choose_impl(kind, formats.layout(kind, k, scales)[0])
    if impl not in _MODULES:
        raise ValueError(f"unknown impl {impl!r}: use one of {', '.join(IMPLS)} or None")
    options = dict(block_sizes, interpret=interpret) if impl in ("tpu", "gpu") else block_sizes
    return _MODULES[impl].grouped_matmul(x, values, group_sizes, scales, kind=kind, **options)


__all__ = ["grouped_matmul", "quantize", "dequantize", "quantized_shapes", "choose_impl"]
