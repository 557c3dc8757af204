"""Tensor, sequence and data parallelism: where the decoder's math meets the mesh.

Float weights are plain dots that XLA partitions by the parameters' shardings. What XLA
cannot partition on its own runs per device under `shard_map` here: the quantized-matmul
and attention kernels (Pallas calls are opaque to XLA), the row-split matmuls whose
partial sums are reduce-scattered over tokens under sequence parallelism, and the KV
cache's writes and reads under data parallelism (each data shard has its own page pool).
Model code (transformer.py) calls these three wrappers and never names a mesh axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.config import ModelOptions
from jaxserve.models.layers import dense_impl, is_packed, is_transposed, matmul, matmul_group
from pallas_kernels.platform import current_platform
from pallas_kernels.ragged_paged_attention import (
    default_impl, ragged_paged_attention, write_kv, write_latent)
from sharding.rules import DATA, MODEL, ShardingContext

# Logical axes of the attention's activations and of one layer's K or V pages.
Q_AXES = ("tokens", "q_heads", None)
NEW_KV_AXES = ("tokens", "cache_heads", None)
KV_CACHE_AXES = ("cache_heads", "pages", None, None)  # [heads, pages, page_size, head_dim]
RESIDUAL_AXES = ("residual", "embed")
LATENT_ROWS = 256  # query rows (queries x heads) per block of latent attention on a TPU
SEQ_AXES = ("seqs",)


def dense(x: jax.Array, w: nnx.Param, scales: nnx.Param | None, n_in: int,
          out_shape: tuple[int, ...], options: ModelOptions, shard: ShardingContext,
          scatter_tokens: bool = False, rows: jax.Array | None = None,
          perm: nnx.Param | None = None) -> jax.Array:
    """Contract the last `n_in` dims of x with a weight made by `layers.linear`.

    A float weight is one dot, which XLA partitions on a mesh; on one CPU device the
    native matmul computes only the first `rows` tokens. A quantized weight runs the
    quantized-matmul kernel; on a mesh it runs per device under shard_map: a column-split
    weight (N over `model`) needs no collective, a row-split one (K over `model`) sums its
    partial products over `model`, reduce-scattering them over tokens when
    `scatter_tokens` (sequence parallelism). Where a row-split weight's scale groups do
    not divide over the devices, the reference (dequantize and dot) runs instead and XLA
    partitions it.
    `perm` (act-order checkpoints, layers.act_order_perm) permutes x's contracted
    features first (a gather; on a mesh XLA moves a row-split x's shards as it needs).
    """
    if perm is not None:
        lead = x.shape[: x.ndim - n_in]
        x = jnp.take(x.reshape(lead + (-1,)), perm[...], axis=-1).reshape(x.shape)
    single = shard.mesh.size == 1
    if scales is None:
        return matmul(x, w[...], None, n_in, out_shape, options,
                      impl=None if single else "reference", rows=rows,
                      transposed=is_transposed(w), packed=is_packed(w))
    if single:
        return matmul(x, w[...], scales[...], n_in, out_shape, options, rows=rows,
                      packed=is_packed(w))
    w_spec, s_spec = shard.param_spec(w), shard.param_spec(scales)
    k_axis, n_axis = w_spec
    # A K split needs the scale groups split alike, whole groups on each device (int4 packs
    # each group's two halves into one byte row: even a single group must not be cut; 8-bit
    # per-channel scales, one group, hold for any split); where they do not divide
    # (ShardingContext.param_spec), XLA partitions the reference.
    int4 = w.dtype == jnp.uint8
    if k_axis is not None and (int4 or scales.shape[-2] > 1) and s_spec[-2] != k_axis:
        return matmul(x, w[...], scales[...], n_in, out_shape, options, impl="reference")
    lead = x.shape[: x.ndim - n_in]
    scatter = scatter_tokens and k_axis is not None
    tokens = shard.rules.spec(("tokens",))[0]
    out_tokens = shard.rules.spec(("residual",))[0] if scatter else tokens

    # XLA:CPU devices of one process share the native kernels' threads: the reference
    # there (as for float weights on a mesh), unless the options name a kernel.
    impl = ("reference" if options.kernel_impl in (None, "cpu") and current_platform() == "cpu"
            else None)

    def local(x2, values, scales):  # x2 [tokens, K/devices]; values [K', N/devices]
        y = matmul(x2, values, scales, 1, values.shape[1:], options, impl=impl)
        if k_axis is None:
            return y
        if scatter:
            return jax.lax.psum_scatter(y, k_axis, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, k_axis)

    y = jax.shard_map(local, mesh=shard.mesh, check_vma=False,
                      in_specs=(PartitionSpec(tokens, k_axis), w_spec, s_spec),
                      out_specs=PartitionSpec(out_tokens, n_axis)
                      )(x.reshape(math.prod(lead), -1), w[...], scales[...])
    return y.reshape(lead + out_shape)


def dense_group(x: jax.Array, weights: list[tuple[nnx.Param, nnx.Param | None, tuple[int, ...]]],
                options: ModelOptions, shard: ShardingContext, rows: jax.Array | None = None
                ) -> list[jax.Array]:
    """Several projections of the same x (q/k/v, gate/up), (weight, scales, out_shape[,
    perm]) each, as `dense` would compute them; float weights on one CPU device go to the
    native matmul in one call."""
    weights = [tuple(w) + (None,) * (4 - len(w)) for w in weights]
    if (shard.mesh.size == 1 and all(s is None for _, s, _, _ in weights)
            and dense_impl(options) == "cpu"):
        layouts = {(is_transposed(w), is_packed(w)) for w, _, _, _ in weights}
        if len(layouts) == 1:
            transposed, packed = layouts.pop()
            return matmul_group(x, [w[...] for w, _, _, _ in weights],
                                [o for _, _, o, _ in weights], rows, transposed, packed)
    return [dense(x, w, s, 1, o, options, shard, rows=rows, perm=p) for w, s, o, p in weights]


def row_parallel(x: jax.Array, w: nnx.Param, scales: nnx.Param | None, n_in: int,
                 out_shape: tuple[int, ...], options: ModelOptions, shard: ShardingContext,
                 rows: jax.Array | None = None, perm: nnx.Param | None = None) -> jax.Array:
    """A row-split matmul (o_proj, down_proj) whose result joins the residual stream
    (`perm`: as `dense`'s).

    Under sequence parallelism each device's partial sums are reduce-scattered over
    tokens (shard_map + psum_scatter over `model`): XLA left to itself all-reduces and
    then slices. That needs the tokens to divide evenly over the residual's shards (not
    the 1-token bucket); otherwise the plain matmul, whose result is all-reduced.
    """
    residual = shard.rules.spec(RESIDUAL_AXES)[0]
    sp = MODEL in ((residual,) if isinstance(residual, str) else (residual or ()))
    scatter = sp and x.shape[0] % shard.axis_size(residual) == 0
    if scales is not None:  # quantized: dense runs the kernel per device
        return dense(x, w, scales, n_in, out_shape, options, shard, scatter_tokens=scatter,
                     rows=rows, perm=perm)
    if not scatter:
        y = dense(x, w, scales, n_in, out_shape, options, shard, rows=rows)
        return shard.constrain(y, RESIDUAL_AXES)

    def partial_sums(x, w):
        return jax.lax.psum_scatter(jnp.tensordot(x, w, axes=n_in), MODEL,
                                    scatter_dimension=0, tiled=True)

    x_axes = Q_AXES if n_in == 2 else ("tokens", "mlp")
    return jax.shard_map(
        partial_sums, mesh=shard.mesh, check_vma=False,
        in_specs=(shard.rules.spec(x_axes), shard.rules.spec(w.get_metadata()["logical_axes"])),
        out_specs=shard.rules.spec(RESIDUAL_AXES))(x, w[...])


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple[jax.Array, ...],
                    meta, shard: ShardingContext, options: ModelOptions,
                    sinks: jax.Array | None = None, **kwargs
                    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Write the new tokens' K/V into the paged cache, then ragged paged attention.

    `v` None: latent attention (latent_attention.py), whose one pool (and its scales,
    quantized) is both K and V: `k` is written there, and the output is `[T, heads,
    width]` of which the caller keeps the value columns. On a TPU our kernel runs it
    reading each page once (as K and as V) with blocks of LATENT_ROWS query rows (its
    32-query default, times 32 or more heads at 576 wide, passes the 16 MiB of scoped
    VMEM); our GPU kernel's tiles take power-of-two head dims only, so the reference runs
    it there.

    `meta` is the step's AttentionMetadata; `sinks` gpt-oss's `[q_heads]` attention sinks
    (split as the query heads). Both run per shard under shard_map where XLA
    cannot partition them on its own:
    - over `data` (data parallelism): each shard's page ids and token offsets are local to
      its own page pool and tokens;
    - over `model` when a Pallas kernel runs (XLA cannot partition a kernel): each device
      takes its query heads and the cache heads they read. Where the cache is replicated
      whole (KV heads that neither divide nor are divided by the `model` size), the
      pure-JAX reference runs instead and XLA partitions it.
    """
    impl = options.kernel_impl or default_impl()
    latent = v is None
    if latent and impl == "gpu":
        impl = "reference"
    q_spec, cache_spec = shard.rules.spec(Q_AXES), shard.rules.spec(KV_CACHE_AXES)
    if shard.mesh.size > 1 and impl != "reference" and cache_spec[0] != q_spec[1]:
        impl = "reference"
    manual = set()
    if shard.data_shards > 1:
        manual.add(DATA)
    if impl != "reference" and q_spec[1] is not None:
        manual.add(q_spec[1])
    if impl != "reference" and shard.mesh.size > 1 and not manual:
        # Heads and cache replicated over `model` (ep, dp+ep): each device runs the kernel
        # on its own copy (Mosaic calls cannot be partitioned automatically).
        manual = set(shard.mesh.axis_names)
    if manual:  # a kernel must see no automatic axis, not even one of size 1
        manual |= {a for a, n in shard.mesh.shape.items() if n == 1}

    # The native CPU writer is a kernel too: only where no mesh axis is partitioned for it.
    whole = all(n == 1 or a in manual for a, n in shard.mesh.shape.items())
    write_impl = None if whole else "xla"

    def local(q, k, v, kv, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, tree,
              image_end, sinks):
        if latent:
            kv = write_latent(kv[0], k, slot_mapping, *kv[1:])
            pages = (kv[0], None)  # V is K: the TPU kernel copies each page once
            scales = dict(k_scales=kv[1]) if len(kv) == 2 else {}
        else:
            kv = write_kv(kv[0], kv[1], k, v, slot_mapping, *kv[2:], impl=write_impl)
            pages = kv[:2]
            scales = dict(k_scales=kv[2], v_scales=kv[3]) if len(kv) == 4 else {}
        blocks = ({"queries_per_block": max(1, LATENT_ROWS // q.shape[1])}
                  if latent and impl == "tpu" else {})
        out = ragged_paged_attention(q, *pages, kv_lens, page_indices, cu_q_lens,
                                     num_seqs[0], impl=impl, interpret=options.interpret,
                                     tree_start=tree[0], tree_mask=tree[1],
                                     image_end=image_end, sinks=sinks, **scales, **kwargs,
                                     **blocks)
        return out, kv

    args = (q, k, v, kv, meta.slot_mapping, meta.kv_lens, meta.page_indices, meta.cu_q_lens,
            meta.num_seqs, (meta.tree_start, meta.tree_mask), meta.image_end, sinks)
    if not manual:
        return local(*args)
    spec = lambda axes: _only(shard.rules.spec(axes), manual)  # noqa: E731
    kv_specs = tuple(spec(KV_CACHE_AXES[:x.ndim]) for x in kv)
    seq_spec, token_spec = spec(SEQ_AXES), spec(("tokens",))
    return jax.shard_map(
        local, mesh=shard.mesh, axis_names=manual, check_vma=False,
        in_specs=(spec(Q_AXES), spec(NEW_KV_AXES), None if latent else spec(NEW_KV_AXES),
                  kv_specs, token_spec,
                  seq_spec, seq_spec, seq_spec, seq_spec, (seq_spec, token_spec), token_spec,
                  spec(Q_AXES[1:2])),
        out_specs=(spec(Q_AXES), kv_specs))(*args)


def real_tokens(meta, shard: ShardingContext) -> jax.Array | None:
    """The batch's real token count, for the native CPU matmul on one device (None on a
    mesh, where XLA's dots run on every padded token anyway)."""
    return meta.cu_q_lens[meta.num_seqs[0]] if shard.mesh.size == 1 else None


def _only(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
    """`spec` with every mesh axis outside `axes` dropped (a partial shard_map's view)."""
    def keep(entry):
        entry = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in entry if a in axes)
        return kept[0] if len(kept) == 1 else (kept or None)
    return PartitionSpec(*(keep(e) for e in spec))


def expert_parallel(experts, x: jax.Array, weights: jax.Array, chosen: jax.Array,
                    stacks: Sequence[nnx.Param | None], shard: ShardingContext) -> jax.Array:
    """A mixture-of-experts layer's experts on the mesh: `experts(x, weights, chosen,
    *stacks, first_expert=...)` (moe.MoE) runs on each device with the pieces of the
    stacked expert weights (`stacks`: gate, its scales, up, ..., a scale None when the
    stack is float; the first one's axes decide the split) it holds, for the tokens'
    routing (`weights`, `chosen`: `[T, top_k]`, computed once).

    Expert parallelism (`experts` over the mesh's devices): a device holds whole experts,
    numbered from `first_expert`; tensor parallelism of the experts (`expert_mlp` over
    `model`): every expert's gate/up columns and down rows are split. Every device sees
    all of its data shard's tokens (the attention's layout already gathers them over
    `model`: no dispatch collective), each token's chosen experts add their weighted
    outputs where they live, and one all-reduce over `model` combines the partial sums,
    the same collective a dense MLP ends in. With experts over `data` too (dp+ep,
    dp+tp+ep: one copy of the experts shared by the data shards), the data shards'
    tokens and routing are all-gathered first, and the sums are reduce-scattered back to
    their shards over `data`. Nothing is dropped: every token-expert pair is computed by
    its expert's device, whatever the load (no capacity factor). Expert weights are
    never gathered.
    """
    present = [p for p in stacks if p is not None]
    specs = [shard.rules.spec(p.get_metadata()["logical_axes"]) for p in present]
    experts_axis, _, mlp_axis = specs[0]

    def full(arrays):  # the stacks with their Nones back in place
        it = iter(arrays)
        return [None if p is None else next(it) for p in stacks]

    for values, scales in zip(stacks[:6:2], stacks[1:6:2]):  # (after them: gpt-oss biases)
        split = shard.rules.spec(values.get_metadata()["logical_axes"])[1]
        # int4 / fp4 (uint8 values, scales [E, K / group, N]): a K split must keep whole
        # groups on each device, as in `dense`.
        if values.dtype == jnp.uint8 and split is not None \
                and scales.shape[1] % shard.axis_size(split):
            raise ValueError(
                f"int4 / fp4 expert weights split over {shard.axis_size(split)} devices by their "
                f"intermediate rows need whole groups of rows on each device ({scales.shape[1]}"
                " groups do not divide): use an ep strategy (whole experts per device), int8 "
                "or fp8, or fewer model devices")
    arrays = [p[...] for p in present]
    if shard.mesh.size == 1 or (experts_axis is None and mlp_axis is None):
        return experts(x, weights, chosen, *full(arrays))
    split = experts_axis or mlp_axis
    axes = (split,) if isinstance(split, str) else tuple(split)
    over_data = DATA in axes  # each device's experts serve every data shard's tokens
    reduce = tuple(a for a in axes if a != DATA)
    tokens = PartitionSpec(shard.rules.spec(("tokens",))[0], None)

    def local(x, weights, chosen, *arrays):
        if over_data:
            x, weights, chosen = (jax.lax.all_gather(a, DATA, tiled=True)
                                  for a in (x, weights, chosen))
        first = jax.lax.axis_index(split) * arrays[0].shape[0] if experts_axis else 0
        out = experts(x, weights, chosen, *full(arrays), first_expert=first)
        if over_data:
            out = jax.lax.psum_scatter(out, DATA, scatter_dimension=0, tiled=True)
        return jax.lax.psum(out, reduce) if reduce else out

    return jax.shard_map(
        local, mesh=shard.mesh, check_vma=False,
        in_specs=(tokens, tokens, tokens, *specs), out_specs=tokens,
    )(x, weights, chosen, *arrays)


def real_token_mask(meta, num_tokens: int) -> jax.Array:
    """`[T]` bool: the batch's real tokens (not bucket padding), in every data shard's
    block of T/D tokens (shard d's real tokens are the first cu_q_lens of its block at
    its num_seqs)."""
    d = meta.num_seqs.shape[0]
    ends = jnp.take_along_axis(meta.cu_q_lens.reshape(d, -1), meta.num_seqs[:, None], 1)
    return (jnp.arange(num_tokens // d)[None, :] < ends).reshape(-1)
