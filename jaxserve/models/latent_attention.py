"""Multi-head latent attention (MLA): DeepSeek-V2 / V3's (Kimi K2's, DeepSeek-R1's).

Per token the model makes one latent `c` (kv_lora_rank wide, RMS-normed) and one rotated
key `k_pe` (qk_rope_head_dim) that every head shares; head h's key is `[W_uk[h] c, k_pe]`
and its value `W_uv[h] c`, where `kv_b_proj` holds W_uk and W_uv. The cache keeps only
`[c, k_pe]` (576 numbers a token for V3, against 128 heads x (192 + 128) expanded), as
one head of a paged pool that is both K and V (parallel.paged_attention with v None).

Attention runs on the latent ("absorbed" weights, as DeepSeek's and vLLM's decode): a
head's query `[q_nope, q_pe]` becomes `[q_nope W_uk[h], q_pe]`, whose dot with a cached
`[c, k_pe]` is exactly the expanded `q . k`; the softmax-weighted sum of the cached rows
has `sum p c` in its first kv_lora_rank columns, and `W_uv[h]` of that is the head's
output. Queries take their own bottleneck (q_a_proj, RMSNorm, q_b_proj) when q_lora_rank
is set, else one q_proj. DeepSeek pairs the rotated dims as (0, 1), (2, 3), ...: both q_pe
and k_pe are de-interleaved first, which leaves every q . k as it was and turns the
rotation into the usual halves' one (pallas_kernels.rows.rope).

Under tensor parallelism the heads split over `model` (q_b_proj, W_uk, W_uv, o_proj) and
the latent is computed and cached whole on every device (one cache head, stored
kv_head_replicas times like any KV head fewer than the devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.models.layers import (
    linear, param, rms_norm, rope_attention_factor, rope_inv_freq, rows_impl)
from jaxserve.models.parallel import (
    NEW_KV_AXES, Q_AXES, dense, dense_group, paged_attention, row_parallel)
from pallas_kernels.rows import rope
from sharding.rules import ShardingContext

# DeepSeek's own RMSNorm default for the two bottleneck norms (not config.rms_norm_eps).
BOTTLENECK_EPS = 1e-6


class LatentAttention(nnx.Module):
    """Self-attention over a latent cache (see the module doc)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, options: ModelOptions,
                 kv_replicas: int = 1, path: str | None = None):
        e, h = cfg.hidden_size, cfg.num_heads
        r, nope, rot, v = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                           cfg.v_head_dim)
        qk = nope + rot

        def weights(name):  # each projection's format
            return options.weight_options(path and f"{path}.{name}")

        if cfg.q_lora_rank:
            ql = cfg.q_lora_rank
            self.q_a_proj, self.q_a_proj_scales = linear(
                (e,), (ql,), ("embed",), ("latent",), dtype, weights("q_a_proj"))
            self.q_a_norm = param((ql,), ("latent",), dtype)
            self.q_b_proj, self.q_b_proj_scales = linear(
                (ql,), (h, qk), ("latent",), ("q_heads", "head_dim"), dtype, weights("q_b_proj"))
        else:
            self.q_proj, self.q_proj_scales = linear(
                (e,), (h, qk), ("embed",), ("q_heads", "head_dim"), dtype, weights("q_proj"))
        self.kv_a_proj, self.kv_a_proj_scales = linear(
            (e,), (r + rot,), ("embed",), ("latent",), dtype, weights("kv_a_proj"))
        self.kv_a_norm = param((r,), ("latent",), dtype)
        # kv_b_proj's two halves per head, as the absorbed queries and outputs use them.
        self.k_up = param((h, nope, r), ("q_heads", None, None), dtype)
        self.v_up = param((h, r, v), ("q_heads", None, None), dtype)
        self.o_proj, self.o_proj_scales = linear(
            (h, v), (e,), ("q_heads", "head_dim"), ("embed",), dtype, weights("o_proj"))
        self.cfg = cfg
        self.options = options
        self.rope = cfg.layer_rope(layer)
        self.rope_factor = rope_attention_factor(self.rope[1])
        self.kv_heads = kv_replicas

    def __call__(self, x, positions, kv, meta, shard: ShardingContext,
                 rows: jax.Array | None = None, lora=None):
        if lora is not None:
            raise ValueError("LoRA adapters on latent attention are not supported")
        cfg, options = self.cfg, self.options
        h, r, nope = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        qk, width = nope + cfg.qk_rope_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            q_low, latent = dense_group(
                x, [(self.q_a_proj, self.q_a_proj_scales, (cfg.q_lora_rank,)),
                    (self.kv_a_proj, self.kv_a_proj_scales, (width,))], options, shard, rows)
            q_low = rms_norm(q_low, self.q_a_norm[...], BOTTLENECK_EPS)
            q = dense(q_low, self.q_b_proj, self.q_b_proj_scales, 1, (h, qk), options, shard,
                      rows=rows)
        else:
            q, latent = dense_group(x, [(self.q_proj, self.q_proj_scales, (h, qk)),
                                        (self.kv_a_proj, self.kv_a_proj_scales, (width,))],
                                    options, shard, rows)
        c = rms_norm(latent[:, :r], self.kv_a_norm[...], BOTTLENECK_EPS)
        q_nope, q_pe, k_pe = q[..., :nope], q[..., nope:], latent[:, None, r:]
        if cfg.rope_interleave:  # the (0, 1), (2, 3), ... pairs as halves: evens, then odds
            rot = cfg.qk_rope_head_dim
            pairs = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2)])
            q_pe, k_pe = q_pe[..., pairs], k_pe[..., pairs]
        q_pe, k_pe = rope(q_pe, k_pe, positions, rope_inv_freq(cfg.rotary_dim, *self.rope),
                          rows=rows, impl=rows_impl(options, rows))
        if self.rope_factor != 1.0:  # YaRN's scale of what turned
            q_pe, k_pe = q_pe * self.rope_factor, k_pe * self.rope_factor
        q_latent = jnp.einsum("thd,hdr->thr", q_nope, self.k_up[...])
        q = shard.constrain(jnp.concatenate([q_latent, q_pe], -1), Q_AXES)
        k = jnp.concatenate([c[:, None, :], k_pe.astype(c.dtype)], -1)
        k = shard.constrain(jnp.broadcast_to(k, (k.shape[0], self.kv_heads, width)),
                            NEW_KV_AXES)
        out, kv = paged_attention(q, k, None, kv, meta, shard, options, sm_scale=cfg.sm_scale)
        out = jnp.einsum("thr,hrv->thv", out[..., :r], self.v_up[...])
        out = row_parallel(out, self.o_proj, self.o_proj_scales, 2, (cfg.hidden_size,),
                           options, shard, rows)
        return out, kv
