"""Ragged paged attention as a native CPU kernel (pallas_kernels/cpu/attention.h,
`jaxserve_ragged_paged_attention`).

Same inputs and result as reference.py (see work_items.py), with no gathered copies: the
kernel reads each K/V row where it lies in its page. One task is (sequence, KV head,
block of queries): the `group` query heads of that KV head are rows of one float32 tile
(GQA), so each K/V element is read once per block of queries. Tasks are handed out
largest first over XLA's intra-op threads; only real sequences and tokens cost anything,
and padding tokens are written as zeros.

A task walks its visible keys (up to its last query, from its first query's window
start) in chunks of 32 with an online softmax in float32 (a query of a speculative tree
also masks the chunk's tree nodes that are not its ancestors or itself, work_items.py),
software-prefetching the rows two chunks ahead (a page-table lookup per page, not per
key), and the first chunks of the task the thread likely takes next while this one runs;
on AVX-512 into L2, since prefetching into L1 filled its miss buffers:
- few rows (decode: up to 8 query rows): scores are 4 x 4 (1 x 16, 2 x 8) tiles of
  AVX-512 dot products; f32, bf16 and int8 rows are read in place and widened in
  registers, except that bf16 queries against bf16 pages on an AVX512_BF16 CPU use
  vdpbf16ps on the unscaled bf16 values (exact products, float32 sums; sm_scale after;
  bf16 subnormals, below 1.2e-38, count as zero there);
- many rows (prefill): the chunk's K and V are converted to float32 once, scores come from
  K^T (broadcast query element times a row of K^T, 12 rows at a time).
Attention sinks start each row's online softmax (running max = the sink, sum = 1).
P.V accumulates rows of V into the output tile, up to 8 query rows per pass. float8_e4m3fn
pages are decoded to float32 per chunk. A bf16 pool kept as its uint16 bits
(kv_cache.pool_dtype, as the engine stores it on CPU) is read as bf16. 8-bit scales multiply the scores of their keys
and the probabilities of their values, as in the reference; the output is rounded to q's
dtype once.

Block rule: about 64 query rows per task (`64 // group` queries; 1 for decode), halved
while a lone prompt would give fewer than 4 tasks per thread; `queries_per_block`
overrides it. `pages_per_block` is accepted for the common signature and ignored (the
kernel walks keys in chunks of 32 whatever the page size).

Without AVX-512 (or with a head_dim that is not a multiple of 16), an AVX2 path follows
the same plan in 8-lane vectors: 4 x 2 (1 x 8, 2 x 4) tiles of dot products for few rows,
scores from K^T (6 rows x 16 keys at a time) for many, P.V in blocks of up to 6 rows, a
polynomial exp (2.5-3x faster than the generic loops on a 2-core AVX2 EPYC,
benchmarks/history/2026-11-21-to-29.md, 2026-11-26). With neither (or a head_dim not a
multiple of 8) a generic path runs (plain C++).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as native
from pallas_kernels.ragged_paged_attention.work_items import AttentionInputs

TARGET = "jaxserve_ragged_paged_attention"
Q_DTYPES = ("float32", "bfloat16")
KV_DTYPES = ("float32", "bfloat16", "uint16", "int8", "float8_e4m3fn")  # uint16: bf16 bits


def supports(x: AttentionInputs) -> bool:
    """Whether the kernel takes these inputs (dtypes; shapes were checked by validate)."""
    return x.q.dtype.name in Q_DTYPES and x.k_pages.dtype.name in KV_DTYPES


def ragged_paged_attention(x: AttentionInputs, *, queries_per_block: int | None = None,
                           pages_per_block: int | None = None) -> jax.Array:
    """See reference.ragged_paged_attention."""
    del pages_per_block  # the kernel's key chunks do not depend on pages
    if not native.available():
        raise RuntimeError(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    if not supports(x):
        raise ValueError(f"cpu attention: q must be one of {Q_DTYPES} and the pages one of "
                         f"{KV_DTYPES}, got {x.q.dtype} and {x.k_pages.dtype}")
    no_scales, no_tree = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.q.shape, x.q.dtype))
    return call(x.q, x.k_pages, x.v_pages, x.kv_lens, x.page_indices, x.cu_q_lens,
                x.num_seqs.reshape(()),
                x.k_scales if x.quantized else no_scales,
                x.v_scales if x.quantized else no_scales,
                x.tree_start if x.tree else no_tree, x.tree_mask if x.tree else no_tree,
                no_scales if x.sinks is None else x.sinks,
                sm_scale=np.float32(x.sm_scale),
                sliding_window=np.int64(x.sliding_window or 0),
                soft_cap=np.float32(x.soft_cap or 0.0),
                queries_per_block=np.int64(queries_per_block or 0))
