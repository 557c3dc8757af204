"""Weight-only quantized matmul in plain JAX: the truth for the kernels and the CPU path.

`y = x @ w` with `w[K, N]` (K in-features, N out-features) stored quantized (formats.py).
The reference dequantizes the whole weight to x's dtype and lets XLA do one dot with
float32 accumulation, so its only rounding beyond the quantization itself is the cast of
the dequantized weight to x's dtype and of the result back to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul.formats import check_operands, dequantize


def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, kind: str,
                     **unused_kernel_options) -> jax.Array:
    """`x[M, K] @ dequantize(values, scales)` -> `[M, N]` in x's dtype.

    Keyword options meant for the kernels (block sizes, interpret) are accepted and ignored
    so that every implementation has one signature.
    """
    check_operands(x, values, scales, kind)
    w = dequantize(values, scales, kind, x.dtype)
    # HIGHEST: on TPU a float32 dot defaults to bf16 passes, and the truth must not.
    y = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
