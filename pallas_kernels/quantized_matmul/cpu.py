"""Weight-only quantized matmul as a native CPU kernel (pallas_kernels/cpu/quantized.h,
`jaxserve_quantized_matmul`): decode steps, draft verifications and prefill chunks.

A CPU decode step is bound by the bytes of weight it reads; the kernel reads them as stored
(int8, or int4 / fp4 two per byte; fp4's e2m1 codes through a table in registers) and
converts them in registers, where the reference
dequantizes the whole weight to x's dtype in memory first (3x slower than float weights
at batch 1: benchmarks/RESULTS.md). Past two rows it dequantizes a panel of the weight in
L1 at a time and runs the rows over it in blocks of 64, compute-bound like the float
matmul. int8, int4 (any even group, zero points too) and fp4 (its bf16 scales read as
stored, widened in registers); fp8 takes the reference. Rows at
or past `rows` (the batch's real tokens) are left unwritten and cost nothing, as in the
float kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu as native
from pallas_kernels.quantized_matmul import reference
from pallas_kernels.quantized_matmul.formats import unpack_strips

TARGET = "jaxserve_quantized_matmul"
KINDS = ("int8", "int4", "fp4")
DTYPES = ("float32", "bfloat16")


def supports(x: jax.Array, kind: str) -> bool:
    """Whether the kernel takes this call (its kinds and dtypes) here."""
    return kind in KINDS and x.dtype.name in DTYPES and native.available()


def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, kind: str,
                     rows: jax.Array | None = None, packed: bool = False,
                     expert: jax.Array | None = None, **unused_kernel_options) -> jax.Array:
    """`x[M, K] @ dequantize(values, scales)` -> `[M, N]` in x's dtype; the reference where
    the kernel does not apply (`supports`). `packed`: values and scales in
    formats.pack_strips' layout (the reference unpacks them). `expert`: values and scales
    are stacks of experts' weights (`[E, ...]`, not packed) and this one is multiplied,
    read in the stack where it lies (no copy of it)."""
    if not supports(x, kind):
        if expert is not None:
            values, scales = values[expert], scales[expert]
        if packed:
            values, scales = unpack_strips(values), unpack_strips(scales)
        return reference.quantized_matmul(x, values, scales, kind=kind)
    rows = jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32).reshape(())
    expert = jnp.asarray(0 if expert is None else expert, jnp.int32).reshape(())
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], values.shape[-1]),
                                                         x.dtype))
    # fp4's bf16 scales go as stored: the kernel widens them as it reads them (a float32
    # copy made every call cost a write and a read of twice their bytes: 1 bit a weight).
    scales = scales if kind == "fp4" else scales.astype(jnp.float32)
    return call(x, rows, expert, values, scales, packed=bool(packed), fp4=kind == "fp4")


__all__ = ["quantized_matmul", "supports"]
