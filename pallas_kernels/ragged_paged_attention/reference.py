"""Ragged paged attention in plain JAX: the truth for the kernels and the CPU path.

The page layout and the split of a ragged batch into work items are documented in
work_items.py. A loop over blocks of KV pages (up to the longest context in the batch)
keeps an online softmax for every item at once. Shapes are static and there is no Python
loop over sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.work_items import (
    QUANTIZED_KV_MAX, default_queries_per_block, gather_queries, scatter_outputs, work_items)

MASKED = -1e30


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    pages_per_block: int | None = None,
    queries_per_block: int | None = None,
) -> jax.Array:
    """Causal attention of ragged queries over paged K/V.

    Args:
      q: `[T, num_q_heads, head_dim]`.
      k_pages, v_pages: `[num_kv_heads, num_pages, page_size, head_dim]`.
      kv_lens: `[S]` int32, context length of each sequence including its new tokens.
      page_indices: `[S, pages_per_seq]` int32.
      cu_q_lens: `[S + 1]` int32, query offsets.
      num_seqs: scalar int32, number of real sequences.
      sm_scale: multiplier of q·k.
      sliding_window: a query at position p sees keys at positions > p - sliding_window.
      soft_cap: scores become soft_cap * tanh(scores / soft_cap).
      k_scales, v_scales: `[num_kv_heads, num_pages, page_size]` float32 for a quantized
        (int8 / fp8) cache, else None.
      pages_per_block: KV pages per loop iteration (default: about 128 tokens).
      queries_per_block: queries of one sequence that share a K/V gather (default:
        T // S, capped at 32).
    Returns:
      `[T, num_q_heads, head_dim]` in q's dtype; zeros for padding queries.
    """
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    kv_lens, page_indices, cu_q_lens = (jnp.asarray(x) for x in (kv_lens, page_indices, cu_q_lens))
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    block = pages_per_block or max(1, min(pages_per_seq, 128 // page_size))
    num_blocks_max = -(-pages_per_seq // block)
    # Pad the page table to whole blocks; padded entries are masked by kv_lens.
    page_indices = jnp.pad(page_indices, ((0, 0), (0, num_blocks_max * block - pages_per_seq)))

    bq = queries_per_block or default_queries_per_block(num_tokens, max_seqs)
    items = work_items(cu_q_lens, kv_lens, num_seqs, num_tokens, bq)
    num_items = items.seq.shape[0]
    qi = gather_queries(q.astype(jnp.float32) * sm_scale, items, num_kv_heads)
    qi = qi.transpose(1, 0, 2, 3)  # [W, Hkv, bq * group, D]: batch dims first for XLA
    row_pos = items.q_pos[:, None] + jnp.arange(bq * group, dtype=jnp.int32) // group
    row_pos = row_pos[:, None, :]  # [W, 1, rows]
    kv_len = items.kv_len[:, None, None]
    num_blocks = (jnp.max(items.kv_len) + block * page_size - 1) // (block * page_size)
    item_pages = page_indices[items.seq]  # [W, pages]

    def load(pages_ref, scales_ref, pages):
        x = _gather_pages(pages_ref, pages).astype(jnp.float32)  # [Hkv, W, block, page_size, D]
        if scales_ref is not None:
            x = x * scales_ref[:, pages][..., None]
        x = x.reshape(num_kv_heads, num_items, block * page_size, head_dim)
        return x.transpose(1, 0, 2, 3)  # [W, Hkv, K, D]

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(item_pages, b * block, block, axis=1)
        k, v = load(k_pages, k_scales, pages), load(v_pages, v_scales, pages)
        s = jnp.einsum("whrd,whkd->whrk", qi, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = b * block * page_size + jnp.arange(block * page_size, dtype=jnp.int32)
        visible = (k_pos <= row_pos[..., None]) & (k_pos < kv_len[..., None])
        if sliding_window is not None:
            visible &= k_pos > row_pos[..., None] - sliding_window
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None]) * visible
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("whrk,whkd->whrd", p, v)
        return m_new, l, acc

    rows = bq * group
    init = (
        jnp.full((num_items, num_kv_heads, rows), MASKED, jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows), jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return scatter_outputs(out.transpose(1, 0, 2, 3), items, num_tokens, group, q.dtype)


def _bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as uint16 (bit for bit); other dtypes unchanged.

    XLA:CPU has no bf16 gather or scatter: it converts the operand to float32 first, and
    for the KV pool that conversion (hoisted out of the loop, or around the scatter) reads
    and writes every page of the pool per layer and step. Integers move natively.
    """
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def _unbits(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _gather_pages(pages_ref: jax.Array, pages: jax.Array) -> jax.Array:
    return _unbits(_bits(pages_ref)[:, pages], pages_ref.dtype)


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
        x = _bits(x.astype(pages.dtype).transpose(1, 0, 2))  # [Hkv, T, D]
        new = _bits(pages).reshape(flat).at[:, slot_mapping].set(x, mode="drop")
        return _unbits(new, pages.dtype).reshape(shape)

    def put_scales(scales, s):
        flat_scales = scales.reshape(flat[:2])
        return flat_scales.at[:, slot_mapping].set(s.T, mode="drop").reshape(shape[:3])

    if k_scales is None:
        return put(k_pages, k), put(v_pages, v)
    (kq, ks), (vq, vs) = quantize_kv(k, k_pages.dtype), quantize_kv(v, v_pages.dtype)
    return put(k_pages, kq), put(v_pages, vq), put_scales(k_scales, ks), put_scales(v_scales, vs)
