"""Gemma 3's image side: a SigLIP ViT (a linear patch embedding with bias, learned
positions, no class token; CLIP's pre-norm layers; a final LayerNorm), its patch grid
average-pooled to `tokens_per_image` soft tokens, RMSNorm'd by (1 + w) and projected into
the language model's width (no bias)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import Gemma3VisionConfig
from jaxserve.models.vision.clip import ClipLayer, activation, attention, layer_norm, patches


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Gemma3VisionParams:
    patch_w: jax.Array  # [3 * P * P, D]
    patch_b: jax.Array  # [D]
    positions: jax.Array  # [num_patches, D]
    layers: list[ClipLayer]
    post_ln_w: jax.Array
    post_ln_b: jax.Array
    soft_norm: jax.Array  # [D], Gemma's (1 + w)
    projection: jax.Array  # [D, T]


def embed_images(params: Gemma3VisionParams, pixels: jax.Array, cfg: Gemma3VisionConfig
                 ) -> jax.Array:
    """`[B, 3, S, S]` pixels -> `[B, tokens_per_image, T]`."""
    dtype = params.patch_w.dtype
    eps = cfg.layer_norm_eps
    x = patches(pixels.astype(dtype), cfg.patch_size) @ params.patch_w + params.patch_b
    x = x + params.positions
    for layer in params.layers:
        x = x + attention(layer_norm(x, layer.ln1_w, layer.ln1_b, eps), layer, cfg.num_heads)
        h = layer_norm(x, layer.ln2_w, layer.ln2_b, eps)
        x = x + activation(h @ layer.fc1_w + layer.fc1_b, cfg.hidden_act) @ layer.fc2_w \
            + layer.fc2_b
    x = layer_norm(x, params.post_ln_w, params.post_ln_b, eps)
    b, _, d = x.shape
    side, k = cfg.image_size // cfg.patch_size, cfg.pool
    grid = x.reshape(b, side // k, k, side // k, k, d).astype(jnp.float32)
    pooled = grid.mean(axis=(2, 4)).reshape(b, -1, d).astype(x.dtype)
    h = pooled.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + eps)
    h = (h * (1.0 + params.soft_norm.astype(jnp.float32))).astype(x.dtype)
    return h @ params.projection
