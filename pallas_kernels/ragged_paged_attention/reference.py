"""Ragged paged attention in plain JAX: the truth for the kernels and the CPU path.

Page layout (shared by every backend): per layer, K and V are each
`[num_pages, page_size, num_kv_heads, head_dim]`. Token `j` of a sequence lives in page
`page_indices[s, j // page_size]` at row `j % page_size`.

A ragged batch concatenates the new tokens of S sequences into `q[T]`. Sequence `s` owns
queries `cu_q_lens[s]:cu_q_lens[s+1]` and has `kv_lens[s]` tokens of K/V in its pages,
the new ones included, so its queries sit at the last positions of its context. Only the
first `num_seqs` sequences are real; queries past `cu_q_lens[num_seqs]` are padding and
come back as zeros.

The loop runs over blocks of KV pages (up to the longest context in the batch) with an
online softmax; each query token gathers its own sequence's pages, so there is no Python
loop over sequences and the shapes are static.
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
      pages_per_block: pages per loop iteration (default: about 128 tokens).
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

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, max_seqs - 1)
    real = t < cu_q_lens[num_seqs]
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    kv_len = jnp.where(real, kv_lens[seq], 0)
    q_pos = kv_len - q_len + (t - q_start)

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    seq_valid = jnp.arange(max_seqs) < num_seqs
    longest = jnp.max(jnp.where(seq_valid, kv_lens, 0))
    num_blocks = (longest + block * page_size - 1) // (block * page_size)

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_indices, b * block, block, axis=1)[seq]
        k = k_pages[pages].reshape(num_tokens, block * page_size, num_kv_heads, head_dim)
        v = v_pages[pages].reshape(num_tokens, block * page_size, num_kv_heads, head_dim)
        s = jnp.einsum("thgd,tkhd->thgk", qg, k.astype(jnp.float32))
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = b * block * page_size + jnp.arange(block * page_size, dtype=jnp.int32)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len[:, None])
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(visible[:, None, None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None]) * visible[:, None, None, :]
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("thgk,tkhd->thgd", p, v.astype(jnp.float32))
        return m_new, l, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), _MASKED, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


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
