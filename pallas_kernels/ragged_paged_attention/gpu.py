"""Ragged paged attention as a Pallas GPU kernel (Triton lowering).

Same inputs, page layout and work items as reference.py (see work_items.py). One kernel
call per kind of item (decode items, then prefill items; a kind with no real item is
skipped), each with grid (KV head, work item[, KV split]); an empty item computes nothing.
A program holds one item's queries for one KV head,
the `group` query heads of that KV head packed as rows of one `[rows, head_dim]` tile
(GQA), and walks the item's sequence one block of `pages_per_block` pages at a time with
an online softmax in float32. Triton has no scalar prefetch and no DMA: the item metadata
and the page table are plain operands read with scalar loads, and each block's K and V
`[pages_per_block * page_size, head_dim]` tiles are gathered token by token, each key's
page number read from the page table, so pages smaller than a Triton tile (4 or 8
tokens) still make one key tile. Blocks wholly before the sliding window or past the item's
last query are skipped. A quantized cache (int8 / fp8) is loaded as stored and converted to
q's dtype in registers: the per-token K scales multiply the scores, the V scales the
probabilities. Speculative trees: each item's tree start and its rows' tree masks are
operands too, masking the scores beside causality. Images whose tokens see each other
(Gemma 3): each row's image end is an operand, the last key it sees the later of its own
position and that end, and an item walks its blocks up to its rows' latest image end.
Dots take q's dtype with float32 accumulation (bf16 probabilities before P·V when q is
bf16; IEEE float32, not Triton's TF32 default, when q is float32).

Block-size rule (no device query, so it is the same when lowering ahead of time). Triton
tensors are powers of two and its dot needs every dimension >= 16:
- queries per item: 1 for decode items; for prefill items min(32, T), the reference's
  rule, capped so queries * group <= 128 (the flash-attention query tile: a 256-row
  float32 accumulator and score tile would spill Triton's registers); rows = queries *
  group rounded up to a power of two >= 16 (a decode item of Llama-3-8B, group 4, fills 4
  of 16 rows: decode is memory-bound, the idle rows are free).
- KV tokens per block: the kind's tile in TUNED (128, the flash-attention key tile, for
  prefill items and 8-bit caches; 64 for bf16 decode items), i.e. `pages_per_block =
  tile // page_size`, capped at the page table's width rounded up to a power of two and
  raised to at least 16 tokens. The page table is padded to whole 128-token blocks; a
  64-token kind walks it in half blocks.
Both are keyword-overridable; compiled (not interpreted) kernels need `pages_per_block *
page_size` and `head_dim` to be powers of two >= 16 (ValueError otherwise).

Split-KV (flash decoding). With few programs (a small decode batch) most of the GPU's
132 SMs (H100 / H200 SXM) would idle while each program walks a long context alone. Then
each item's blocks are divided into `num_kv_splits` contiguous, equal ranges, one program
per (KV head, item, split), each writing its unnormalised float32 partial (max score m,
softmax sum l, accumulator) for a log-sum-exp combine in plain XLA afterwards. An empty
split (an item with fewer blocks than splits) writes m = MASKED, l = 0, acc = 0, which the
combine weighs by exp(MASKED - m_max) = 0, or, for a row no split sees, divides by 1.
Default rule, per call: splits = clamp(ceil(132 / (num_kv_heads * items)), 1, KV blocks of
the page table), so a call that already fills the SMs is not split; it is the same on CPU,
so tests pass `num_kv_splits` explicitly to exercise the path.

Launch defaults: num_warps 4 for tiles of up to 32 rows (decode), 8 for the larger prefill
tiles (JAX's flash attention uses 8 for its 128-row tiles at head_dim 128); num_stages per
TUNED (2, or 4 for 8-bit decode). The key tiles and stages were chosen on an H100 by
benchmarks/gpu_attention_sweep.py; the table beside TUNED holds what it measured.

Not fused: writing the new tokens' K/V stays a separate XLA scatter (kv_cache.write_kv).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.kv_cache import BITS
from pallas_kernels.ragged_paged_attention.work_items import (
    MASKED, AttentionInputs, WorkItems, default_queries_per_block, gather_queries,
    gather_image_ends, gather_tree_masks, plan_blocks, scatter_outputs, sink_rows,
    tree_visible, visible_blocks)
from pallas_kernels.tiling import is_power_of_2, next_power_of_2

MIN_TILE = 16  # smallest dimension Triton's dot accepts
MAX_ROWS = 128  # query rows (queries x group) per program
NUM_SMS = 132  # H100 / H200 SXM


@dataclasses.dataclass(frozen=True)
class Launch:
    kv_tokens_per_block: int  # the key tile
    num_stages: int


# Launch choices per kind of work item and cache, measured on an H100 80GB HBM3 by
# benchmarks/gpu_attention_sweep.py (2026-11-25, jax 0.11.2, Llama-3-8B layer shapes,
# 16-token pages; benchmarks/history/2026-11-21-to-29.md "GPU bring-up on an H100").
# num_warps: 4 for tiles of up to 32 query rows (every decode item), 8 above (default_num_warps).
#   decode, bf16 K/V   64 x 2048: 64-token tiles 0.318 ms (73% of the copy bandwidth);
#                      128-token tiles 0.355; 3 stages 0.332
#   decode, 8-bit K/V  64 x 2048: 4 stages 0.314 ms; 2 stages 0.400
#   prefill            512 at 512: 128-token tiles, 8 warps 0.089 ms; 64-token tiles 0.098
TUNED = {("decode", False): Launch(64, 2), ("decode", True): Launch(128, 4),
         ("prefill", False): Launch(128, 2), ("prefill", True): Launch(128, 2)}


def default_gpu_queries_per_block(num_tokens: int, group: int) -> int:
    """The reference's rule for prefill items, capped at MAX_ROWS query rows (see module
    doc)."""
    return max(1, min(default_queries_per_block(num_tokens), MAX_ROWS // group))


def default_pages_per_block(page_size: int, pages_per_seq: int, kv_tokens: int = 128) -> int:
    """Pages whose tokens make a power-of-two key tile of 16 to `kv_tokens` tokens (see
    module doc)."""
    pages = min(max(1, kv_tokens // page_size), next_power_of_2(pages_per_seq))
    return max(pages, -(-MIN_TILE // page_size))


def default_num_kv_splits(num_programs: int, num_blocks: int, num_sms: int = NUM_SMS) -> int:
    """Enough KV splits for `num_programs` (KV heads x items) to fill the SMs, never more
    than the KV blocks of a full page table."""
    return max(1, min(-(-num_sms // num_programs), num_blocks))


def default_num_warps(rows: int) -> int:
    return 4 if rows <= 32 else 8


def _check_tiles(block_tokens: int, head_dim: int) -> None:
    fixes = {"pages_per_block * page_size": "pass a pages_per_block that makes one",
             "head_dim": "use impl='reference' for this model"}
    for name, size in (("pages_per_block * page_size", block_tokens), ("head_dim", head_dim)):
        if not (is_power_of_2(size) and size >= MIN_TILE):
            raise ValueError(f"{name} is {size}, but the GPU kernel's Triton tiles need a power "
                             f"of two >= {MIN_TILE}: {fixes[name]}")


def _kernel(seq_ref, q_pos_ref, num_q_ref, kv_len_ref,  # [W] each: item metadata
            table_ref,  # [S, num_blocks * pages_per_block]: the padded page table
            q_ref,  # [rows, head_dim]: this item's queries of this KV head
            k_ref, v_ref,  # [num_pages, page_size, head_dim]: this KV head's pages
            *rest, sm_scale, sliding_window, soft_cap, group, pages_per_block, quantized,
            num_splits, tree, images, sinks):
    # rest: ts_ref [W] and tm_ref [rows] (each item's tree start and its rows' tree masks,
    # trees only), ie_ref [rows] (its rows' image ends, -1 outside images; images only),
    # ks_ref, vs_ref [num_pages, page_size] (this head's scales, quantized caches only),
    # sink_ref [rows] (each row's sink, sinks only), then the outputs: o_ref [rows,
    # head_dim], or with KV splits acc_ref [rows, head_dim] and m_ref, l_ref [rows] (this
    # split's unnormalised partials, f32).
    if tree:
        ts_ref, tm_ref, *rest = rest
    if images:
        ie_ref, *rest = rest
    if quantized:
        ks_ref, vs_ref, *rest = rest
    if sinks:
        sink_ref, *rest = rest
    out_refs = rest
    w = pl.program_id(1)
    rows, head_dim = q_ref.shape
    num_pages, page_size = k_ref.shape[0], k_ref.shape[1]
    block_tokens = pages_per_block * page_size
    seq, q_pos, num_q, kv_len = seq_ref[w], q_pos_ref[w], num_q_ref[w], kv_len_ref[w]

    first, last = visible_blocks(q_pos, num_q, kv_len, block_tokens, sliding_window)
    row_pos = q_pos + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) // group
    row_last = row_pos  # the last key a row sees: itself, or the end of its image
    if images:  # an image may end past the item's last query
        image_end = ie_ref[...]
        row_last = jnp.maximum(row_pos, image_end)
        end = jnp.minimum(kv_len, image_end.max() + 1)
        last = jnp.maximum(last, (end + block_tokens - 1) // block_tokens)
    if num_splits > 1:  # this program's contiguous share of the item's blocks
        per_split = (last - first + num_splits - 1) // num_splits
        first = jnp.minimum(first + pl.program_id(2) * per_split, last)
        last = jnp.minimum(first + per_split, last)

    q = q_ref[...]
    compute_dtype = q.dtype
    # float32 dots must be IEEE: Triton's default for float32 is TF32 (10-bit mantissa).
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    token = jax.lax.broadcasted_iota(jnp.int32, (block_tokens,), 0)
    page_in_block, row_in_page = token // page_size, token % page_size

    def body(b, carry):
        m, l, acc = carry
        # Entries past a sequence's pages may hold anything; keep every read in the pool
        # (their keys are masked by kv_len below).
        pages = jnp.minimum(table_ref[seq, b * pages_per_block + page_in_block], num_pages - 1)
        k = k_ref[pages, row_in_page, :].astype(compute_dtype)  # [block_tokens, head_dim]
        v = v_ref[pages, row_in_page, :].astype(compute_dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale
        if quantized:
            s = s * ks_ref[pages, row_in_page][None, :]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = b * block_tokens + token
        visible = (k_pos[None, :] <= row_last[:, None]) & (k_pos[None, :] < kv_len)
        if sliding_window is not None:
            visible &= k_pos[None, :] > row_pos[:, None] - sliding_window
        if tree:
            visible &= tree_visible(k_pos[None, :], ts_ref[w], tm_ref[...][:, None])
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        # A row with nothing visible yet keeps m = MASKED, where exp(s - m) would be 1: a
        # split that sees none of a row's keys must report l = 0 to the combine.
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=1)
        if quantized:
            p = p * vs_ref[pages, row_in_page][None, :]
        pv = jax.lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[:, None] + pv

    m, l = jnp.full((rows,), MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32)
    if sinks:  # the online softmax starts from the row's sink, in the first split only
        first_split = pl.program_id(2) == 0 if num_splits > 1 else True
        m = jnp.where(first_split, sink_ref[...], m)
        l = jnp.where(first_split, 1.0, l)
    init = (m, l, jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, last, body, init)
    if num_splits > 1:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l
    else:
        [o_ref] = out_refs
        o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Log-sum-exp merge of split partials `acc[..., splits, rows, D]`, `m, l[..., splits,
    rows]` into `[..., rows, D]` float32. Empty splits (m = MASKED, l = 0) weigh nothing."""
    m_max = m.max(axis=-2, keepdims=True)
    weight = jnp.exp(m - m_max)  # 0 for an empty split beside a real one; never NaN
    l_sum = (l * weight).sum(axis=-2)
    acc_sum = (acc * weight[..., None]).sum(axis=-3)
    return acc_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    """The whole array for every program (scalar metadata and the page table)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def ragged_paged_attention(x: AttentionInputs, *, pages_per_block: int | None = None,
                           queries_per_block: int | None = None, interpret: bool = False,
                           num_kv_splits: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None) -> jax.Array:
    """See reference.ragged_paged_attention; `interpret=True` runs on CPU. `num_kv_splits`,
    `num_warps` and `num_stages` override the rules in the module docstring."""
    if x.k_pages.dtype == BITS:
        raise ValueError("the GPU kernel reads bf16 pages, not their uint16 bits "
                         "(kv_cache.pool_dtype keeps bits only for the reference and cpu)")
    # The plan's blocks are the largest tile; a kind with a smaller one (TUNED) walks the
    # same padded page table in halves or quarters of them.
    block = pages_per_block or default_pages_per_block(x.page_size, x.pages_per_seq)
    if not interpret:
        _check_tiles(block * x.page_size, x.head_dim)
    plan = plan_blocks(
        x, queries_per_block or default_gpu_queries_per_block(x.num_tokens, x.group), block)
    out = jnp.zeros(x.q.shape, x.q.dtype)
    for kind, items in zip(("decode", "prefill"), plan.kinds):
        launch = TUNED[kind, x.quantized]
        kind_block = pages_per_block or min(block, default_pages_per_block(
            x.page_size, x.pages_per_seq, launch.kv_tokens_per_block))
        if block % kind_block:
            kind_block = block
        rows = max(MIN_TILE, next_power_of_2(items.queries_per_item * x.group))
        num_blocks = plan.num_blocks * (block // kind_block)
        splits = num_kv_splits or default_num_kv_splits(x.num_kv_heads * items.num_items,
                                                        num_blocks)
        # Launched even when no item of the kind is real (its programs end at once): a
        # lax.cond on num_real() would be two waits for the device per layer, XLA:GPU
        # copying each predicate to the host (jaxserve/engine/runner.py, branch_free).
        result = _call(x, plan.page_indices, items, kind_block, rows, splits, interpret,
                       num_warps or default_num_warps(rows), num_stages or launch.num_stages)
        out = scatter_outputs(out, result, items, x.group)
    return out


def _call(x: AttentionInputs, page_indices: jax.Array, items: WorkItems, pages_per_block: int,
          rows: int, splits: int, interpret: bool, num_warps: int, num_stages: int
          ) -> jax.Array:
    """One kernel call over one kind of item: `[Hkv, W, rows, head_dim]` in q's dtype."""
    num_kv_heads, page_size, head_dim = x.num_kv_heads, x.page_size, x.head_dim
    num_pages, num_items = x.k_pages.shape[1], items.num_items
    qi = gather_queries(x.q, items, num_kv_heads, rows)  # [Hkv, W, rows, D]
    pages_spec = pl.BlockSpec((None, num_pages, page_size, head_dim),
                              lambda h, *_: (h, 0, 0, 0))
    in_specs = [_whole((num_items,))] * 4 + [
        _whole(page_indices.shape),
        pl.BlockSpec((None, None, rows, head_dim), lambda h, w, *_: (h, w, 0, 0)),
        pages_spec, pages_spec]
    operands = [items.seq, items.q_pos, items.num_q, items.kv_len, page_indices,
                qi, x.k_pages, x.v_pages]
    if x.tree:  # each item's tree start, each row's tree mask
        in_specs += [_whole((num_items,)), pl.BlockSpec((None, rows), lambda h, w, *_: (w, 0))]
        operands += [x.tree_start[items.seq], gather_tree_masks(x, items, rows)]
    if x.image_end is not None:  # each row's image end
        in_specs.append(pl.BlockSpec((None, rows), lambda h, w, *_: (w, 0)))
        operands.append(gather_image_ends(x, items, rows))
    if x.quantized:
        scales_spec = pl.BlockSpec((None, num_pages, page_size), lambda h, *_: (h, 0, 0))
        in_specs += [scales_spec, scales_spec]
        operands += [x.k_scales, x.v_scales]
    if x.sinks is not None:  # each row's sink, [Hkv, rows]
        in_specs.append(pl.BlockSpec((None, rows), lambda h, *_: (h, 0)))
        operands.append(sink_rows(x, rows))
    if splits > 1:
        grid = (num_kv_heads, num_items, splits)
        out_shape = [
            jax.ShapeDtypeStruct((num_kv_heads, num_items, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_heads, num_items, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_heads, num_items, splits, rows), jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), lambda h, w, s: (h, w, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda h, w, s: (h, w, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda h, w, s: (h, w, s, 0))]
    else:
        grid = (num_kv_heads, num_items)
        out_shape = jax.ShapeDtypeStruct((num_kv_heads, num_items, rows, head_dim), x.q.dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda h, w: (h, w, 0, 0))

    kernel = functools.partial(
        _kernel, sm_scale=x.sm_scale, sliding_window=x.sliding_window, soft_cap=x.soft_cap,
        group=x.group, pages_per_block=pages_per_block, quantized=x.quantized,
        num_splits=splits, tree=x.tree, images=x.image_end is not None,
        sinks=x.sinks is not None)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*operands)
    return combine_splits(*out).astype(x.q.dtype) if splits > 1 else out
