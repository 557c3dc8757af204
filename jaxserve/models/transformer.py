"""The decoder-only transformer: Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text),
the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss (attention sinks, biased
experts), and DeepSeek-V2 / V3 (latent attention, latent_attention.py, and DeepSeek's
experts).

One model, driven by ModelConfig: GQA/MQA, optional q/k/v bias (Qwen2), q/k RMSNorm
(Qwen3, Gemma 3), sliding-window layers (Mistral, Gemma) with their own rope (Gemma 3),
tied or untied embeddings, Gemma's (1 + w) norms, scaled embeddings, sandwich norms and
soft-caps, a dense SwiGLU / GeGLU MLP or the experts (moe.py) per layer. It runs over a flat
ragged batch of T tokens and a paged KV cache (layout in pallas_kernels/). The math is in
layers.py; the matmuls and the attention go through parallel.py, which splits them over
the mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.models.latent_attention import LatentAttention
from jaxserve.models.layers import (
    act_order_perm, embedding, is_packed, is_transposed, linear, lm_head, param,
    quantized_embedding, quantized_rows, quantized_table, rms_norm, rope_attention_factor,
    rope_inv_freq, rows_impl)
from jaxserve.models.lora import ATTENTION_IN, LoraInputs, LoraLayer, delta_impl
from jaxserve.models.mlp import MLP
from jaxserve.models.moe import MoE
from jaxserve.models.parallel import (
    KV_CACHE_AXES, NEW_KV_AXES, Q_AXES, RESIDUAL_AXES, dense, dense_group, paged_attention,
    real_token_mask, real_tokens, row_parallel)
from pallas_kernels.rows import rms_norm as rows_rms_norm
from pallas_kernels.rows import rope
from sharding.rules import ShardingContext

# Per layer: (k_pages, v_pages), plus (k_scales, v_scales) for a quantized cache (latent
# attention: (pages,), plus (scales,)).
KVCache = list[tuple[jax.Array, ...]]
QUANTIZED_KV_DTYPES = (jnp.int8, jnp.float8_e4m3fn)


def kv_cache_layout(cfg: ModelConfig, num_pages: int, page_size: int, kv_dtype,
                    kv_head_replicas: int = 1
                    ) -> tuple[tuple[tuple[int, ...], object, tuple], ...]:
    """(shape, dtype, logical axes) of one layer's cache entries: K and V pages, and their
    float32 per-token scales `[cache_heads, num_pages, page_size]` when quantized (latent
    attention: one pool, and its scales).

    cache_heads = num_kv_heads x kv_head_replicas (sharding/rules.py): a KV head stored
    once per tensor-parallel device that reads it.
    """
    heads = cfg.num_kv_heads * kv_head_replicas
    pages = ((heads, num_pages, page_size, cfg.head_dim), kv_dtype, KV_CACHE_AXES)
    # Latent attention's one pool is both K and V (latent_attention.py).
    copies = 1 if cfg.kv_lora_rank else 2
    if jnp.dtype(kv_dtype) not in [jnp.dtype(d) for d in QUANTIZED_KV_DTYPES]:
        return (pages,) * copies
    scales = (pages[0][:3], jnp.float32, KV_CACHE_AXES[:3])
    return (pages,) * copies + (scales,) * copies


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where each token's K/V goes and which pages each sequence reads (see reference.py)."""

    slot_mapping: jax.Array  # [T]
    cu_q_lens: jax.Array  # [D * (S/D + 1)]
    kv_lens: jax.Array  # [S]
    page_indices: jax.Array  # [S, pages_per_seq]
    num_seqs: jax.Array  # [D]
    # Trees of speculative tokens (a step verifying Medusa's candidate trees; else None):
    # where each sequence's tree starts and each token's tree mask (the kernels' args).
    tree_start: jax.Array | None = None  # [S]
    tree_mask: jax.Array | None = None  # [T]
    # Images seen whole (Gemma 3): for a token inside one, the position of its last token
    # (the image's tokens see each other); -1 elsewhere. None for other models.
    image_end: jax.Array | None = None  # [T]

    # With D data shards (1 without data parallelism), every array is D equal blocks, one
    # per shard, in the shard's own terms: token offsets within its T/D tokens, slots and
    # page ids within its page pool.


class Attention(nnx.Module):
    """Self-attention over the paged cache. k/v projections (and biases) hold
    `num_kv_heads x kv_replicas` heads, logical axis `cache_heads`: with fewer KV heads
    than tensor-parallel devices each head is stored once per device that reads it
    (`kv_replicas` copies, made at load; sharding/rules.py), so every device computes and
    caches just its own head."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, options: ModelOptions,
                 kv_replicas: int = 1, in_features: int | None = None,
                 path: str | None = None):
        e, d, hq = cfg.hidden_size, cfg.head_dim, cfg.num_heads
        hkv = cfg.num_kv_heads * kv_replicas
        x = in_features or e  # the input's width (an EAGLE-3 layer reads 2 x hidden)
        # Each projection's format (`path`: this module's parameter path in the decoder).
        q, k, v, o = (options.weight_options(path and f"{path}.{p}_proj") for p in "qkvo")
        self.q_proj, self.q_proj_scales = linear(
            (x,), (hq, d), ("embed",), ("q_heads", "head_dim"), dtype, q)
        self.k_proj, self.k_proj_scales = linear(
            (x,), (hkv, d), ("embed",), ("cache_heads", "head_dim"), dtype, k)
        self.v_proj, self.v_proj_scales = linear(
            (x,), (hkv, d), ("embed",), ("cache_heads", "head_dim"), dtype, v)
        self.o_proj, self.o_proj_scales = linear(
            (hq, d), (e,), ("q_heads", "head_dim"), ("embed",), dtype, o)
        # Act-order checkpoints: each projection's input permutation (None otherwise).
        self.q_proj_perm = act_order_perm(x, q)
        self.k_proj_perm = act_order_perm(x, k)
        self.v_proj_perm = act_order_perm(x, v)
        self.o_proj_perm = act_order_perm(hq * d, o)
        if cfg.qkv_bias:
            self.q_bias = param((hq, d), ("q_heads", "head_dim"), dtype)
            self.k_bias = param((hkv, d), ("cache_heads", "head_dim"), dtype)
            self.v_bias = param((hkv, d), ("cache_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.o_bias = param((e,), ("embed",), dtype)
        if cfg.qk_norm:
            self.q_norm = param((d,), ("head_dim",), dtype)
            self.k_norm = param((d,), ("head_dim",), dtype)
        if cfg.attention_sinks:  # gpt-oss: a logit per query head (float32: the kernels')
            self.sinks = param((hq,), ("q_heads",), jnp.float32)
        self.cfg = cfg
        self.options = options
        self.window = cfg.layer_window(layer)
        self.rope = cfg.layer_rope(layer)
        self.rope_factor = rope_attention_factor(self.rope[1])
        self.kv_heads = hkv

    def __call__(self, x, positions, kv, meta: AttentionMetadata, shard: ShardingContext,
                 rows: jax.Array | None = None, lora: LoraLayer | None = None):
        cfg = self.cfg
        inv_freq = rope_inv_freq(cfg.rotary_dim, *self.rope)
        hq, hkv, d = cfg.num_heads, self.kv_heads, cfg.head_dim
        q, k, v = dense_group(x, [(self.q_proj, self.q_proj_scales, (hq, d), self.q_proj_perm),
                                  (self.k_proj, self.k_proj_scales, (hkv, d), self.k_proj_perm),
                                  (self.v_proj, self.v_proj_scales, (hkv, d), self.v_proj_perm)],
                              self.options, shard, rows)
        if lora is not None:
            q, k, v = lora.add(x, ATTENTION_IN, [q, k, v])
        if cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps, cfg.norm_offset)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps, cfg.norm_offset)
        r = cfg.rotary_dim  # a partial rope turns each head's first r dimensions only
        q_rot, k_rot = (q, k) if r == d else (q[..., :r], k[..., :r])
        q_rot, k_rot = rope(q_rot, k_rot, positions, inv_freq, rows=rows,
                            impl=rows_impl(self.options, rows), sections=cfg.mrope_section)
        if self.rope_factor != 1.0:  # YaRN's and LongRoPE's scale of what turned
            q_rot, k_rot = q_rot * self.rope_factor, k_rot * self.rope_factor
        if r < d:
            q_rot = jnp.concatenate([q_rot, q[..., r:]], -1)
            k_rot = jnp.concatenate([k_rot, k[..., r:]], -1)
        q, k = q_rot, k_rot
        q = shard.constrain(q, Q_AXES)
        k, v = shard.constrain(k, NEW_KV_AXES), shard.constrain(v, NEW_KV_AXES)
        out, kv = paged_attention(q, k, v, kv, meta, shard, self.options,
                                  sm_scale=cfg.sm_scale, sliding_window=self.window,
                                  soft_cap=cfg.attn_logit_softcap,
                                  sinks=self.sinks[...] if cfg.attention_sinks else None)
        attended = out
        out = row_parallel(out, self.o_proj, self.o_proj_scales, 2, (cfg.hidden_size,),
                           self.options, shard, rows, self.o_proj_perm)
        if lora is not None:
            (out,) = lora.add(attended, ("o_proj",), [out])
        if cfg.o_bias:
            out = out + self.o_bias[...]
        return out, kv


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, options: ModelOptions,
                 kv_replicas: int = 1):
        e = cfg.hidden_size
        self.input_norm = param((e,), ("embed",), dtype)
        attention = LatentAttention if cfg.kv_lora_rank else Attention
        self.attn = attention(cfg, layer, dtype, options, kv_replicas,
                              path=f"layers.{layer}.attn")
        # Llama: the norm before the MLP. Gemma ("sandwich"): the norm of the attention's
        # output, and pre_mlp_norm / post_mlp_norm around the MLP.
        self.post_attn_norm = param((e,), ("embed",), dtype)
        if cfg.sandwich_norms:
            self.pre_mlp_norm = param((e,), ("embed",), dtype)
            self.post_mlp_norm = param((e,), ("embed",), dtype)
        mlp = MoE if cfg.sparse_layers[layer] else MLP
        self.mlp = mlp(cfg, dtype, options, path=f"layers.{layer}.mlp")
        self.eps = cfg.rms_norm_eps
        self.offset = cfg.norm_offset
        self.sandwich = cfg.sandwich_norms
        self.options = options

    def _norm(self, x, weight, rows=None, residual=None):
        """RMSNorm (of x + residual, returning the sum too: pallas_kernels.rows)."""
        return rows_rms_norm(x, weight[...], self.eps, self.offset, residual=residual,
                             rows=rows, impl=rows_impl(self.options, rows))

    def __call__(self, x, positions, kv, meta, shard, rows=None, router_stats=False,
                 lora: LoraLayer | None = None):
        # The residual stream ("residual" axis) is split over tokens under sequence
        # parallelism: the norms run on a shard, an all-gather rebuilds all tokens before
        # the column-split matmuls ("tokens" axis), and the row-split matmuls' partial sums
        # go straight back to token shards (a reduce-scatter instead of an all-reduce).
        h = shard.constrain(self._norm(x, self.input_norm, rows), ("tokens", "embed"))
        h, kv = self.attn(h, positions, kv, meta, shard, rows, lora)
        h = shard.constrain(h, RESIDUAL_AXES)
        if self.sandwich:
            x = x + self._norm(h, self.post_attn_norm, rows)
            h = self._norm(x, self.pre_mlp_norm, rows)
        else:
            h, x = self._norm(x, self.post_attn_norm, rows, residual=h)
        h = shard.constrain(h, ("tokens", "embed"))
        if isinstance(self.mlp, MoE):  # padding tokens are routed to no expert
            h = self.mlp(h, shard, rows, real_token_mask(meta, h.shape[0]), router_stats)
        else:
            h = self.mlp(h, shard, rows, lora)
        h = shard.constrain(h, RESIDUAL_AXES)
        x = x + (self._norm(h, self.post_mlp_norm, rows) if self.sandwich else h)
        return x, kv


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, shard: ShardingContext,
                 options: ModelOptions = ModelOptions()):
        self.cfg = cfg
        self.shard = shard
        self.options = options
        self.dtype = jnp.dtype(dtype)
        head_quantized = options.lm_head_quantization is not None
        if options.embed_from_lm_head and not (head_quantized and cfg.tie_word_embeddings):
            raise ValueError("embed_from_lm_head: token lookups read a tied, quantized LM head; "
                             "this model's head is untied or not quantized")
        embed_options = options.weight_options("embed")
        if embed_options.quantization is not None:
            if cfg.tie_word_embeddings:
                raise ValueError("a quantized embedding (quant_overrides' 'embed') is an "
                                 "untied model's; a tied one's is its quantized LM head "
                                 "(embed_from_lm_head)")
            self.embed, self.embed_scales = quantized_table(
                cfg.vocab_size, cfg.hidden_size, dtype, embed_options)
        else:
            self.embed_scales = None
            if not options.embed_from_lm_head:  # else lookups read the quantized head
                self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                   dtype, tied_head=cfg.tie_word_embeddings and not head_quantized)
        replicas = shard.rules.kv_head_replicas
        self.layers = nnx.List([Block(cfg, i, dtype, options, replicas)
                                for i in range(cfg.num_layers)])
        self.norm = param((cfg.hidden_size,), ("embed",), dtype)
        if head_quantized:  # its own values and scales (a tied one: a copy of the embedding)
            self.lm_head, self.lm_head_scales = linear(
                (cfg.hidden_size,), (cfg.vocab_size,), ("embed",), ("vocab",), dtype,
                options.head_options())
        elif not cfg.tie_word_embeddings:
            self.lm_head = param((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype,
                                 n_in=1)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: KVCache,
                 meta: AttentionMetadata, router_stats: bool = False,
                 lora: LoraInputs | None = None) -> tuple[jax.Array, KVCache]:
        """Hidden states `[T, hidden]` after the last block (before the final norm) and the
        new caches. With `router_stats` each MoE layer sows its `expert_tokens` (call it
        under `nnx.capture(model, nnx.Intermediate)`, as programs.forward does)."""
        hidden, kv_caches, _ = self.run(input_ids, positions, kv_caches, meta, router_stats,
                                        lora=lora)
        return hidden, kv_caches

    def embed_tokens(self, ids: jax.Array) -> jax.Array:
        """The token embeddings of `ids` (`[T, hidden]`, before Gemma's scaling)."""
        if self.options.embed_from_lm_head:
            return quantized_embedding(self.lm_head, self.lm_head_scales, ids, self.dtype)
        if self.embed_scales is not None:
            return quantized_rows(self.embed, self.embed_scales, ids, self.dtype)
        return embedding(self.embed, ids)

    def run(self, input_ids: jax.Array, positions: jax.Array, kv_caches: KVCache,
            meta: AttentionMetadata, router_stats: bool = False,
            features_from: tuple[int, ...] = (), lora: LoraInputs | None = None,
            images: tuple[jax.Array, jax.Array] | None = None
            ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """`__call__`, and the features an EAGLE head reads (None when `features_from` is
        empty): the residual stream entering each layer of `features_from`, side by side,
        where index num_layers stands for the final hidden state after the last norm.
        `lora`: adapter stacks and the step's tokens' slots (models/lora.py), or None.
        `images`: (`[slots, hidden]` image embeddings, `[T]` each token's row there or -1):
        a token with a row takes that embedding instead of its own (after Gemma's scaling,
        as transformers merges them)."""
        shard = self.shard
        x = self.embed_tokens(input_ids)
        if self.cfg.scale_embeddings:  # sqrt(hidden), rounded to the weights' dtype (as HF)
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
        if images is not None:
            embeds, index = images
            x = jnp.where((index >= 0)[:, None], embeds[jnp.maximum(index, 0)].astype(x.dtype),
                          x)
        x = shard.constrain(x, RESIDUAL_AXES)
        rows = real_tokens(meta, shard)
        lora_impl = delta_impl(rows is not None, rows_impl(self.options, rows) is None)
        new_caches, captured = [], {}
        for i, (block, kv) in enumerate(zip(self.layers, kv_caches)):
            if i in features_from:
                captured[i] = x
            x, kv = block(x, positions, kv, meta, shard, rows, router_stats,
                          lora.layer(i, lora_impl) if lora is not None else None)
            new_caches.append(kv)
        if self.cfg.num_layers in features_from:
            captured[self.cfg.num_layers] = self.final_norm(x)
        features = (jnp.concatenate([captured[i] for i in features_from], axis=-1)
                    if features_from else None)
        return x, new_caches, features

    def final_norm(self, hidden: jax.Array) -> jax.Array:
        """The last norm, which the LM head (and Medusa heads) read after."""
        return rms_norm(hidden, self.norm[...], self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def logits(self, hidden: jax.Array, rows: jax.Array | None = None,
               dtype=jnp.float32) -> jax.Array:
        """Logits `[N, vocab]` for a few rows of hidden states (the native CPU matmul
        computes the first `rows` only: the real sequences), in `dtype` (None: as the
        matmul made them, for a consumer that widens only the rows it reads)."""
        return self.head_logits(self.final_norm(hidden), rows, dtype)

    def head_logits(self, x: jax.Array, rows: jax.Array | None = None,
                    dtype=jnp.float32) -> jax.Array:
        """The LM head alone (no norm before it) on `[N, hidden]`: `logits` after the
        final norm; an EAGLE-1 head's guesses straight from its output."""
        cfg = self.cfg
        if cfg.final_logit_softcap:  # Gemma 2: the cap in float32
            dtype = jnp.float32
        if self.options.lm_head_quantization is not None:
            logits = dense(x, self.lm_head, self.lm_head_scales, 1, (cfg.vocab_size,),
                           self.options.head_options(), self.shard, rows=rows)
            logits = logits if dtype is None else logits.astype(dtype)
        else:
            tied = cfg.tie_word_embeddings
            impl = None if self.shard.mesh.size == 1 else "reference"  # XLA partitions the dot
            logits = lm_head(x, self.embed[...] if tied else self.lm_head[...],
                             tied or is_transposed(self.lm_head), self.options, impl, rows,
                             dtype, packed=is_packed(self.embed if tied else self.lm_head))
        if cfg.final_logit_softcap:
            logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
        return self.shard.constrain(logits, ("seqs", "vocab"))
