"""EAGLE draft heads on the device (EAGLE-1 and EAGLE-3, SafeAILab's published designs):
one decoder layer that reads, for each position p, the embedding of token p + 1 beside
the target model's features at p, and guesses the token after p + 1. Its output hidden
state is the feature its next round reads (in place of the target's, which are not
known yet for guessed tokens).

EAGLE-1: the features are the target's final hidden states (after its last norm);
`fc` maps [embedding, features] (2 x hidden) to hidden; the layer has no input norm; the
target's LM head reads its output directly.
EAGLE-3: the features are the target's residual stream entering three of its layers
(low, middle, high), side by side; `fc` maps them (3 x hidden) to hidden, and the head's
own outputs skip it; the layer's attention reads [input_norm(embedding),
hidden_norm(hidden)] (2 x hidden), and the head has its own final norm and LM head over a
smaller draft vocabulary, `draft_to_target` mapping its ids to the target's (id + offset).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.models.layers import is_packed, is_transposed, lm_head, param, rms_norm
from jaxserve.models.mlp import MLP
from jaxserve.models.parallel import RESIDUAL_AXES, dense, real_tokens
from jaxserve.models.transformer import Attention, AttentionMetadata, Transformer
from sharding.rules import ShardingContext


def feature_layers(version: int, num_layers: int, aux_layers: tuple[int, ...] = ()
                   ) -> tuple[int, ...]:
    """The target layers whose input an EAGLE head reads (Transformer's `features_from`):
    EAGLE-1 the final normed hidden state (index num_layers); EAGLE-3 the checkpoint's
    `eagle_aux_hidden_state_layer_ids`, else layers 2, L/2 and L-3 (EAGLE's choice)."""
    if version == 1:
        return (num_layers,)
    layers = aux_layers or (2, num_layers // 2, num_layers - 3)
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"speculative_config: an EAGLE-3 head reads the inputs of 3 target "
                         f"layers, {layers} here; the target has {num_layers} layers")
    return tuple(layers)


class EagleHead(nnx.Module):
    """The draft layer; `cfg` is the head's own config (one layer, the target's hidden
    size), `feature_size` the width of the target features it reads."""

    def __init__(self, cfg: ModelConfig, version: int, feature_size: int, fc_bias: bool,
                 draft_vocab: int, dtype, shard: ShardingContext,
                 options: ModelOptions = ModelOptions()):
        h = cfg.hidden_size
        self.version = version
        self.cfg = cfg
        self.shard = shard
        self.options = options
        # EAGLE-1's fc reads [embedding, features]; EAGLE-3's the features alone.
        fc_in = h + feature_size if version == 1 else feature_size
        self.fc = param((fc_in, h), (None, "embed"), dtype, n_in=1)
        if fc_bias:
            self.fc_bias = param((h,), ("embed",), dtype)
        self.attn = Attention(cfg, 0, dtype, options, shard.rules.kv_head_replicas,
                              in_features=2 * h if version == 3 else h)
        self.post_attn_norm = param((h,), ("embed",), dtype)
        self.mlp = MLP(cfg, dtype, options)
        if version == 3:
            self.input_norm = param((h,), ("embed",), dtype)
            self.hidden_norm = param((h,), ("embed",), dtype)
            self.norm = param((h,), ("embed",), dtype)
            self.lm_head = param((h, draft_vocab), ("embed", "vocab"), dtype, n_in=1)
            self.draft_to_target = nnx.Param(jnp.zeros(draft_vocab, jnp.int32),
                                             logical_axes=(None,))

    def _norm(self, x: jax.Array, weight: nnx.Param) -> jax.Array:
        return rms_norm(x, weight[...], self.cfg.rms_norm_eps)

    def __call__(self, embeds: jax.Array, features: jax.Array, positions: jax.Array,
                 kv: tuple, meta: AttentionMetadata, from_target: bool
                 ) -> tuple[jax.Array, tuple]:
        """Output hidden states `[T, hidden]` (before any final norm) and the layer's new
        cache, for `embeds` (of each position's next token) and `features`: the target's
        (`from_target`, `[T, feature_size]`) or the head's own last outputs."""
        shard, options = self.shard, self.options
        rows = real_tokens(meta, shard)
        h = self.cfg.hidden_size
        if self.version == 1:
            x = dense(jnp.concatenate([embeds, features], axis=-1), self.fc, None, 1, (h,),
                      options, shard, rows=rows)
            if hasattr(self, "fc_bias"):
                x = x + self.fc_bias[...]
            residual, x = x, x
        else:
            if from_target:
                features = dense(features, self.fc, None, 1, (h,), options, shard, rows=rows)
                if hasattr(self, "fc_bias"):
                    features = features + self.fc_bias[...]
            residual = features
            x = jnp.concatenate([self._norm(embeds, self.input_norm),
                                 self._norm(features, self.hidden_norm)], axis=-1)
        x = shard.constrain(x, ("tokens", "embed"))
        a, kv = self.attn(x, positions, kv, meta, shard, rows)
        x = residual + shard.constrain(a, RESIDUAL_AXES)
        m = self.mlp(shard.constrain(self._norm(x, self.post_attn_norm), ("tokens", "embed")),
                     shard, rows)
        return x + shard.constrain(m, RESIDUAL_AXES), kv

    def logits(self, hidden: jax.Array, target: Transformer, rows: jax.Array | None = None
               ) -> jax.Array:
        """float32 logits for each row of the head's output hidden states: over the
        target's vocabulary (EAGLE-1, the target's LM head) or the head's draft vocabulary
        (EAGLE-3; `to_target` maps its ids)."""
        if self.version == 1:
            return target.head_logits(hidden, rows)
        impl = None if self.shard.mesh.size == 1 else "reference"
        logits = lm_head(self._norm(hidden, self.norm), self.lm_head[...],
                         is_transposed(self.lm_head), self.options, impl, rows,
                         packed=is_packed(self.lm_head))
        return self.shard.constrain(logits, ("seqs", "vocab"))

    def to_target(self, ids: jax.Array) -> jax.Array:
        """Token ids of `logits`' vocabulary as the target's."""
        return ids + self.draft_to_target[...][ids] if self.version == 3 else ids


def embed(target: Transformer, ids: jax.Array) -> jax.Array:
    """The target's token embeddings (EAGLE shares them), unscaled as EAGLE reads them."""
    return target.embed_tokens(ids)
