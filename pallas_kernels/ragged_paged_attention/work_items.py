"""What every attention backend shares: its validated inputs and the work-item split.

A ragged batch concatenates the new tokens of S sequences into `q[T]`. Sequence `s` owns
queries `cu_q_lens[s]:cu_q_lens[s+1]` and has `kv_lens[s]` tokens of K/V in its pages
(kv_cache.py), the new ones included, so its queries sit at the last positions of its
context. Only the first `num_seqs` sequences are real; queries past
`cu_q_lens[num_seqs]` are padding.

Queries are grouped into work items of two kinds, so the work follows the real tokens
whatever the batch's bucket:
- decode items: one per sequence slot, real for a sequence with exactly one new token,
  one query (`group` rows: the query heads of one KV head packed together);
- prefill items: blocks of up to `bq` consecutive queries of one sequence with more than
  one new token (`bq * group` rows), so a prefill chunk reads its pages once per block
  rather than once per token.
A decode in a mixed batch is never padded to a prefill block's rows, and a batch of one
prompt is one prefill item per `bq` tokens, however many sequence slots its bucket has.
Real items come first in each kind; the rest are empty (no queries), and every backend
skips them: the kernels by their item metadata, the reference by looping only over real
prefill items. Each backend walks an item's keys in blocks of `pages_per_block` pages with
an online softmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_cache import QUANTIZED_KV_MAX

MASKED = -1e30  # score of a key a query may not see (finite: no inf - inf = NaN)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """One call's operands, checked once for every backend (`validate`).

    q `[T, num_q_heads, head_dim]`; k_pages, v_pages `[num_kv_heads, num_pages, page_size,
    head_dim]`; kv_lens `[S]` int32, each sequence's context length including its new
    tokens; page_indices `[S, pages_per_seq]` int32; cu_q_lens `[S + 1]` int32, query
    offsets; num_seqs a scalar int32, the real sequences; k_scales, v_scales
    `[num_kv_heads, num_pages, page_size]` float32 for an int8 / fp8 cache, else None. A
    bf16 cache may come as its uint16 bits (kv_cache.pool_dtype) to the reference and the
    CPU kernel; the TPU and GPU kernels take real bf16 pages. sm_scale multiplies q·k; a
    query at position p sees keys at positions > p - sliding_window; soft_cap makes scores
    soft_cap * tanh(scores / soft_cap).

    Trees of speculative tokens (both None without): tree_start `[S]` int32, where sequence
    s's tree begins (its node j at position tree_start[s] + j, at most MAX_TREE_NODES,
    every parent before its children; tree_start >= kv_len: no tree), and tree_mask `[T]`
    int32, each query's nodes it may see (bit j: node j; its ancestors and itself). Keys
    before a tree stay visible as usual; a query sees a node only if its bit is set.

    Latent attention (DeepSeek's): v_pages None at `validate` means V is K, one pool read
    as both (v_scales None too: K's scales); `shared_kv` says so, and the TPU kernel then
    copies each page once, not as K and again as V.

    Images seen whole (Gemma 3: bidirectional attention among an image's tokens):
    image_end `[T]` int32, for a query inside an image the position of that image's last
    token, which it sees with every token of the image before it (the rest of the step
    writes them first); -1 elsewhere. A sliding window still counts back from the query.

    Attention sinks (gpt-oss): sinks `[num_q_heads]` float32, a learned logit per query
    head that joins every row's softmax as one more term of its denominator, with no value
    (the row's weights sum to less than one); None without. Every backend starts its
    online softmax from it (running max = the sink, sum = 1, output 0), so a row's result
    is `sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))` of the scores s as the sink's
    (after sm_scale and any soft-cap).
    """

    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    k_scales: jax.Array | None
    v_scales: jax.Array | None
    tree_start: jax.Array | None
    tree_mask: jax.Array | None
    sm_scale: float = dataclasses.field(metadata=dict(static=True))
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    soft_cap: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    image_end: jax.Array | None = None
    sinks: jax.Array | None = None
    shared_kv: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[0]

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q.shape[1] // self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def max_seqs(self) -> int:
        return self.page_indices.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.page_indices.shape[1]

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None

    @property
    def tree(self) -> bool:
        return self.tree_mask is not None

    @classmethod
    def validate(cls, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                 sm_scale: float, sliding_window: int | None = None,
                 soft_cap: float | None = None, k_scales=None, v_scales=None,
                 tree_start=None, tree_mask=None, image_end=None,
                 sinks=None) -> "AttentionInputs":
        """The inputs as arrays, or a ValueError saying which shape or dtype is wrong."""
        shared_kv = v_pages is None
        if shared_kv:
            if v_scales is not None:
                raise ValueError("ragged_paged_attention: v_pages None (V is K) takes K's "
                                 "scales; pass no v_scales")
            v_pages, v_scales = k_pages, k_scales
        args = [jnp.asarray(a) for a in (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                         num_seqs)]
        optional = [None if a is None else jnp.asarray(a)
                    for a in (k_scales, v_scales, tree_start, tree_mask)]
        x = cls(*args, *optional, sm_scale=sm_scale, sliding_window=sliding_window,
                soft_cap=soft_cap, image_end=None if image_end is None else jnp.asarray(image_end),
                sinks=None if sinks is None else jnp.asarray(sinks), shared_kv=shared_kv)
        _check(x)
        return x


def _check(x: AttentionInputs) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"ragged_paged_attention: {what}")

    need(x.q.ndim == 3, f"q must be [tokens, q_heads, head_dim], got {x.q.shape}")
    need(x.k_pages.ndim == 4 and x.k_pages.shape == x.v_pages.shape
         and x.k_pages.dtype == x.v_pages.dtype,
         f"k_pages and v_pages must be [kv_heads, pages, page_size, head_dim] of one shape and "
         f"dtype, got {x.k_pages.shape} {x.k_pages.dtype} and {x.v_pages.shape} "
         f"{x.v_pages.dtype}")
    need(x.k_pages.shape[3] == x.head_dim,
         f"head_dim of q ({x.head_dim}) and of the pages ({x.k_pages.shape[3]}) differ")
    need(x.q.shape[1] % x.num_kv_heads == 0,
         f"q_heads ({x.q.shape[1]}) must be a multiple of kv_heads ({x.num_kv_heads})")
    s = x.max_seqs
    for name, a, shape in (("kv_lens", x.kv_lens, (s,)), ("cu_q_lens", x.cu_q_lens, (s + 1,)),
                           ("num_seqs", x.num_seqs, ())):
        need(a.shape == shape and a.dtype == jnp.int32,
             f"{name} must be int32 {list(shape)} for page_indices of {s} sequences, got "
             f"{a.dtype} {list(a.shape)}")
    need(x.page_indices.ndim == 2 and x.page_indices.dtype == jnp.int32,
         f"page_indices must be int32 [seqs, pages_per_seq], got {x.page_indices.dtype} "
         f"{x.page_indices.shape}")
    quantized = x.k_pages.dtype.name in QUANTIZED_KV_MAX
    need((x.k_scales is None) == (x.v_scales is None) and quantized == x.quantized,
         f"a {x.k_pages.dtype} cache needs {'both' if quantized else 'no'} k_scales and "
         f"v_scales")
    if x.quantized:
        for name, a in (("k_scales", x.k_scales), ("v_scales", x.v_scales)):
            need(a.shape == x.k_pages.shape[:3] and a.dtype == jnp.float32,
                 f"{name} must be float32 {list(x.k_pages.shape[:3])}, got {a.dtype} "
                 f"{list(a.shape)}")
    need(x.sliding_window is None or x.sliding_window > 0,
         f"sliding_window must be positive, got {x.sliding_window}")
    need((x.tree_start is None) == (x.tree_mask is None),
         "a tree needs both tree_start and tree_mask")
    if x.tree:
        for name, a, shape in (("tree_start", x.tree_start, (s,)),
                               ("tree_mask", x.tree_mask, (x.num_tokens,))):
            need(a.shape == shape and a.dtype == jnp.int32,
                 f"{name} must be int32 {list(shape)}, got {a.dtype} {list(a.shape)}")
    if x.image_end is not None:
        need(x.image_end.shape == (x.num_tokens,) and x.image_end.dtype == jnp.int32,
             f"image_end must be int32 [{x.num_tokens}], got {x.image_end.dtype} "
             f"{list(x.image_end.shape)}")
    if x.sinks is not None:
        need(x.sinks.shape == (x.q.shape[1],) and x.sinks.dtype == jnp.float32,
             f"sinks must be float32 [{x.q.shape[1]}] (one per query head), got "
             f"{x.sinks.dtype} {list(x.sinks.shape)}")


def sink_rows(x: AttentionInputs, rows: int) -> jax.Array:
    """The sink of each row of a KV head's tile, `[num_kv_heads, rows]` float32 (row r:
    query head `head * group + r % group`), where a backend's online softmax starts;
    MASKED without sinks."""
    if x.sinks is None:
        return jnp.full((x.num_kv_heads, rows), MASKED, jnp.float32)
    heads = x.sinks.reshape(x.num_kv_heads, x.group)
    return heads[:, jnp.arange(rows) % x.group]


MAX_TREE_NODES = 32  # bits of an int32 tree_mask


def tree_visible(k_pos: jax.Array, tree_start: jax.Array, tree_mask: jax.Array) -> jax.Array:
    """Whether keys at `k_pos` are visible to queries of `tree_mask` in a sequence whose
    tree starts at `tree_start` (broadcasting): before the tree, always; node j, when bit
    j of the mask is set. Causality and windows are the caller's."""
    node = k_pos - tree_start
    bit = jnp.right_shift(tree_mask, jnp.clip(node, 0, MAX_TREE_NODES - 1)) & 1  # bit 31 too
    return (node < 0) | ((bit == 1) & (node < MAX_TREE_NODES))


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


    @property
    def num_items(self) -> int:
        return self.seq.shape[0]

    @property
    def queries_per_item(self) -> int:
        return self.token.shape[1]

    def num_real(self) -> jax.Array:
        """Items with queries (they come first)."""
        return jnp.sum(self.num_q > 0).astype(jnp.int32)

    def max_kv_len(self) -> jax.Array:
        return jnp.max(self.kv_len)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """How a backend walks the batch: its decode and prefill items and the page table
    padded to whole blocks of `pages_per_block` pages (padded entries are masked by
    kv_lens)."""

    decode: WorkItems  # [S] items of one query
    prefill: WorkItems  # [W] items of up to queries_per_block queries
    page_indices: jax.Array  # [S, num_blocks * pages_per_block]
    pages_per_block: int

    @property
    def num_blocks(self) -> int:
        """KV blocks of a full page table."""
        return self.page_indices.shape[1] // self.pages_per_block

    @property
    def kinds(self) -> tuple[WorkItems, WorkItems]:
        return self.decode, self.prefill


def plan_blocks(x: AttentionInputs, queries_per_block: int, pages_per_block: int) -> BlockPlan:
    """The plan every backend follows, given the block sizes its own rules chose."""
    num_blocks = -(-x.pages_per_seq // pages_per_block)
    page_indices = jnp.pad(x.page_indices,
                           ((0, 0), (0, num_blocks * pages_per_block - x.pages_per_seq)))
    decode, prefill = work_items(x.cu_q_lens, x.kv_lens, x.num_seqs, x.num_tokens,
                                 queries_per_block)
    return BlockPlan(decode, prefill, page_indices, pages_per_block)


MAX_QUERIES_PER_ITEM = 32


def default_queries_per_block(num_tokens: int, cap: int = MAX_QUERIES_PER_ITEM) -> int:
    """Queries per prefill item: up to 32, never more than the batch has."""
    return max(1, min(cap, num_tokens))


def num_prefill_items(num_tokens: int, max_seqs: int, bq: int) -> int:
    """Enough prefill items for any ragged batch of T tokens over S sequences: each
    sequence with q >= 2 new tokens takes ceil(q / bq) <= q / bq + 1 items, and at most
    min(S, T // 2) sequences have two or more."""
    return max(1, min(num_tokens, num_tokens // bq + min(max_seqs, num_tokens // 2)))


def work_items(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array,
               num_tokens: int, bq: int) -> tuple[WorkItems, WorkItems]:
    """(decode items, prefill items) of a ragged batch; see the module docstring."""
    max_seqs = kv_lens.shape[0]
    seq_valid = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(seq_valid, kv_lens, 0)

    # Decode items: slot s, real when s has one query. Compacted to the front.
    is_decode = q_lens == 1
    order = jnp.argsort(~is_decode, stable=True).astype(jnp.int32)  # decodes first
    real = is_decode[order]
    decode = WorkItems(
        seq=order, q_pos=jnp.where(real, kv_lens[order] - 1, 0).astype(jnp.int32),
        num_q=real.astype(jnp.int32), kv_len=jnp.where(real, kv_lens[order], 0),
        token=jnp.where(real, cu_q_lens[order], num_tokens)[:, None].astype(jnp.int32))

    # Prefill items: blocks of bq queries of every sequence with two or more.
    num_items = num_prefill_items(num_tokens, max_seqs, bq)
    items_per_seq = jnp.where(q_lens >= 2, (q_lens + bq - 1) // bq, 0)
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
    return decode, WorkItems(seq, q_pos, num_q, kv_len, token)


def issued_rows(plan: BlockPlan, group: int) -> tuple[jax.Array, jax.Array]:
    """(query rows, items) the backends compute for this plan: every real item's rows
    (`queries_per_item * group`), empty items none. What a step's attention costs."""
    rows = sum(k.num_real() * k.queries_per_item * group for k in plan.kinds)
    return rows, sum(k.num_real() for k in plan.kinds)


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


def gather_tree_masks(x: AttentionInputs, items: WorkItems, rows: int | None = None
                      ) -> jax.Array:
    """Each item's rows' tree masks, `[W, rows]` laid out as gather_queries lays out the
    rows (row `i * group + g`: query i's); padding rows and rows past `bq * group` get 0."""
    mask = jnp.repeat(x.tree_mask[jnp.minimum(items.token, x.num_tokens - 1)], x.group, axis=1)
    if rows is not None and rows > mask.shape[1]:
        mask = jnp.pad(mask, ((0, 0), (0, rows - mask.shape[1])))
    return mask


def gather_image_ends(x: AttentionInputs, items: WorkItems, rows: int | None = None
                      ) -> jax.Array:
    """Each item's rows' image ends, `[W, rows]` laid out as gather_queries lays out the
    rows; -1 for padding rows and rows past `bq * group`."""
    ends = x.image_end[jnp.minimum(items.token, x.num_tokens - 1)]
    ends = jnp.repeat(jnp.where(items.token < x.num_tokens, ends, -1), x.group, axis=1)
    if rows is not None and rows > ends.shape[1]:
        ends = jnp.pad(ends, ((0, 0), (0, rows - ends.shape[1])), constant_values=-1)
    return ends


def scatter_outputs(result: jax.Array, out: jax.Array, items: WorkItems, group: int
                    ) -> jax.Array:
    """Inverse of gather_queries: the items' outputs `[Hkv, W, rows, D]` written into
    their tokens' rows of `result[T, Hq, D]`; padding rows are dropped."""
    num_kv_heads, num_items, _, head_dim = out.shape
    bq = items.token.shape[1]
    out = out[:, :, : bq * group].reshape(num_kv_heads, num_items, bq, group, head_dim)
    out = out.transpose(1, 2, 0, 3, 4).reshape(num_items * bq, num_kv_heads * group, head_dim)
    # Each real query belongs to exactly one item row; padding rows point past the end.
    return result.at[items.token.reshape(-1)].set(out.astype(result.dtype), mode="drop")
