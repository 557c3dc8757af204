"""Ragged paged attention in plain JAX: the truth for the kernels and the CPU fallback.

Work items and inputs are in work_items.py, the page layout in kv_cache.py. For each kind
of item a loop over blocks of KV pages (up to the longest context among the items) keeps
an online softmax for several items at once: all decode items in one pass, prefill items
in chunks of `PREFILL_ITEMS_PER_PASS`, only as many chunks as there are real items. Shapes
are static and there is no Python loop over sequences.

Block rule: queries per prefill item min(32, T) (work_items.default_queries_per_block);
about 128 KV tokens per loop iteration. Both keyword-overridable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_cache import as_bits, as_values
from pallas_kernels.ragged_paged_attention.work_items import (
    MASKED, AttentionInputs, BlockPlan, WorkItems, default_queries_per_block, gather_image_ends,
    gather_queries, gather_tree_masks, plan_blocks, scatter_outputs, sink_rows, tree_visible)

KV_TOKENS_PER_BLOCK = 128
PREFILL_ITEMS_PER_PASS = 4


def ragged_paged_attention(x: AttentionInputs, *, pages_per_block: int | None = None,
                           queries_per_block: int | None = None) -> jax.Array:
    """Causal attention of ragged queries over paged K/V: `[T, num_q_heads, head_dim]` in
    q's dtype, zeros for padding queries."""
    plan = plan_blocks(
        x, queries_per_block or default_queries_per_block(x.num_tokens),
        pages_per_block or max(1, min(x.pages_per_seq, KV_TOKENS_PER_BLOCK // x.page_size)))
    out = jnp.zeros(x.q.shape, jnp.float32)
    out = scatter_outputs(out, _attend(x, plan, plan.decode), plan.decode, x.group)

    # Prefill items, a chunk at a time, only the chunks that hold real items.
    chunk = min(PREFILL_ITEMS_PER_PASS, plan.prefill.num_items)
    pad = -plan.prefill.num_items % chunk
    items = jax.tree.map(lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1),
                                           constant_values=0), plan.prefill)
    items = WorkItems(items.seq, items.q_pos, items.num_q, items.kv_len,
                      items.token.at[plan.prefill.num_items:].set(x.num_tokens))

    def one_chunk(i, out):
        part = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk), items)
        return scatter_outputs(out, _attend(x, plan, part), part, x.group)

    num_chunks = (plan.prefill.num_real() + chunk - 1) // chunk
    out = jax.lax.fori_loop(0, num_chunks, one_chunk, out)
    return out.astype(x.q.dtype)


def _attend(x: AttentionInputs, plan: BlockPlan, items: WorkItems) -> jax.Array:
    """Attention of every item's queries: `[Hkv, W, rows, D]` float32 (zeros for empty
    items), walking KV blocks up to the items' longest context."""
    num_kv_heads, page_size, head_dim, group = x.num_kv_heads, x.page_size, x.head_dim, x.group
    block, num_items = plan.pages_per_block, items.num_items
    rows = items.queries_per_item * group
    qi = gather_queries(x.q.astype(jnp.float32) * x.sm_scale, items, num_kv_heads)
    qi = qi.transpose(1, 0, 2, 3)  # [W, Hkv, rows, D]: batch dims first for XLA
    row_pos = items.q_pos[:, None] + jnp.arange(rows, dtype=jnp.int32) // group
    row_pos = row_pos[:, None, :]  # [W, 1, rows]
    # The last key each row sees: itself, or the end of the image it is in.
    row_last = row_pos
    if x.image_end is not None:
        row_last = jnp.maximum(row_pos, gather_image_ends(x, items)[:, None, :])
    kv_len = items.kv_len[:, None, None]
    if x.tree:  # each row's tree mask, its item's tree start: [W, 1, rows, 1], [W, 1, 1, 1]
        row_mask = gather_tree_masks(x, items)[:, None, :, None]
        tree_start = x.tree_start[items.seq][:, None, None, None]
    num_blocks = (items.max_kv_len() + block * page_size - 1) // (block * page_size)
    item_pages = plan.page_indices[items.seq]  # [W, pages]

    def load(pages_ref, scales_ref, pages):
        k = _gather_pages(pages_ref, pages).astype(jnp.float32)  # [Hkv, W, block, page, D]
        if scales_ref is not None:
            k = k * scales_ref[:, pages][..., None]
        k = k.reshape(num_kv_heads, num_items, block * page_size, head_dim)
        return k.transpose(1, 0, 2, 3)  # [W, Hkv, K, D]

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(item_pages, b * block, block, axis=1)
        k, v = load(x.k_pages, x.k_scales, pages), load(x.v_pages, x.v_scales, pages)
        s = jnp.einsum("whrd,whkd->whrk", qi, k)
        if x.soft_cap is not None:
            s = x.soft_cap * jnp.tanh(s / x.soft_cap)
        k_pos = b * block * page_size + jnp.arange(block * page_size, dtype=jnp.int32)
        visible = (k_pos <= row_last[..., None]) & (k_pos < kv_len[..., None])
        if x.sliding_window is not None:
            visible &= k_pos > row_pos[..., None] - x.sliding_window
        if x.tree:
            visible &= tree_visible(k_pos, tree_start, row_mask)
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None]) * visible
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("whrk,whkd->whrd", p, v)
        return m_new, l, acc

    # The online softmax starts from the sinks (work_items.AttentionInputs), if any.
    start = jnp.broadcast_to(sink_rows(x, rows), (num_items, num_kv_heads, rows))
    init = (
        start,
        jnp.full((num_items, num_kv_heads, rows), x.sinks is not None, jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.transpose(1, 0, 2, 3)


def _gather_pages(pages_ref: jax.Array, pages: jax.Array) -> jax.Array:
    """The values of `pages_ref[:, pages]`, moved as integers: XLA:CPU would convert a
    whole bf16 pool to float32 to gather from it (kv_cache.py)."""
    return as_values(as_bits(pages_ref)[:, pages])
