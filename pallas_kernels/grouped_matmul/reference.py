"""The grouped matmul in plain JAX: `jax.lax.ragged_dot` over the dequantized stack. The
truth for the kernels. (On a CPU, XLA computes ragged_dot densely: every row against
every group's weight, masked, plus a transposed copy of the stack; cpu.py is the path
that reads only the groups with rows.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import formats


def grouped_matmul(x: jax.Array, values: jax.Array, group_sizes: jax.Array,
                   scales: jax.Array | None = None, *, kind: str | None = None,
                   **unused_kernel_options) -> jax.Array:
    """`y[i] = x[i] @ w[g(i)]` for the rows of each group; rows past the groups: zeros."""
    formats.check_operands(x, values, scales, group_sizes, kind)
    w = formats.dequantize(values, scales, kind, x.dtype)
    # HIGHEST for float32 operands; 16-bit products are exact in float32 anyway, and
    # XLA:TPU's ragged_dot (a Mosaic kernel) refuses fp32 precision on bf16 operands.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), precision=precision,
                           preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
