"""LLaVA's image side: a CLIP tower's hidden states at the feature layer(s), the class
token dropped ("default" selection), through a two-layer MLP projector into the language
model's embedding width: `VisionConfig.tokens_per_image` embeddings per image."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import VisionConfig
from jaxserve.models.vision.clip import ClipParams, activation, hidden_states


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LlavaParams:
    tower: ClipParams
    linear_1_w: jax.Array  # [D x len(feature_layers), T]
    linear_1_b: jax.Array | None  # [T]; None without projector biases
    linear_2_w: jax.Array  # [T, T]
    linear_2_b: jax.Array | None


def embed_images(params: LlavaParams, pixels: jax.Array, cfg: VisionConfig) -> jax.Array:
    """`[B, 3, S, S]` pixels (the image processor's) -> `[B, tokens_per_image, T]`."""
    states = hidden_states(params.tower, pixels, cfg)
    features = jnp.concatenate([states[i % (cfg.num_layers + 1)] for i in cfg.feature_layers],
                               axis=-1)
    if cfg.feature_select == "default":
        features = features[:, 1:]
    h = features @ params.linear_1_w
    if params.linear_1_b is not None:
        h = h + params.linear_1_b
    h = activation(h, cfg.projector_act) @ params.linear_2_w
    if params.linear_2_b is not None:
        h = h + params.linear_2_b
    return h
