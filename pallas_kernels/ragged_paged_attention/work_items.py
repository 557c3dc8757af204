"""How every backend splits a ragged batch into work items, and the KV page layout.

Page layout (shared by every backend): per layer, K and V are each
`[num_kv_heads, num_pages, page_size, head_dim]`, head-major, so one head's page is a
contiguous `[page_size, head_dim]` tile: a TPU pads only the last two dimensions to its
(8|16|32) x 128 tiles, so a token-major layout with 1-2 KV heads per chip would waste up
to 16x HBM, and a per-head kernel would need strided copies. Token `j` of a sequence lives
in page `page_indices[s, j // page_size]` at row `j % page_size`. A quantized cache (int8
or fp8 values) has float32 scales `[num_kv_heads, num_pages, page_size]`, one per token
and head: the stored value times its scale is the K or V element.

A ragged batch concatenates the new tokens of S sequences into `q[T]`. Sequence `s` owns
queries `cu_q_lens[s]:cu_q_lens[s+1]` and has `kv_lens[s]` tokens of K/V in its pages,
the new ones included, so its queries sit at the last positions of its context. Only the
first `num_seqs` sequences are real; queries past `cu_q_lens[num_seqs]` are padding.

Queries are grouped into work items, each a block of up to `bq` consecutive queries of one
sequence, so a prefill chunk reads its pages once per block rather than once per token,
and a decode batch (bq = 1) reads each sequence's pages once. With the query heads of one
KV head packed together, an item is a `[bq * group, head_dim]` tile of queries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

QUANTIZED_KV_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkItems:
    """Per item: its sequence, the position of its first query, how many of its `bq`
    rows are real queries (0 for an empty item), and that sequence's context length."""

    seq: jax.Array  # [W] int32
    q_pos: jax.Array  # [W] int32
    num_q: jax.Array  # [W] int32
    kv_len: jax.Array  # [W] int32
    token: jax.Array  # [W, bq] flat query index of each row; num_tokens for padding rows


def default_queries_per_block(num_tokens: int, max_seqs: int, cap: int = 32) -> int:
    """T // S, capped: a decode batch (T == S) uses 1, prefill chunks use many."""
    return max(1, min(cap, num_tokens // max_seqs))


def num_work_items(num_tokens: int, max_seqs: int, bq: int) -> int:
    """Enough items for any ragged split of T tokens over S sequences into blocks of bq."""
    return min(num_tokens, max_seqs + num_tokens // bq)


def work_items(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array,
               num_tokens: int, bq: int) -> WorkItems:
    max_seqs = kv_lens.shape[0]
    num_items = num_work_items(num_tokens, max_seqs, bq)
    seq_valid = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(seq_valid, kv_lens, 0)
    items_per_seq = (q_lens + bq - 1) // bq
    items_end = jnp.cumsum(items_per_seq)
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(items_end, w, side="right"), max_seqs - 1).astype(jnp.int32)
    first_q = (w - (items_end - items_per_seq)[seq]) * bq  # query index within its sequence
    real = w < items_end[-1]
    num_q = jnp.where(real, jnp.clip(q_lens[seq] - first_q, 0, bq), 0).astype(jnp.int32)
    kv_len = jnp.where(real, kv_lens[seq], 0).astype(jnp.int32)
    q_pos = (kv_len - q_lens[seq] + first_q).astype(jnp.int32)
    rows = jnp.arange(bq, dtype=jnp.int32)[None, :]
    token = jnp.where(rows < num_q[:, None], cu_q_lens[seq][:, None] + first_q[:, None] + rows,
                      num_tokens).astype(jnp.int32)
    return WorkItems(seq, q_pos, num_q, kv_len, token)


def visible_blocks(q_pos, num_q, kv_len, block_tokens: int, sliding_window: int | None):
    """The KV blocks `[first, last)` of `block_tokens` keys an item's queries can see: up
    to its last query's position, from its first query's window start. Empty for an item
    without queries. Scalars in, scalars out: the kernels call it per program."""
    end = jnp.minimum(kv_len, q_pos + num_q)
    first = 0
    if sliding_window is not None:
        first = jnp.maximum(q_pos - sliding_window + 1, 0) // block_tokens
    return first, jnp.where(num_q > 0, (end + block_tokens - 1) // block_tokens, first)


def gather_queries(q: jax.Array, items: WorkItems, num_kv_heads: int, rows: int | None = None
                   ) -> jax.Array:
    """`q[T, Hq, D]` → `[Hkv, W, rows, D]`: row `i * group + g` is query i's head
    `h * group + g`. Rows past `bq * group` (padding up to `rows`) are zeros."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_items, bq = items.token.shape
    group = num_q_heads // num_kv_heads
    qi = q[jnp.minimum(items.token, num_tokens - 1)]  # [W, bq, Hq, D]
    qi = qi.reshape(num_items, bq, num_kv_heads, group, head_dim).transpose(2, 0, 1, 3, 4)
    qi = qi.reshape(num_kv_heads, num_items, bq * group, head_dim)
    if rows is not None and rows > bq * group:
        qi = jnp.pad(qi, ((0, 0), (0, 0), (0, rows - bq * group), (0, 0)))
    return qi


def scatter_outputs(out: jax.Array, items: WorkItems, num_tokens: int, group: int, dtype
                    ) -> jax.Array:
    """Inverse of gather_queries: `[Hkv, W, rows, D]` → `[T, Hq, D]`, zeros for padding."""
    num_kv_heads, num_items, _, head_dim = out.shape
    bq = items.token.shape[1]
    out = out[:, :, : bq * group].reshape(num_kv_heads, num_items, bq, group, head_dim)
    out = out.transpose(1, 2, 0, 3, 4).reshape(num_items * bq, num_kv_heads * group, head_dim)
    result = jnp.zeros((num_tokens, num_kv_heads * group, head_dim), out.dtype)
    # Each real query belongs to exactly one item row; padding rows point past the end.
    result = result.at[items.token.reshape(-1)].set(out, mode="drop")
    return result.astype(dtype)
