"""The vision tower on the device: one jitted program per image shape (LLaVA's towers take
one size), compiled at warm-up, that encodes an image and writes its embeddings into the
rows the encoder cache gave it, in the buffer the step reads them from (`buffer`,
`[num_slots, hidden]`, replicated). The buffer is donated to each encode and replaced:
steps dispatched before read the version they were given."""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import VisionConfig
from jaxserve.engine.multimodal.inputs import ImageInput
from jaxserve.models.vision.llava import embed_images

log = logging.getLogger(__name__)


def encode_into(params, buffer: jax.Array, pixels: jax.Array, rows: jax.Array, *,
                cfg: VisionConfig) -> jax.Array:
    """`buffer` with the embeddings of the image `pixels` (`[3, S, S]`) at `rows`."""
    embeds = embed_images(params, pixels[None], cfg)[0]
    return buffer.at[rows].set(embeds.astype(buffer.dtype), mode="drop")


class ImageEncoder:
    def __init__(self, cfg: VisionConfig, params, num_slots: int, dtype, sharding):
        self.cfg = cfg
        self.params = params
        self._abstract = jax.ShapeDtypeStruct((num_slots, cfg.text_hidden_size),
                                              jnp.dtype(dtype), sharding=sharding)
        self.buffer = self._zeros()
        self._sharding = sharding
        self._encode = jax.jit(functools.partial(encode_into, cfg=cfg), donate_argnums=(1,),
                               out_shardings=sharding)
        self.warmed_up = False
        self.compiles_after_warmup = 0
        self.seconds = 0.0  # host time spent dispatching encodes (not the device's)

    def _zeros(self) -> jax.Array:
        a = self._abstract
        return jax.jit(lambda: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding)()

    def warmup(self) -> None:
        """Compile the encode program (on an image of zeros, written nowhere)."""
        size = self.cfg.image_size
        self.buffer = self._encode(self.params, self.buffer, np.zeros((3, size, size),
                                                                      np.float32),
                                   np.full(self.cfg.tokens_per_image, self._abstract.shape[0],
                                           np.int32))
        jax.block_until_ready(self.buffer)
        self._compiled = self._encode._cache_size()
        self.warmed_up = True

    def encode(self, image: ImageInput, rows: np.ndarray) -> None:
        """Start encoding `image` into `rows` (the step after reads them)."""
        start = time.perf_counter()
        self.buffer = self._encode(self.params, self.buffer, image.pixels, rows)
        if self.warmed_up and self._encode._cache_size() != self._compiled:
            self.compiles_after_warmup += 1
            self._compiled = self._encode._cache_size()
            log.warning("compiled the vision tower after warm-up (image %s)",
                        image.pixels.shape)
        self.seconds += time.perf_counter() - start

    def recover(self) -> None:
        """After a failed step: a new buffer if the old one was consumed (the cache's
        rows are then stale: the caller forgets them)."""
        if self.buffer.is_deleted():
            self.buffer = self._zeros()
