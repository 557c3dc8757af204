"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft head: the layer DeepSeek
trained beside the model to guess the token after next, shipped in the checkpoint as the
layer past num_hidden_layers (loading/mtp.py). Like an EAGLE-1 head it reads, for each
position p, the embedding of token p + 1 beside the target's final (normed) hidden state
at p, and guesses the token after p + 1 (engine/speculative/eagle.py drives both).

The layer: eh_proj over [enorm(embedding), hnorm(hidden)] (2 x hidden to hidden), one
decoder block of the target's own kind (latent attention, and experts from
first_k_dense_replace on), then shared_head.norm; the target's LM head reads that (the
checkpoint's shared_head.head and embed_tokens are copies of the target's, DeepSeek-V3
report section 2.2). The normed output is also what the next round reads as its hidden
state, as SGLang's NextN layer feeds it back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.models.layers import param, rms_norm
from jaxserve.models.parallel import dense, real_tokens
from jaxserve.models.transformer import AttentionMetadata, Block, Transformer
from sharding.rules import ShardingContext


class MtpHead(nnx.Module):
    """The MTP layer; `cfg` is the target's config cut to that one layer (its kind of
    block: loading/mtp.mtp_config)."""

    def __init__(self, cfg: ModelConfig, dtype, shard: ShardingContext,
                 options: ModelOptions = ModelOptions()):
        h = cfg.hidden_size
        self.enorm = param((h,), ("embed",), dtype)
        self.hnorm = param((h,), ("embed",), dtype)
        self.eh_proj = param((2 * h, h), (None, "embed"), dtype, n_in=1)
        # ("layers", 0, ...): the block's parameters under a decoder's own names.
        self.layers = nnx.List([Block(cfg, 0, dtype, options, shard.rules.kv_head_replicas)])
        self.head_norm = param((h,), ("embed",), dtype)
        self.cfg = cfg
        self.shard = shard
        self.options = options

    def _norm(self, x: jax.Array, weight: nnx.Param) -> jax.Array:
        return rms_norm(x, weight[...], self.cfg.rms_norm_eps)

    def __call__(self, embeds: jax.Array, features: jax.Array, positions: jax.Array,
                 kv: tuple, meta: AttentionMetadata, from_target: bool
                 ) -> tuple[jax.Array, tuple]:
        """Normed output hidden states `[T, hidden]` and the layer's new cache, for `embeds`
        (of each position's next token) and `features`: the target's final hidden states
        (`from_target`) or the head's own last outputs, read alike."""
        shard = self.shard
        rows = real_tokens(meta, shard)
        x = jnp.concatenate([self._norm(embeds, self.enorm),
                             self._norm(features, self.hnorm)], axis=-1)
        x = dense(x, self.eh_proj, None, 1, (self.cfg.hidden_size,), self.options, shard,
                  rows=rows)
        x, kv = self.layers[0](shard.constrain(x, ("tokens", "embed")), positions, kv, meta,
                               shard, rows)
        return self._norm(x, self.head_norm), kv

    def logits(self, hidden: jax.Array, target: Transformer, rows: jax.Array | None = None
               ) -> jax.Array:
        """float32 logits over the target's vocabulary: its LM head on the normed output."""
        return target.head_logits(hidden, rows)

    def to_target(self, ids: jax.Array) -> jax.Array:
        return ids
