"""The paged KV cache every attention backend reads, and the writer every backend shares.

Page layout: per layer, K and V are each `[num_kv_heads, num_pages, page_size, head_dim]`,
head-major, so one head's page is a contiguous `[page_size, head_dim]` tile: a TPU pads
only the last two dimensions to its (8|16|32) x 128 tiles, so a token-major layout with
1-2 KV heads per chip would waste up to 16x HBM, and a per-head kernel would need strided
copies. Token `j` of a sequence lives in page `page_indices[s, j // page_size]` at row
`j % page_size` (flat slot `page * page_size + row`). A quantized cache (int8 or fp8
values) has float32 scales `[num_kv_heads, num_pages, page_size]`, one per token and head:
the stored value times its scale is the K or V element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QUANTIZED_KV_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def as_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as uint16 (bit for bit); other dtypes unchanged.

    XLA:CPU has no bf16 gather or scatter: it converts the operand to float32 first, and
    for the KV pool that conversion (hoisted out of the loop, or around the scatter) reads
    and writes every page of the pool per layer and step. Integers move natively.
    """
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """Inverse of as_bits."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """`x[..., head_dim]` → (values in `dtype`, float32 scales `[...]`), symmetric per
    token and head: amax maps to the format's largest value (127 for int8, 448 for e4m3)."""
    x = x.astype(jnp.float32)
    top = QUANTIZED_KV_MAX[jnp.dtype(dtype).name]
    scale = jnp.max(jnp.abs(x), axis=-1) / top
    scale = jnp.where(scale > 0, scale, 1.0)
    y = x / scale[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.clip(jnp.round(y), -top, top)
    return y.astype(dtype), scale


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
    k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Store new tokens' K/V `[T, num_kv_heads, head_dim]` at flat slots `page * page_size + row`.

    Slots outside the pool (padding tokens use `num_pages * page_size`) are dropped. With
    scales (a quantized cache) the tokens are quantized first and the result is
    `(k_pages, v_pages, k_scales, v_scales)`, else `(k_pages, v_pages)`.
    """
    shape = k_pages.shape
    flat = (shape[0], shape[1] * shape[2], shape[3])

    def put(pages, x):
        x = as_bits(x.astype(pages.dtype).transpose(1, 0, 2))  # [Hkv, T, D]
        new = as_bits(pages).reshape(flat).at[:, slot_mapping].set(x, mode="drop")
        return from_bits(new, pages.dtype).reshape(shape)

    def put_scales(scales, s):
        flat_scales = scales.reshape(flat[:2])
        return flat_scales.at[:, slot_mapping].set(s.T, mode="drop").reshape(shape[:3])

    if k_scales is None:
        return put(k_pages, k), put(v_pages, v)
    (kq, ks), (vq, vs) = quantize_kv(k, k_pages.dtype), quantize_kv(v, v_pages.dtype)
    return put(k_pages, kq), put(v_pages, vq), put_scales(k_scales, ks), put_scales(v_scales, vs)
