"""CLIP's vision transformer (ViT), as LLaVA reads it: patch embedding (a convolution with
stride = kernel = patch, here one matmul over flattened patches), a class token, learned
positions, a LayerNorm before the layers ("pre_layrnorm" in HF's spelling), and pre-norm
layers of full bidirectional attention and an MLP, all with biases.

Parameters are a plain pytree (`ClipParams`): the tower is small next to the language
model and runs in a program of its own (engine/multimodal/), replicated on the mesh.
Norms and the softmax run in float32, the matmuls in the weights' dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import VisionConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ClipLayer:
    ln1_w: jax.Array  # [D]
    ln1_b: jax.Array
    qkv_w: jax.Array  # [D, 3, D]: q, k, v side by side
    qkv_b: jax.Array  # [3, D]
    out_w: jax.Array  # [D, D]
    out_b: jax.Array
    ln2_w: jax.Array
    ln2_b: jax.Array
    fc1_w: jax.Array  # [D, M]
    fc1_b: jax.Array
    fc2_w: jax.Array  # [M, D]
    fc2_b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ClipParams:
    patch_w: jax.Array  # [3 * P * P, D], rows in (channel, row, column) order
    class_embedding: jax.Array  # [D]
    positions: jax.Array  # [num_patches + 1, D]
    pre_ln_w: jax.Array
    pre_ln_b: jax.Array
    layers: list[ClipLayer]  # the first `VisionConfig.layers_used` only


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + eps)
    return (h * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def activation(x: jax.Array, name: str) -> jax.Array:
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.gelu(x, approximate=name == "gelu_pytorch_tanh")


def patches(pixels: jax.Array, patch: int) -> jax.Array:
    """`[B, 3, H, W]` -> `[B, (H/P) x (W/P), 3 x P x P]`: each patch flattened in the
    order of a convolution kernel's (channel, row, column), patches row-major."""
    b, c, h, w = pixels.shape
    x = pixels.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), -1)


def attention(x: jax.Array, layer: ClipLayer, heads: int) -> jax.Array:
    b, n, d = x.shape
    qkv = jnp.einsum("bnd,dke->bnke", x, layer.qkv_w) + layer.qkv_b
    q, k, v = (qkv[:, :, i].reshape(b, n, heads, d // heads) for i in range(3))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * (d // heads) ** -0.5
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, d)
    return out @ layer.out_w + layer.out_b


def hidden_states(params: ClipParams, pixels: jax.Array, cfg: VisionConfig) -> list[jax.Array]:
    """HF's `hidden_states` of the tower on `[B, 3, H, W]` pixels: the embeddings after
    the pre-norm, then each layer's output (of the layers in `params`), `[B, N + 1, D]`."""
    dtype = params.patch_w.dtype
    x = patches(pixels.astype(dtype), cfg.patch_size) @ params.patch_w
    cls = jnp.broadcast_to(params.class_embedding, (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + params.positions
    x = layer_norm(x, params.pre_ln_w, params.pre_ln_b, cfg.layer_norm_eps)
    states = [x]
    for layer in params.layers:
        x = x + attention(layer_norm(x, layer.ln1_w, layer.ln1_b, cfg.layer_norm_eps), layer,
                          cfg.num_heads)
        h = layer_norm(x, layer.ln2_w, layer.ln2_b, cfg.layer_norm_eps)
        x = x + activation(h @ layer.fc1_w + layer.fc1_b, cfg.hidden_act) @ layer.fc2_w \
            + layer.fc2_b
        states.append(x)
    return states
