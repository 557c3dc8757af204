"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same inputs, page layout and work items as reference.py (see work_items.py). One kernel
call per kind of item (decode items, then prefill items; a kind with no real item is
skipped), each with grid (KV head, work item). A program holds one item's queries for one
KV head, the `group` query heads of that KV head packed as rows of one `[rows, head_dim]`
tile (GQA), and walks the item's sequence one block of pages at a time: the page table and
item metadata are scalar-prefetched into SMEM, each page of the next block is copied HBM →
VMEM by an async DMA while the current block is being computed (two buffers), and an
online softmax accumulates in float32. An empty item fetches and computes nothing. A
quantized cache (int8 / fp8) is copied as stored and dequantized in VMEM: the per-token K
scales multiply the scores, the V scales the probabilities. Speculative trees: each item's
tree start is scalar-prefetched too, and its rows' tree masks come as a `[rows, 1]` VMEM
block that masks the scores beside causality.

Block-size rule (no device query, so it is the same when compiling ahead of time):
- queries per item: 1 for decode items, min(32, T) for prefill items (the reference's
  rule); rows = queries * group rounded up to the sublane tile of q's dtype (8 f32, 16
  bf16).
- KV tokens per block: 512 (4 MXU passes of 128 keys on v5e, 2 of 256 on v6e), i.e.
  `pages_per_block = 512 // page_size`, capped at the page table's width.
  VMEM: 2 buffers x (K + V) x 512 x head_dim plus a `[rows, 512]` f32 score tile, well
  under 1 MiB for head_dim 128.
Both are keyword-overridable. On a real TPU, `page_size` must be a multiple of the KV
dtype's sublane tile (16 for bf16, 32 for int8/fp8) so every page DMA is tile-aligned,
and quantized caches need `pages_per_block * page_size` to be a multiple of 128 so the
per-token scales are lane-aligned.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.kv_cache import BITS
from pallas_kernels.ragged_paged_attention.work_items import (
    MASKED, AttentionInputs, BlockPlan, WorkItems, default_queries_per_block, gather_queries,
    gather_tree_masks, plan_blocks, scatter_outputs, sink_rows, tree_visible, visible_blocks)
from pallas_kernels.tiling import round_up, sublane_tile

KV_TOKENS_PER_BLOCK = 512


def default_pages_per_block(page_size: int, pages_per_seq: int) -> int:
    return max(1, min(pages_per_seq, KV_TOKENS_PER_BLOCK // page_size))


def _kernel(seq_ref,  # [W] SMEM (scalar prefetch): each item's sequence
            q_pos_ref,  # [W] SMEM: position of the item's first query
            num_q_ref,  # [W] SMEM: real queries of the item (0: empty)
            kv_len_ref,  # [W] SMEM: the item's sequence's context length
            pages_ref,  # [S, num_blocks * pages_per_block] SMEM: the padded page table
            *rest, sm_scale, sliding_window, soft_cap, group, pages_per_block, quantized,
            tree, shared, sinks):
    # rest: tree_start_ref [W] SMEM (scalar prefetch: the item's sequence's tree start,
    # trees only); q_ref [rows, head_dim] VMEM: this item's queries of this KV head;
    # k_hbm, v_hbm [Hkv, num_pages, page_size, head_dim] HBM (memory_space=ANY); tm_ref
    # [rows, 1] VMEM (each row's tree mask, trees only); ks_ref, vs_ref [1, num_blocks *
    # block_tokens] VMEM (this head's and sequence's per-token scales, quantized caches
    # only); sink_ref [rows, 1] VMEM (each row's sink, sinks only); o_ref [rows, head_dim]
    # VMEM; k_buf, v_buf [2, block_tokens, head_dim] VMEM
    # double buffers; sems [2 (K/V), 2 (buffer)] DMA. `shared` (latent attention: V is
    # K): no v_hbm, vs_ref nor v_buf; each page is copied once and read as both.
    rest = list(rest)
    tree_start_ref = rest.pop(0) if tree else None
    q_ref, k_hbm = rest.pop(0), rest.pop(0)
    v_hbm = k_hbm if shared else rest.pop(0)
    tm_ref = rest.pop(0) if tree else None
    if quantized:
        ks_ref = rest.pop(0)
        vs_ref = ks_ref if shared else rest.pop(0)
    sink_ref = rest.pop(0) if sinks else None
    o_ref, k_buf = rest.pop(0), rest.pop(0)
    v_buf = k_buf if shared else rest.pop(0)
    (sems,) = rest
    h, w = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    page_size = k_hbm.shape[2]
    num_pages = k_hbm.shape[1]
    block_tokens = pages_per_block * page_size
    seq, q_pos, num_q, kv_len = seq_ref[w], q_pos_ref[w], num_q_ref[w], kv_len_ref[w]

    first, last = visible_blocks(q_pos, num_q, kv_len, block_tokens, sliding_window)

    def copies(b, slot):
        out = []
        for i in range(pages_per_block):
            page = jnp.minimum(pages_ref[seq, b * pages_per_block + i], num_pages - 1)
            dst = pl.ds(i * page_size, page_size)
            out.append(pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot, dst], sems.at[0, slot]))
            if not shared:
                out.append(pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, dst],
                                                 sems.at[1, slot]))
        return out

    @pl.when(first < last)
    def _():
        for c in copies(first, 0):
            c.start()

    q = q_ref[...]
    compute_dtype = q.dtype
    row_pos = q_pos + jax.lax.broadcasted_iota(jnp.int32, (rows, block_tokens), 0) // group
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, block_tokens), 1)

    def body(b, carry):
        m, l, acc = carry
        slot = (b - first) % 2
        for c in copies(b, slot):
            c.wait()

        @pl.when(b + 1 < last)
        def _():
            for c in copies(b + 1, 1 - slot):
                c.start()

        k = k_buf[slot].astype(compute_dtype)
        v = k if shared else v_buf[slot].astype(compute_dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * sm_scale
        start = pl.multiple_of(b * block_tokens, block_tokens)
        if quantized:
            s = s * ks_ref[:, pl.ds(start, block_tokens)]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = start + col
        visible = (k_pos <= row_pos) & (k_pos < kv_len)
        if sliding_window is not None:
            visible &= k_pos > row_pos - sliding_window
        if tree:
            visible &= tree_visible(k_pos, tree_start_ref[w], tm_ref[...])
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=1, keepdims=True)
        if quantized:
            p = p * vs_ref[:, pl.ds(start, block_tokens)]
        pv = jax.lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        return m_new, l, acc * correction + pv

    # The online softmax starts from the row's sink (work_items.AttentionInputs), if any.
    if sinks:
        start = (sink_ref[...], jnp.ones((rows, 1), jnp.float32))
    else:
        start = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    init = (*start, jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, last, body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def ragged_paged_attention(x: AttentionInputs, *, pages_per_block: int | None = None,
                           queries_per_block: int | None = None, interpret: bool = False,
                           vmem_limit_bytes: int | None = None) -> jax.Array:
    """See reference.ragged_paged_attention; `interpret=True` runs on CPU."""
    if x.k_pages.dtype == BITS:
        raise ValueError("the TPU kernel reads bf16 pages, not their uint16 bits "
                         "(kv_cache.pool_dtype keeps bits only for the reference and cpu)")
    if not interpret and x.page_size % sublane_tile(x.k_pages.dtype):
        raise ValueError(f"page_size {x.page_size} is not a multiple of "
                         f"{sublane_tile(x.k_pages.dtype)}, the TPU tile height of "
                         f"{x.k_pages.dtype} KV pages")
    plan = plan_blocks(
        x, queries_per_block or default_queries_per_block(x.num_tokens),
        pages_per_block or default_pages_per_block(x.page_size, x.pages_per_seq))
    scale_rows = []
    if x.quantized:
        # Each sequence's scales, gathered once per layer by XLA into one lane-dense row
        # per (head, sequence): 4 bytes per token and head next to head_dim bytes of values.
        width = plan.page_indices.shape[1] * x.page_size
        scale_rows = [s[:, plan.page_indices].reshape(x.num_kv_heads, x.max_seqs, 1, width)
                      for s in ((x.k_scales,) if x.shared_kv else (x.k_scales, x.v_scales))]
    out = jnp.zeros(x.q.shape, x.q.dtype)
    for items in plan.kinds:
        rows = round_up(items.queries_per_item * x.group, sublane_tile(x.q.dtype))
        shape = (x.num_kv_heads, items.num_items, rows, x.head_dim)
        result = jax.lax.cond(
            items.num_real() > 0,
            lambda items=items, rows=rows: _call(x, plan, items, rows, scale_rows, interpret,
                                                 vmem_limit_bytes),
            lambda shape=shape: jnp.zeros(shape, x.q.dtype))
        out = scatter_outputs(out, result, items, x.group)
    return out


def _call(x: AttentionInputs, plan: BlockPlan, items: WorkItems, rows: int,
          scale_rows: list[jax.Array], interpret: bool, vmem_limit_bytes: int | None
          ) -> jax.Array:
    """One kernel call over one kind of item: `[Hkv, W, rows, head_dim]`."""
    num_kv_heads, page_size, head_dim = x.num_kv_heads, x.page_size, x.head_dim
    block = plan.pages_per_block
    qi = gather_queries(x.q, items, num_kv_heads, rows)  # [Hkv, W, rows, D]
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda h, w, *_: (h, w, 0, 0))
    pools = (x.k_pages,) if x.shared_kv else (x.k_pages, x.v_pages)  # V is K: one pool
    in_specs = [q_spec] + [pl.BlockSpec(memory_space=pl.ANY) for _ in pools]
    prefetch, tree_rows = [], []
    if x.tree:  # the item's tree start (SMEM), each row's mask (a [rows, 1] VMEM block)
        prefetch = [x.tree_start[items.seq]]
        tree_rows = [gather_tree_masks(x, items, rows)[:, :, None]]
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda h, w, *_: (w, 0, 0)))
    in_specs += [pl.BlockSpec((None, None, 1, r.shape[-1]),
                              lambda h, w, seq, *_: (h, seq[w], 0, 0)) for r in scale_rows]
    sinks = [] if x.sinks is None else [sink_rows(x, rows)[:, :, None]]  # [Hkv, rows, 1]
    in_specs += [pl.BlockSpec((None, rows, 1), lambda h, w, *_: (h, 0, 0)) for _ in sinks]
    kernel = functools.partial(
        _kernel, sm_scale=x.sm_scale, sliding_window=x.sliding_window, soft_cap=x.soft_cap,
        group=x.group, pages_per_block=block, quantized=x.quantized, tree=x.tree,
        shared=x.shared_kv, sinks=x.sinks is not None)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5 + len(prefetch),
            grid=(num_kv_heads, items.num_items),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((2, block * page_size, head_dim), p.dtype) for p in pools]
            + [pltpu.SemaphoreType.DMA((2, 2))],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, items.num_items, rows, head_dim),
                                       x.q.dtype),
        interpret=interpret,
        name="ragged_paged_attention",
    )(items.seq, items.q_pos, items.num_q, items.kv_len, plan.page_indices, *prefetch, qi,
      *pools, *tree_rows, *scale_rows, *sinks)
