"""The decoder-only transformer of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3).

One model, driven by ModelConfig: GQA/MQA, optional q/k/v bias (Qwen2), q/k RMSNorm
(Qwen3), sliding-window layers (Mistral), tied or untied embeddings. It runs over a flat
ragged batch of T tokens and a paged KV cache (layout in pallas_kernels/).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.layers import apply_rope, param, rms_norm, rope_inv_freq
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv
from sharding.rules import ShardingContext

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: (k_pages, v_pages)
# Logical axes of one layer's K or V pages: [num_pages, page_size, num_kv_heads, head_dim].
KV_CACHE_AXES = (None, None, "kv_heads", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where each token's K/V goes and which pages each sequence reads (see reference.py)."""

    slot_mapping: jax.Array  # [T]
    cu_q_lens: jax.Array  # [S + 1]
    kv_lens: jax.Array  # [S]
    page_indices: jax.Array  # [S, pages_per_seq]
    num_seqs: jax.Array  # []


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None):
        e, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = param(rngs, (e, hq, d), ("embed", "q_heads", "head_dim"), dtype)
        self.k_proj = param(rngs, (e, hkv, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.v_proj = param(rngs, (e, hkv, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.o_proj = param(rngs, (hq, d, e), ("q_heads", "head_dim", "embed"), dtype)
        if cfg.qkv_bias:
            self.q_bias = param(rngs, (hq, d), ("q_heads", "head_dim"), dtype)
            self.k_bias = param(rngs, (hkv, d), ("kv_heads", "head_dim"), dtype)
            self.v_bias = param(rngs, (hkv, d), ("kv_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.o_bias = param(rngs, (e,), ("embed",), dtype)
        if cfg.qk_norm:
            self.q_norm = param(rngs, (d,), ("head_dim",), dtype, init="ones")
            self.k_norm = param(rngs, (d,), ("head_dim",), dtype, init="ones")
        self.cfg = cfg
        self.window = cfg.layer_window(layer)

    def __call__(self, x, positions, kv, meta: AttentionMetadata, shard: ShardingContext):
        cfg = self.cfg
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q = jnp.einsum("te,ehd->thd", x, self.q_proj[...])
        k = jnp.einsum("te,ehd->thd", x, self.k_proj[...])
        v = jnp.einsum("te,ehd->thd", x, self.v_proj[...])
        if cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
        q = shard.constrain(apply_rope(q, positions, inv_freq), ("tokens", "q_heads", None))
        k = apply_rope(k, positions, inv_freq)
        k_pages, v_pages = write_kv(*kv, k, v, meta.slot_mapping)
        out = ragged_paged_attention(
            q, k_pages, v_pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs,
            sm_scale=cfg.head_dim**-0.5, sliding_window=self.window,
        )
        out = jnp.einsum("thd,hde->te", out, self.o_proj[...])
        if cfg.o_bias:
            out = out + self.o_bias[...]
        return out, (k_pages, v_pages)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        e, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = param(rngs, (e, m), ("embed", "mlp"), dtype)
        self.up_proj = param(rngs, (e, m), ("embed", "mlp"), dtype)
        self.down_proj = param(rngs, (m, e), ("mlp", "embed"), dtype)

    def __call__(self, x, shard: ShardingContext):
        h = jax.nn.silu(x @ self.gate_proj[...]) * (x @ self.up_proj[...])
        return shard.constrain(h, ("tokens", "mlp")) @ self.down_proj[...]


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None):
        e = cfg.hidden_size
        self.input_norm = param(rngs, (e,), ("embed",), dtype, init="ones")
        self.attn = Attention(cfg, layer, dtype, rngs)
        self.post_attn_norm = param(rngs, (e,), ("embed",), dtype, init="ones")
        self.mlp = MLP(cfg, dtype, rngs)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x, positions, kv, meta, shard):
        # The residual stream ("residual" axis) is split over tokens under sequence
        # parallelism: the norms run on a shard, an all-gather rebuilds all tokens before
        # the column-split matmuls ("tokens" axis), and the row-split matmuls' partial sums
        # go straight back to token shards (a reduce-scatter instead of an all-reduce).
        h = shard.constrain(rms_norm(x, self.input_norm[...], self.eps), ("tokens", "embed"))
        h, kv = self.attn(h, positions, kv, meta, shard)
        x = x + shard.constrain(h, ("residual", "embed"))
        h = shard.constrain(rms_norm(x, self.post_attn_norm[...], self.eps), ("tokens", "embed"))
        x = x + shard.constrain(self.mlp(h, shard), ("residual", "embed"))
        return x, kv


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None,
                 shard: ShardingContext | None = None):
        self.cfg = cfg
        self.shard = shard
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = nnx.List([Block(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = param(rngs, (cfg.hidden_size,), ("embed",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """Hidden states `[T, hidden]` after the last block (before the final norm)."""
        shard = self.shard
        x = shard.constrain(self.embed[...][input_ids], ("residual", "embed"))
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
