"""Ragged paged attention in plain JAX: the truth for the kernels and the CPU path.

Page layout (shared by every backend): per layer, K and V are each
`[num_pages, page_size, num_kv_heads, head_dim]`. Token `j` of a sequence lives in page
`page_indices[s, j // page_size]` at row `j % page_size`.

A ragged batch concatenates the new tokens of S sequences into `q[T]`. Sequence `s` owns
queries `cu_q_lens[s]:cu_q_lens[s+1]` and has `kv_lens[s]` tokens of K/V in its pages,
the new ones included, so its queries sit at the last positions of its context. Only the
first `num_seqs` sequences are real; queries past `cu_q_lens[num_seqs]` are padding and
come back as zeros.

Queries are grouped into work items, each a block of up to `bq` queries of one sequence,
so a prefill chunk reads its pages once per block rather than once per token, and a
decode batch (bq = 1) reads each sequence's pages once. A loop over blocks of KV pages
(up to the longest context in the batch) keeps an online softmax. Shapes are static and
there is no Python loop over sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30


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
    pages_per_block: int | None = None,
    queries_per_block: int | None = None,
) -> jax.Array:
    """Causal attention of ragged queries over paged K/V.

    Args:
      q: `[T, num_q_heads, head_dim]`.
      k_pages, v_pages: `[num_pages, page_size, num_kv_heads, head_dim]`.
      kv_lens: `[S]` int32, context length of each sequence including its new tokens.
      page_indices: `[S, pages_per_seq]` int32.
      cu_q_lens: `[S + 1]` int32, query offsets.
      num_seqs: scalar int32, number of real sequences.
      sm_scale: multiplier of q·k.
      sliding_window: a query at position p sees keys at positions > p - sliding_window.
      soft_cap: scores become soft_cap * tanh(scores / soft_cap).
      pages_per_block: KV pages per loop iteration (default: about 128 tokens).
      queries_per_block: queries of one sequence that share a K/V gather (default:
        T // S, capped at 32, so a decode batch uses 1 and prefill chunks use many).
    Returns:
      `[T, num_q_heads, head_dim]` in q's dtype.
    """
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    kv_lens, page_indices, cu_q_lens = (jnp.asarray(x) for x in (kv_lens, page_indices, cu_q_lens))
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    block = pages_per_block or max(1, min(pages_per_seq, 128 // page_size))
    num_blocks_max = -(-pages_per_seq // block)
    # Pad the page table to whole blocks; padded entries are masked by kv_lens.
    page_indices = jnp.pad(page_indices, ((0, 0), (0, num_blocks_max * block - pages_per_seq)))

    # Work items: (sequence, block of bq of its queries). Every item reads its sequence's
    # pages once for all its queries. Items never exceed tokens, nor S + T // bq.
    bq = queries_per_block or max(1, min(32, num_tokens // max_seqs))
    num_items = min(num_tokens, max_seqs + num_tokens // bq)
    seq_valid = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(seq_valid, kv_lens, 0)
    items_per_seq = (q_lens + bq - 1) // bq
    items_end = jnp.cumsum(items_per_seq)
    w = jnp.arange(num_items, dtype=jnp.int32)
    item_seq = jnp.minimum(jnp.searchsorted(items_end, w, side="right"), max_seqs - 1)
    first_q = (w - (items_end - items_per_seq)[item_seq]) * bq  # query index within sequence
    offs = first_q[:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :]  # [W, bq]
    row_valid = (offs < q_lens[item_seq][:, None]) & (w < items_end[-1])[:, None]
    token = jnp.where(row_valid, cu_q_lens[item_seq][:, None] + offs, num_tokens)
    kv_len = jnp.where(row_valid, kv_lens[item_seq][:, None], 0)
    q_pos = kv_len - q_lens[item_seq][:, None] + offs  # [W, bq]

    qi = q.astype(jnp.float32)[jnp.minimum(token, num_tokens - 1)] * sm_scale  # [W, bq, Hq, D]
    qi = qi.reshape(num_items, bq, num_kv_heads, group, head_dim)
    qi = qi.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, bq * group, head_dim)
    row_pos = jnp.repeat(q_pos, group, axis=1)[:, None, :]  # [W, 1, bq * group]
    row_len = jnp.repeat(kv_len, group, axis=1)[:, None, :]
    longest = jnp.max(kv_lens)
    num_blocks = (longest + block * page_size - 1) // (block * page_size)
    item_pages = page_indices[item_seq]  # [W, pages]

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(item_pages, b * block, block, axis=1)
        # [W, H, K, D]: batch dims leading, as XLA's batched matmul wants them.
        k = k_pages[pages].reshape(num_items, block * page_size, num_kv_heads, head_dim)
        v = v_pages[pages].reshape(num_items, block * page_size, num_kv_heads, head_dim)
        k = k.astype(jnp.float32).transpose(0, 2, 1, 3)
        v = v.astype(jnp.float32).transpose(0, 2, 1, 3)
        s = jnp.einsum("whrd,whkd->whrk", qi, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = b * block * page_size + jnp.arange(block * page_size, dtype=jnp.int32)
        visible = (k_pos <= row_pos[..., None]) & (k_pos < row_len[..., None])
        if sliding_window is not None:
            visible &= k_pos > row_pos[..., None] - sliding_window
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None]) * visible
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("whrk,whkd->whrd", p, v)
        return m_new, l, acc

    rows = bq * group
    init = (
        jnp.full((num_items, num_kv_heads, rows), _MASKED, jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows), jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = out.reshape(num_items, num_kv_heads, bq, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_items * bq, num_q_heads, head_dim)
    # Each real token belongs to exactly one item row; padding rows point past the end.
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    result = result.at[token.reshape(-1)].set(out, mode="drop")
    return result.astype(q.dtype)


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Store new tokens' K/V `[T, num_kv_heads, head_dim]` at flat slots `page * page_size + row`.

    Slots outside the pool (padding tokens use `num_pages * page_size`) are dropped.
    """
    shape = k_pages.shape
    flat = (shape[0] * shape[1],) + shape[2:]
    k_pages = k_pages.reshape(flat).at[slot_mapping].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.reshape(flat).at[slot_mapping].set(v.astype(v_pages.dtype), mode="drop")
    return k_pages.reshape(shape), v_pages.reshape(shape)
