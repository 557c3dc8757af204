"""Float matmul in plain JAX: the truth for the CPU kernel and the fallback everywhere.

`y[M, N] = x[M, K] @ w` with w `[K, N]`, or `[N, K]` with `transpose_w` (a tied LM head:
logits = x @ embed.T). x and w share a dtype (float32 or bfloat16); the dot accumulates
in float32 and the result is rounded once to x's dtype. Rows at or past `num_rows` are
zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w: jax.Array, num_rows: jax.Array | int | None = None, *,
           transpose_w: bool = False) -> jax.Array:
    """`x @ w` (or `x @ w.T`) -> `[M, N]` in x's dtype, rows >= num_rows zeroed."""
    contract = ((1,), (1,)) if transpose_w else ((1,), (0,))
    # HIGHEST: on TPU a float32 dot defaults to bf16 passes, and the truth must not.
    y = jax.lax.dot_general(x, w, (contract, ((), ())), precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32).astype(x.dtype)
    if num_rows is not None:
        rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
        y = jnp.where(rows < jnp.asarray(num_rows, jnp.int32), y, jnp.zeros((), y.dtype))
    return y
