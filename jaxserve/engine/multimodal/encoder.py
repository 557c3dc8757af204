"""The vision tower on the device: one jitted program per bucket of image shapes, compiled
at warm-up, that encodes an image and writes its embeddings into the rows the encoder
cache gave it, in the buffer the step reads them from (`buffer`, `[num_slots, hidden]`,
replicated). The buffer is donated to each encode and replaced: steps dispatched before
read the version they were given.

LLaVA's and Gemma 3's towers take one image size: one program. Qwen2.5-VL's take any size: an image's
patches are laid out in windows (models/vision/qwen2_5_vl.py's `layout`), padded to a
power-of-two count of windows, so a program per power of two up to the largest image the
processor makes (`max_pixels`) covers every size."""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import Gemma3VisionConfig, QwenVisionConfig, VisionConfig
from jaxserve.engine.multimodal.inputs import ImageInput
from jaxserve.models.vision import gemma3, llava, qwen2_5_vl

log = logging.getLogger(__name__)


def _encode_fixed(params, buffer: jax.Array, pixels: jax.Array, rows: jax.Array, *,
                  cfg: VisionConfig | Gemma3VisionConfig) -> jax.Array:
    """`buffer` with the embeddings of the image `pixels` (`[3, S, S]`) at `rows`: LLaVA's
    or Gemma 3's towers (one image size)."""
    embed = gemma3.embed_images if isinstance(cfg, Gemma3VisionConfig) else llava.embed_images
    embeds = embed(params, pixels[None], cfg)[0]
    return buffer.at[rows].set(embeds.astype(buffer.dtype), mode="drop")


def _encode_qwen(params, buffer: jax.Array, patches: jax.Array, positions: jax.Array,
                 valid: jax.Array, rows: jax.Array, *, cfg: QwenVisionConfig) -> jax.Array:
    """`buffer` with the embeddings of an image's laid-out patches at `rows` (one per
    merged output row; out of range for padding)."""
    embeds = qwen2_5_vl.embed_image(params, patches, positions, valid, cfg)
    return buffer.at[rows].set(embeds.astype(buffer.dtype), mode="drop")


def window_buckets(cfg: QwenVisionConfig, max_patches: int) -> list[int]:
    """Powers of two up to the most windows an image of at most `max_patches` patches
    (of any aspect ratio) lays out in."""
    m = cfg.spatial_merge_size
    units = max_patches // (m * m)
    most = max(qwen2_5_vl.count_windows(h * m, units // h * m, cfg) for h in range(1, units + 1))
    buckets = [1]
    while buckets[-1] < most:
        buckets.append(buckets[-1] * 2)
    return buckets


class ImageEncoder:
    def __init__(self, cfg: VisionConfig | QwenVisionConfig, params, num_slots: int, dtype,
                 sharding, max_patches: int | None = None, broadcaster=None):
        self.cfg = cfg
        self.params = params
        # Multi-host process 0's (broadcast.py): the others run each encode it starts.
        self.broadcaster = broadcaster
        self._abstract = jax.ShapeDtypeStruct((num_slots, cfg.text_hidden_size),
                                              jnp.dtype(dtype), sharding=sharding)
        self.buffer = self._zeros()
        self.qwen = isinstance(cfg, QwenVisionConfig)
        encode = _encode_qwen if self.qwen else _encode_fixed
        self._encode = jax.jit(functools.partial(encode, cfg=cfg), donate_argnums=(1,),
                               out_shardings=sharding)
        # The shapes compiled for: Qwen2.5-VL's window counts (one program for LLaVA).
        self.buckets = window_buckets(cfg, max_patches) if self.qwen else [0]
        self._compiled: dict[int, object] = {}
        self.compiles_after_warmup = 0
        self.seconds = 0.0  # host time spent dispatching encodes (not the device's)

    def _zeros(self) -> jax.Array:
        a = self._abstract
        return jax.jit(lambda: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding)()

    def warmup(self) -> None:
        """Compile every bucket's program (ahead of time: nothing runs)."""
        for bucket in self.buckets:
            if bucket not in self._compiled:
                args = jax.device_put(self.empty(bucket), self._abstract.sharding)
                self._compiled[bucket] = self._encode.lower(self.params, self.buffer,
                                                            *args).compile()

    def empty(self, bucket: int) -> tuple[np.ndarray, ...]:
        nowhere = self._abstract.shape[0]
        if not self.qwen:
            size = self.cfg.image_size
            return (np.zeros((3, size, size), np.float32),
                    np.full(self.cfg.tokens_per_image, nowhere, np.int32))
        n = bucket * self.cfg.window_patches
        return (np.zeros((n, self.cfg.patch_dim), np.float32), np.zeros((n, 2), np.int32),
                np.zeros(n, np.bool_),
                np.full(n // self.cfg.spatial_merge_size ** 2, nowhere, np.int32))

    def _inputs(self, image: ImageInput, rows: np.ndarray) -> tuple[int, tuple]:
        """(bucket, program inputs) of an image whose tokens' rows are `rows` (as `_empty`
        makes them: the other hosts' templates)."""
        if not self.qwen:
            return 0, (np.asarray(image.pixels, np.float32), np.asarray(rows, np.int32))
        cfg = self.cfg
        windows = qwen2_5_vl.count_windows(*image.grid, cfg)
        bucket = next((b for b in self.buckets if b >= windows), None)
        if bucket is None:
            raise ValueError(f"an image of {windows} windows is larger than the largest "
                             f"compiled ({self.buckets[-1]})")
        lay = qwen2_5_vl.layout(*image.grid, cfg, bucket)
        patches = np.where(lay.valid[:, None], image.pixels[np.maximum(lay.patch, 0)], 0)
        dest = np.where(lay.token >= 0, rows[np.maximum(lay.token, 0)],
                        self._abstract.shape[0]).astype(np.int32)
        return bucket, (patches.astype(np.float32), lay.positions.astype(np.int32),
                        lay.valid.astype(np.bool_), dest)

    def encode(self, image: ImageInput, rows: np.ndarray) -> None:
        """Start encoding `image` into `rows` (the step after reads them); on several hosts
        the others are sent the program's inputs first."""
        start = time.perf_counter()
        bucket, args = self._inputs(image, rows)
        if self.broadcaster is not None:
            self.broadcaster.send_encode(bucket, args)
        self.run(bucket, args)
        self.seconds += time.perf_counter() - start

    def run(self, bucket: int, args: tuple) -> None:
        """Run bucket `bucket`'s program on its inputs (`_inputs`); a follower's `encode`."""
        args = jax.device_put(args, self._abstract.sharding)
        program = self._compiled.get(bucket)
        if program is None:
            self.compiles_after_warmup += bool(self._compiled)
            log.warning("compiling the vision tower for bucket %d (not warmed up)", bucket)
            program = self._compiled[bucket] = self._encode.lower(
                self.params, self.buffer, *args).compile()
        self.buffer = program(self.params, self.buffer, *args)

    def recover(self) -> None:
        """After a failed step: a new buffer if the old one was consumed (the cache's
        rows are then stale: the caller forgets them)."""
        if self.buffer.is_deleted():
            self.buffer = self._zeros()
