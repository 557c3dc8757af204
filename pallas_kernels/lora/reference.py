"""The LoRA delta token by token, in plain JAX: each token's adapter's A and B gathered
and contracted (`[T, in, r]` of gathered weights: the truth for the grouped path, not a
way to serve)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """`x[t] @ a[slots[t] - 1] @ b[slots[t] - 1]` for each token t (zeros where slots[t]
    is 0), in float32 and rounded to x's dtype once."""
    g = jnp.maximum(slots - 1, 0)
    h = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), a[g].astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    y = jnp.einsum("tr,tro->to", h, b[g].astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return jnp.where((slots > 0)[:, None], y, 0.0).astype(x.dtype)
