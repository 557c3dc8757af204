"""A request's images: decoded, checked, turned into the tower's pixels and hashed
(`ImageInput`), and placed in its prompt (`ImageSpan`): each image's placeholder token
stands for `tokens_per_image` tokens, whose embeddings the vision tower computes."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

from jaxserve.config import VisionConfig

# Images larger than this many pixels are refused before they are decoded.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One image as the tower reads it: `[3, H, W]` float32 pixels and their content
    hash (which keys the encoder cache and the prefix cache's pages)."""

    pixels: np.ndarray
    hash: bytes
    num_tokens: int


@dataclasses.dataclass(eq=False)
class ImageSpan:
    """Where an image's tokens lie in a prompt, and (while its sequence holds it in the
    encoder cache) the buffer row of each of its tokens' embeddings."""

    image: ImageInput
    start: int
    slots: np.ndarray | None = None

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


def open_image(data, what: str = "image", max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """A PIL image from a PIL image, encoded bytes or a `[H, W(, C)]` uint8 array; a
    ValueError naming `what` for anything else, an undecodable file or one over
    `max_pixels` (checked from its header, before decoding: no decompression bomb)."""
    if isinstance(data, Image.Image):
        image = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        try:
            image = Image.open(io.BytesIO(bytes(data)))
        except Image.DecompressionBombError:  # Pillow's own limit, far over ours
            raise ValueError(f"{what} has too many pixels; at most {max_pixels} are "
                             "accepted") from None
        except OSError:
            raise ValueError(f"{what} is not an image file Pillow can read (PNG, JPEG, WebP, "
                             "GIF, BMP, ...)") from None
    elif isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim not in (2, 3) or \
                (data.ndim == 3 and data.shape[-1] not in (1, 3, 4)):
            raise ValueError(f"{what}: an array image must be uint8 [H, W] or [H, W, 1|3|4], "
                             f"got {data.dtype} {data.shape}")
        image = Image.fromarray(data[..., 0] if data.ndim == 3 and data.shape[-1] == 1
                                else data)
    else:
        raise ValueError(f"{what} must be a PIL image, image file bytes or a uint8 array, "
                         f"got {type(data).__name__}")
    w, h = image.size
    if w < 1 or h < 1 or w * h > max_pixels:
        raise ValueError(f"{what} is {w}x{h} pixels; at most {max_pixels} are accepted")
    try:
        image.load()
    except (OSError, Image.DecompressionBombError, ValueError) as e:
        raise ValueError(f"{what} could not be decoded: {e}") from None
    return image


def process_image(image: Image.Image, processor: Callable[[Image.Image], np.ndarray],
                  cfg: VisionConfig) -> ImageInput:
    pixels = np.ascontiguousarray(processor(image), np.float32)
    expected = (3, cfg.image_size, cfg.image_size)
    if pixels.shape != expected:
        raise ValueError(f"the image processor made pixels {pixels.shape}, the vision tower "
                         f"reads {expected}: its preprocessor_config.json does not fit the "
                         "model")
    digest = hashlib.blake2b(repr(pixels.shape).encode() + pixels.tobytes(), digest_size=16)
    return ImageInput(pixels, digest.digest(), cfg.tokens_per_image)


@dataclasses.dataclass(frozen=True)
class ImagePreparer:
    """Turns a request's images into ImageInputs (`__call__`): all a server needs of the
    model to do it off the engine's thread (or process)."""

    cfg: VisionConfig
    processor: Callable[[Image.Image], np.ndarray]
    max_per_prompt: int | None = None  # limit_mm_per_prompt["image"]

    def __call__(self, images: Sequence, names: Sequence[str] | None = None
                 ) -> list[ImageInput]:
        """PIL images, image file bytes, uint8 arrays or ImageInputs already, as the tower
        reads them; ValueError naming the bad one (as `names` does: where each came from;
        default "image i")."""
        if self.max_per_prompt is not None and len(images) > self.max_per_prompt:
            raise ValueError(f"{len(images)} images in one prompt; at most "
                             f"{self.max_per_prompt} are allowed (limit_mm_per_prompt)")
        names = names or [f"image {i}" for i in range(len(images))]
        return [image if isinstance(image, ImageInput) else
                process_image(open_image(image, name), self.processor, self.cfg)
                for image, name in zip(images, names)]


def place_images(token_ids: list[int], images: Sequence[ImageInput], cfg: VisionConfig
                 ) -> tuple[list[int], list[ImageSpan]]:
    """The prompt with each image's placeholder standing for its tokens, and where they
    lie. A placeholder is one `image_token_id` (expanded here) or already a run of
    `tokens_per_image` of them (as transformers' processors write prompts); their number
    must be the images'."""
    token, n = cfg.image_token_id, cfg.tokens_per_image
    runs, i = [], 0
    while i < len(token_ids):
        if token_ids[i] == token:
            j = i
            while j < len(token_ids) and token_ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if n > 1 and any(length not in (1, n) for _, length in runs):
        # Runs of several whole placeholders, back to back.
        runs = [(s + k * n, n) for s, length in runs for k in range(length // n)] \
            if all(length % n == 0 for _, length in runs) else None
        if runs is None:
            raise ValueError(f"the prompt's image placeholders (token {token}) must each be "
                             f"one token or a run of {n}")
    if len(runs) != len(images):
        raise ValueError(f"the prompt has {len(runs)} image placeholder(s) (token {token}) "
                         f"for {len(images)} image(s)")
    out, spans, last = [], [], 0
    for (start, length), image in zip(runs, images):
        out += token_ids[last:start]
        spans.append(ImageSpan(image, len(out)))
        out += [token] * n
        last = start + length
    return out + token_ids[last:], spans
