"""The decoder-only transformer of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3).

One model, driven by ModelConfig: GQA/MQA, optional q/k/v bias (Qwen2), q/k RMSNorm
(Qwen3), sliding-window layers (Mistral), tied or untied embeddings. It runs over a flat
ragged batch of T tokens and a paged KV cache (layout in pallas_kernels/).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.models.layers import (
    ModelOptions, apply_rope, dense, linear, param, rms_norm, rope_inv_freq)
from pallas_kernels.ragged_paged_attention import default_impl, ragged_paged_attention, write_kv
from sharding.rules import DATA, MODEL, ShardingContext

# Per layer: (k_pages, v_pages), plus (k_scales, v_scales) for a quantized cache.
KVCache = list[tuple[jax.Array, ...]]
# Logical axes of one layer's K or V pages: [cache_heads, num_pages, page_size, head_dim].
KV_CACHE_AXES = ("cache_heads", "pages", None, None)
QUANTIZED_KV_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
Q_AXES = ("tokens", "q_heads", None)
NEW_KV_AXES = ("tokens", "cache_heads", None)
RESIDUAL_AXES = ("residual", "embed")
SEQ_AXES = ("seqs",)


def kv_cache_layout(cfg: ModelConfig, num_pages: int, page_size: int, kv_dtype,
                    kv_head_replicas: int = 1
                    ) -> tuple[tuple[tuple[int, ...], object, tuple], ...]:
    """(shape, dtype, logical axes) of one layer's cache entries: K and V pages, and their
    float32 per-token scales `[cache_heads, num_pages, page_size]` when quantized.

    cache_heads = num_kv_heads x kv_head_replicas (sharding/rules.py): a KV head stored
    once per tensor-parallel device that reads it.
    """
    heads = cfg.num_kv_heads * kv_head_replicas
    pages = ((heads, num_pages, page_size, cfg.head_dim), kv_dtype, KV_CACHE_AXES)
    if jnp.dtype(kv_dtype) not in [jnp.dtype(d) for d in QUANTIZED_KV_DTYPES]:
        return pages, pages
    scales = (pages[0][:3], jnp.float32, KV_CACHE_AXES[:3])
    return pages, pages, scales, scales


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where each token's K/V goes and which pages each sequence reads (see reference.py)."""

    slot_mapping: jax.Array  # [T]
    cu_q_lens: jax.Array  # [D * (S/D + 1)]
    kv_lens: jax.Array  # [S]
    page_indices: jax.Array  # [S, pages_per_seq]
    num_seqs: jax.Array  # [D]

    # With D data shards (1 without data parallelism), every array is D equal blocks, one
    # per shard, in the shard's own terms: token offsets within its T/D tokens, slots and
    # page ids within its page pool.


class Attention(nnx.Module):
    """Self-attention over the paged cache. k/v projections (and biases) hold
    `num_kv_heads x kv_replicas` heads, logical axis `cache_heads`: with fewer KV heads
    than tensor-parallel devices each head is stored once per device that reads it
    (`kv_replicas` copies, made at load; sharding/rules.py), so every device computes and
    caches just its own head."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None,
                 options: ModelOptions, kv_replicas: int = 1):
        e, d, hq = cfg.hidden_size, cfg.head_dim, cfg.num_heads
        hkv = cfg.num_kv_heads * kv_replicas
        quant = options.quantization
        self.q_proj, self.q_proj_scales = linear(
            rngs, (e,), (hq, d), ("embed",), ("q_heads", "head_dim"), dtype, quant)
        self.k_proj, self.k_proj_scales = linear(
            rngs, (e,), (hkv, d), ("embed",), ("cache_heads", "head_dim"), dtype, quant)
        self.v_proj, self.v_proj_scales = linear(
            rngs, (e,), (hkv, d), ("embed",), ("cache_heads", "head_dim"), dtype, quant)
        self.o_proj, self.o_proj_scales = linear(
            rngs, (hq, d), (e,), ("q_heads", "head_dim"), ("embed",), dtype, quant)
        if cfg.qkv_bias:
            self.q_bias = param(rngs, (hq, d), ("q_heads", "head_dim"), dtype)
            self.k_bias = param(rngs, (hkv, d), ("cache_heads", "head_dim"), dtype)
            self.v_bias = param(rngs, (hkv, d), ("cache_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.o_bias = param(rngs, (e,), ("embed",), dtype)
        if cfg.qk_norm:
            self.q_norm = param(rngs, (d,), ("head_dim",), dtype, init="ones")
            self.k_norm = param(rngs, (d,), ("head_dim",), dtype, init="ones")
        self.cfg = cfg
        self.options = options
        self.window = cfg.layer_window(layer)
        self.kv_heads = hkv

    def __call__(self, x, positions, kv, meta: AttentionMetadata, shard: ShardingContext):
        cfg = self.cfg
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        lin = functools.partial(dense, options=self.options, shard=shard)
        hq, hkv, d = cfg.num_heads, self.kv_heads, cfg.head_dim
        q = lin(x, self.q_proj, self.q_proj_scales, 1, (hq, d))
        k = lin(x, self.k_proj, self.k_proj_scales, 1, (hkv, d))
        v = lin(x, self.v_proj, self.v_proj_scales, 1, (hkv, d))
        if cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
        q = shard.constrain(apply_rope(q, positions, inv_freq), Q_AXES)
        k = apply_rope(k, positions, inv_freq)
        k, v = shard.constrain(k, NEW_KV_AXES), shard.constrain(v, NEW_KV_AXES)
        out, kv = paged_attention(q, k, v, kv, meta, shard, self.options,
                                  sm_scale=cfg.head_dim**-0.5, sliding_window=self.window)
        out = row_parallel(out, self.o_proj, self.o_proj_scales, 2, (cfg.hidden_size,),
                           self.options, shard)
        if cfg.o_bias:
            out = out + self.o_bias[...]
        return out, kv


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple[jax.Array, ...],
                    meta: AttentionMetadata, shard: ShardingContext, options: ModelOptions,
                    **kwargs) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Write the new tokens' K/V into the paged cache, then ragged paged attention.

    Both run per shard under shard_map where XLA cannot partition them on its own:
    - over `data` (data parallelism): each shard's page ids and token offsets are local to
      its own page pool and tokens;
    - over `model` when a Pallas kernel runs (XLA cannot partition a kernel): each device
      takes its query heads and the cache heads they read. Where the cache is replicated
      whole (KV heads that neither divide nor are divided by the `model` size), the
      pure-JAX reference runs instead and XLA partitions it.
    """
    impl = options.kernel_impl or default_impl()
    q_spec, cache_spec = shard.rules.spec(Q_AXES), shard.rules.spec(KV_CACHE_AXES)
    if shard.mesh.size > 1 and impl != "reference" and cache_spec[0] != q_spec[1]:
        impl = "reference"
    manual = set()
    if shard.data_shards > 1:
        manual.add(DATA)
    if impl != "reference" and q_spec[1] is not None:
        manual.add(q_spec[1])
    if manual:  # a kernel must see no automatic axis, not even one of size 1
        manual |= {a for a, n in shard.mesh.shape.items() if n == 1}

    def local(q, k, v, kv, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
        kv = write_kv(kv[0], kv[1], k, v, slot_mapping, *kv[2:])
        scales = dict(k_scales=kv[2], v_scales=kv[3]) if len(kv) == 4 else {}
        out = ragged_paged_attention(q, kv[0], kv[1], kv_lens, page_indices, cu_q_lens,
                                     num_seqs[0], impl=impl, interpret=options.interpret,
                                     **scales, **kwargs)
        return out, kv

    args = (q, k, v, kv, meta.slot_mapping, meta.kv_lens, meta.page_indices, meta.cu_q_lens,
            meta.num_seqs)
    if not manual:
        return local(*args)
    spec = lambda axes: _only(shard.rules.spec(axes), manual)  # noqa: E731
    kv_specs = tuple(spec(KV_CACHE_AXES[:x.ndim]) for x in kv)
    seq_spec = spec(SEQ_AXES)
    return jax.shard_map(
        local, mesh=shard.mesh, axis_names=manual, check_vma=False,
        in_specs=(spec(Q_AXES), spec(NEW_KV_AXES), spec(NEW_KV_AXES), kv_specs,
                  spec(("tokens",)), seq_spec, seq_spec, seq_spec, seq_spec),
        out_specs=(spec(Q_AXES), kv_specs))(*args)


def _only(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
    """`spec` with every mesh axis outside `axes` dropped (a partial shard_map's view)."""
    def keep(entry):
        entry = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in entry if a in axes)
        return kept[0] if len(kept) == 1 else (kept or None)
    return PartitionSpec(*(keep(e) for e in spec))


def row_parallel(x: jax.Array, w: nnx.Param, scales: nnx.Param | None, n_in: int,
                 out_shape: tuple[int, ...], options: ModelOptions, shard: ShardingContext
                 ) -> jax.Array:
    """A row-split matmul (o_proj, down_proj) whose result joins the residual stream.

    Under sequence parallelism each device's partial sums are reduce-scattered over
    tokens (shard_map + psum_scatter over `model`): XLA left to itself all-reduces and
    then slices. That needs the tokens to divide evenly over the residual's shards (not
    the 1-token bucket); otherwise the plain matmul, whose result is all-reduced.
    """
    residual = shard.rules.spec(RESIDUAL_AXES)[0]
    sp = MODEL in ((residual,) if isinstance(residual, str) else (residual or ()))
    scatter = sp and x.shape[0] % shard.axis_size(residual) == 0
    if scales is not None:  # quantized: dense runs the kernel per device
        return dense(x, w, scales, n_in, out_shape, options, shard, scatter_tokens=scatter)
    if not scatter:
        y = dense(x, w, scales, n_in, out_shape, options, shard)
        return shard.constrain(y, RESIDUAL_AXES)

    def partial_sums(x, w):
        return jax.lax.psum_scatter(jnp.tensordot(x, w, axes=n_in), MODEL,
                                    scatter_dimension=0, tiled=True)

    x_axes = Q_AXES if n_in == 2 else ("tokens", "mlp")
    return jax.shard_map(
        partial_sums, mesh=shard.mesh, check_vma=False,
        in_specs=(shard.rules.spec(x_axes), shard.rules.spec(w.get_metadata()["logical_axes"])),
        out_specs=shard.rules.spec(RESIDUAL_AXES))(x, w[...])


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, options: ModelOptions):
        e, m, quant = cfg.hidden_size, cfg.intermediate_size, options.quantization
        self.gate_proj, self.gate_proj_scales = linear(
            rngs, (e,), (m,), ("embed",), ("mlp",), dtype, quant)
        self.up_proj, self.up_proj_scales = linear(rngs, (e,), (m,), ("embed",), ("mlp",), dtype, quant)
        self.down_proj, self.down_proj_scales = linear(
            rngs, (m,), (e,), ("mlp",), ("embed",), dtype, quant)
        self.options = options
        self.sizes = (e, m)

    def __call__(self, x, shard: ShardingContext):
        lin = functools.partial(dense, n_in=1, options=self.options, shard=shard)
        e, m = self.sizes
        gate = lin(x, self.gate_proj, self.gate_proj_scales, out_shape=(m,))
        h = jax.nn.silu(gate) * lin(x, self.up_proj, self.up_proj_scales, out_shape=(m,))
        h = shard.constrain(h, ("tokens", "mlp"))
        return row_parallel(h, self.down_proj, self.down_proj_scales, 1, (e,), self.options, shard)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None,
                 options: ModelOptions, kv_replicas: int = 1):
        e = cfg.hidden_size
        self.input_norm = param(rngs, (e,), ("embed",), dtype, init="ones")
        self.attn = Attention(cfg, layer, dtype, rngs, options, kv_replicas)
        self.post_attn_norm = param(rngs, (e,), ("embed",), dtype, init="ones")
        self.mlp = MLP(cfg, dtype, rngs, options)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x, positions, kv, meta, shard):
        # The residual stream ("residual" axis) is split over tokens under sequence
        # parallelism: the norms run on a shard, an all-gather rebuilds all tokens before
        # the column-split matmuls ("tokens" axis), and the row-split matmuls' partial sums
        # go straight back to token shards (a reduce-scatter instead of an all-reduce).
        h = shard.constrain(rms_norm(x, self.input_norm[...], self.eps), ("tokens", "embed"))
        h, kv = self.attn(h, positions, kv, meta, shard)
        x = x + shard.constrain(h, RESIDUAL_AXES)
        h = shard.constrain(rms_norm(x, self.post_attn_norm[...], self.eps), ("tokens", "embed"))
        x = x + shard.constrain(self.mlp(h, shard), RESIDUAL_AXES)
        return x, kv


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None,
                 shard: ShardingContext | None = None, options: ModelOptions = ModelOptions()):
        self.cfg = cfg
        self.shard = shard
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        replicas = shard.rules.kv_head_replicas if shard is not None else 1
        self.layers = nnx.List([Block(cfg, i, dtype, rngs, options, replicas)
                                for i in range(cfg.num_layers)])
        self.norm = param(rngs, (cfg.hidden_size,), ("embed",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """Hidden states `[T, hidden]` after the last block (before the final norm)."""
        shard = self.shard
        x = shard.constrain(self.embed[...][input_ids], RESIDUAL_AXES)
        new_caches = []
        for block, kv in zip(self.layers, kv_caches):
            x, kv = block(x, positions, kv, meta, shard)
            new_caches.append(kv)
        return x, new_caches

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[N, vocab]` for a few rows of hidden states."""
        x = rms_norm(hidden, self.norm[...], self.cfg.rms_norm_eps)
        w = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        logits = (x @ w).astype(jnp.float32)
        return self.shard.constrain(logits, ("seqs", "vocab"))
