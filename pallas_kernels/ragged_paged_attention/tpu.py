"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same signature, page layout and work items as reference.py (see work_items.py). The grid
is (KV head, work item). A program holds one item's queries for one KV head, the `group`
query heads of that KV head packed as rows of one `[rows, head_dim]` tile (GQA), and walks
the item's sequence one block of pages at a time: the page table and item metadata are
scalar-prefetched into SMEM, each page of the next block is copied HBM → VMEM by an async
DMA while the current block is being computed (two buffers), and an online softmax
accumulates in float32. Decode, prefill chunks and mixed batches are the same program with
different item sizes. A quantized cache (int8 / fp8) is copied as stored and dequantized
in VMEM: the per-token K scales multiply the scores, the V scales the probabilities.

Block-size rule (no device query, so it is the same when compiling ahead of time):
- queries per item `bq`: T // S capped at 32 (1 for a pure decode batch), the reference's
  rule; rows = bq * group rounded up to the sublane tile of q's dtype (8 f32, 16 bf16).
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

from pallas_kernels.ragged_paged_attention.reference import MASKED
from pallas_kernels.ragged_paged_attention.work_items import (
    default_queries_per_block, gather_queries, scatter_outputs, visible_blocks, work_items)

KV_TOKENS_PER_BLOCK = 512


def sublane_tile(dtype) -> int:
    """Rows of a TPU vreg tile for this dtype: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 32 // jnp.dtype(dtype).itemsize


def default_pages_per_block(page_size: int, pages_per_seq: int) -> int:
    return max(1, min(pages_per_seq, KV_TOKENS_PER_BLOCK // page_size))


def _kernel(seq_ref, q_pos_ref, num_q_ref, kv_len_ref, pages_ref,  # scalar prefetch (SMEM)
            q_ref, k_hbm, v_hbm, *rest, sm_scale, sliding_window, soft_cap, group,
            pages_per_block, quantized):
    if quantized:
        ks_ref, vs_ref, o_ref, k_buf, v_buf, sems = rest
    else:
        o_ref, k_buf, v_buf, sems = rest
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
            out.append(pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, dst], sems.at[1, slot]))
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
        v = v_buf[slot].astype(compute_dtype)
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

    init = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, last, body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


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
    interpret: bool = False,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """See reference.ragged_paged_attention; `interpret=True` runs on CPU."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    quantized = k_scales is not None
    if not interpret and page_size % sublane_tile(k_pages.dtype):
        raise ValueError(f"page_size {page_size} is not a multiple of {sublane_tile(k_pages.dtype)}"
                         f", the TPU tile height of {k_pages.dtype} KV pages")
    bq = queries_per_block or default_queries_per_block(num_tokens, max_seqs)
    block = pages_per_block or default_pages_per_block(page_size, pages_per_seq)
    num_blocks = -(-pages_per_seq // block)
    page_indices = jnp.pad(page_indices, ((0, 0), (0, num_blocks * block - pages_per_seq)))
    rows = -(-bq * group // sublane_tile(q.dtype)) * sublane_tile(q.dtype)

    items = work_items(cu_q_lens, kv_lens, num_seqs, num_tokens, bq)
    num_items = items.seq.shape[0]
    qi = gather_queries(q, items, num_kv_heads, rows)  # [Hkv, W, rows, D]
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda h, w, *_: (h, w, 0, 0))
    in_specs = [q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    operands = [qi, k_pages, v_pages]
    if quantized:
        # Each sequence's scales, gathered once per layer by XLA into one lane-dense row
        # per (head, sequence): 4 bytes per token and head next to head_dim bytes of values.
        width = num_blocks * block * page_size
        for scales in (k_scales, v_scales):
            operands.append(scales[:, page_indices].reshape(num_kv_heads, max_seqs, 1, width))
            in_specs.append(pl.BlockSpec((None, None, 1, width),
                                         lambda h, w, seq, *_: (h, seq[w], 0, 0)))
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        group=group, pages_per_block=block, quantized=quantized)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_kv_heads, num_items),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, block * page_size, head_dim), k_pages.dtype),
                pltpu.VMEM((2, block * page_size, head_dim), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, num_items, rows, head_dim), q.dtype),
        interpret=interpret,
        name="ragged_paged_attention",
    )(items.seq, items.q_pos, items.num_q, items.kv_len, page_indices, *operands)
    return scatter_outputs(out, items, num_tokens, group, q.dtype)
