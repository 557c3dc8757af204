"""Float matmul (f32 or bf16 weights as stored): `y[M, N] = x[M, K] @ w`.

w is `[K, N]` (the model's layout: `jnp.tensordot(x, w, n_in)` with w flattened to 2-D)
or, with `transpose_w`, `[N, K]` (a tied embedding as LM head; every float weight of the
engine on one CPU device, where the native kernel reads that layout faster). `num_rows`
(an int32 scalar, traced) says how many leading rows of x are real; the rest of the
result means nothing (the reference writes zeros there, the native kernel leaves those
rows unwritten). Output in x's dtype, float32 accumulation.

Implementations, one signature:
- "reference" (reference.py): one XLA dot (HIGHEST precision). The truth, and the path
  on TPU and GPU, where XLA's dot is already the fast one.
- "cpu" (cpu.py): the native kernel of pallas_kernels/cpu (XLA:CPU runs bf16 matrix-vector
  products at ~2 GB/s; the kernel streams weights at the memory bandwidth). With
  `packed_w`, w is `[N, K]` packed at load (packed.py) for the kernel's AVX-512 panels;
  the reference unpacks it.

`impl=None` picks "cpu" when the platform is CPU and the native kernels are available
(`pallas_kernels.cpu.available()`), the operands are ones it takes and the kernel beats
XLA's dot for them on this CPU (`cpu.faster_than_xla`: with AVX-512 / AVX512_BF16 always,
with AVX2 for [N, K] weights, else only bf16 with 1 or 2 rows), else
"reference".
"""

from __future__ import annotations

import jax

from pallas_kernels import cpu as native
from pallas_kernels.matmul import cpu, packed, reference
from pallas_kernels.platform import current_platform

IMPLS = ("reference", "cpu")


def default_impl(platform: str | None = None) -> str:
    """The implementation for a platform name (default: where a jitted call lands now)."""
    platform = platform or current_platform()
    return "cpu" if platform == "cpu" and native.available() else "reference"


def matmul(x: jax.Array, w: jax.Array, num_rows: jax.Array | int | None = None, *,
           transpose_w: bool = False, packed_w: bool = False,
           impl: str | None = None) -> jax.Array:
    """`x @ w` (`x @ w.T` with transpose_w or packed_w: w `[N, K]`, packed by
    packed.pack) -> `[M, N]` in x's dtype; rows >= num_rows mean nothing. impl: one of IMPLS,
    or None to pick (see the module doc)."""
    return matmuls(x, [w], num_rows, transpose_w=transpose_w, packed_w=packed_w, impl=impl)[0]


def matmuls(x: jax.Array, ws: list[jax.Array], num_rows: jax.Array | int | None = None, *,
            transpose_w: bool = False, packed_w: bool = False,
            impl: str | None = None) -> list[jax.Array]:
    """`[matmul(x, w, ...) for w in ws]`; the CPU kernel takes them in one call, streaming
    the weights together for few rows."""
    transpose_w = transpose_w or packed_w
    if impl is None:
        impl = default_impl()
        if impl == "cpu" and not (all(cpu.supports(x, w, transpose_w) for w in ws)
                                  and (packed_w or cpu.faster_than_xla(x, transpose_w))):
            impl = "reference"
    if impl == "reference":
        return [reference.matmul(x, packed.unpack(w) if packed_w else w, num_rows,
                                 transpose_w=transpose_w) for w in ws]
    if impl == "cpu":
        return cpu.matmuls(x, ws, num_rows, transpose_w=transpose_w, packed_w=packed_w)
    raise ValueError(f"matmul impl must be one of {IMPLS} or None, got {impl!r}")


__all__ = ["IMPLS", "default_impl", "matmul", "matmuls"]
