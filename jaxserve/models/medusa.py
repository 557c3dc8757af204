"""Medusa heads on the device: each head's greedy guess from a final hidden state."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MedusaHeads:
    """loading/medusa.py's weights on the device (in the model's dtype)."""

    block_weights: jax.Array  # [heads, layers, D, D]
    block_biases: jax.Array  # [heads, layers, D]
    lm_heads: jax.Array  # [heads, D, V]
    top: int = dataclasses.field(default=1, metadata=dict(static=True))  # guesses per head


def medusa_tokens(x: jax.Array, heads: MedusaHeads) -> jax.Array:
    """`[R, heads, top]`: head h's `heads.top` most likely tokens, most likely first, for
    each row of `x` (`[R, D]`, the final hidden states after the model's last norm),
    h + 2 tokens after the row's token."""
    y = jnp.broadcast_to(x.astype(heads.lm_heads.dtype), (heads.lm_heads.shape[0], *x.shape))
    for j in range(heads.block_weights.shape[1]):
        z = jnp.einsum("hrd,hde->hre", y, heads.block_weights[:, j]) + heads.block_biases[:, j, None]
        y = y + jax.nn.silu(z)
    logits = jnp.einsum("hrd,hdv->hrv", y, heads.lm_heads, preferred_element_type=jnp.float32)
    return jnp.moveaxis(jax.lax.top_k(logits, heads.top)[1], 0, 1).astype(jnp.int32)
