"""An engine's images, end to end: decoding and processing a request's images (`prepare`,
any thread), placing them in its prompt (`place`), encoding those newly given rows before
the step that reads them (`upload`) and letting go of them once the prompt is computed
past them (`done`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

from jaxserve.config import Gemma3VisionConfig, QwenVisionConfig, VisionConfig
from jaxserve.engine.multimodal.encoder import ImageEncoder
from jaxserve.engine.multimodal.encoder_cache import EncoderCache
from jaxserve.engine.multimodal.inputs import (
    ImageInput, ImagePreparer, ImageSpan, image_text, place_images)
from jaxserve.models.vision import qwen2_5_vl

# With no mm_encoder_cache_tokens: rows for this many images (at least one step's tokens).
DEFAULT_CACHED_IMAGES = 8


@dataclasses.dataclass
class ImageStats:
    images_encoded: int  # images the tower encoded
    encoder_cache_hits: int  # images a request found already encoded
    encoder_seconds: float  # host time dispatching encodes
    encoder_cache_used_tokens: int
    encoder_cache_tokens: int


VisionConfigs = VisionConfig | QwenVisionConfig | Gemma3VisionConfig


class Images:
    """`num_slots`: the encoder cache's rows (None: DEFAULT_CACHED_IMAGES of the largest
    image, at least `max_num_batched_tokens`); `max_per_prompt`: images a prompt may carry
    (None: no limit but the cache's); `token_text`: a token id's text (Gemma 3's image
    markers are written out with it)."""

    def __init__(self, cfg: VisionConfigs, params, processor: Callable[[Image.Image], np.ndarray],
                 num_slots: int | None, max_per_prompt: int | None, max_num_batched_tokens: int,
                 dtype, sharding, token_text: Callable[[int], str] | None = None,
                 broadcaster=None):
        self.cfg = cfg
        self.preparer = ImagePreparer(cfg, processor, max_per_prompt,
                                      image_text(cfg, token_text) if token_text else None)
        max_patches = getattr(processor, "max_patches", None)  # images of any size
        most = (max_patches // cfg.spatial_merge_size ** 2 if max_patches is not None
                else cfg.tokens_per_image)  # tokens of the largest image
        if num_slots is None:
            num_slots = max(max_num_batched_tokens, DEFAULT_CACHED_IMAGES * most)
        self.cache = EncoderCache(num_slots)
        if self.cache.pages_for(most) > self.cache.num_pages:
            raise ValueError(f"mm_encoder_cache_tokens ({num_slots}) cannot hold the largest "
                             f"image ({most} tokens)")
        self.encoder = ImageEncoder(cfg, params, self.cache.num_slots, dtype, sharding,
                                    max_patches, broadcaster)
        # Gemma 3's images are seen whole: a step computes all of an image's tokens.
        self.whole = isinstance(cfg, Gemma3VisionConfig)
        if self.whole and most > max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must hold an "
                             f"image's {most} tokens (Gemma 3 computes an image in one step)")

    def prepare(self, images: Sequence, names: Sequence[str] | None = None
                ) -> list[ImageInput]:
        """A request's images (PIL images, encoded bytes, uint8 arrays or ImageInputs
        already) as the tower reads them; ValueError naming the bad one. Touches no
        engine state: any thread may call it."""
        out = self.preparer(images, names)
        if not self.cache.fits(out):
            raise ValueError(f"the prompt's {len(out)} images need more rows than the "
                             f"encoder cache has ({self.cache.num_slots} tokens); raise "
                             "mm_encoder_cache_tokens")
        return out

    def place(self, token_ids: list[int], images: list[ImageInput]
              ) -> tuple[list[int], list[ImageSpan], np.ndarray | None, int]:
        """A prompt with its images' placeholders expanded, where the images lie, and with
        M-RoPE, its tokens' offsets and the delta after it (Sequence.rope_offsets; else
        None, 0). ValueError when the images do not fit the placeholders."""
        token_ids, spans = place_images(token_ids, images, self.cfg)
        if not isinstance(self.cfg, QwenVisionConfig):
            return token_ids, spans, None, 0
        offsets, delta = qwen2_5_vl.rope_offsets(
            len(token_ids), [(s.start, s.image.grid) for s in spans], self.cfg)
        return token_ids, spans, offsets, delta

    def upload(self) -> None:
        """Encode the images the scheduler just gave rows."""
        for image, rows in self.cache.take_uploads():
            self.encoder.encode(image, rows)

    def done(self, scheduled) -> None:
        """Let go of the images of the scheduled seqs whose prompts this step computes
        past them (their K/V hold them from now on)."""
        for s in scheduled:
            seq = s.seq
            if seq.images and s.start + s.num_new_tokens >= seq.images[-1].end:
                self.cache.release(seq)

    def warmup(self) -> None:
        self.encoder.warmup()

    def recover(self) -> None:
        """After a failed step (every running seq ended): if the buffer was lost, so are
        the cached images."""
        if self.encoder.buffer.is_deleted():
            self.encoder.recover()
            self.cache.forget_idle()

    def stats(self) -> ImageStats:
        c = self.cache
        return ImageStats(c.num_encoded, c.num_hits, self.encoder.seconds, c.num_used_slots,
                          c.num_slots)
