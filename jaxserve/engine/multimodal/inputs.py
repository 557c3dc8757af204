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

from jaxserve.config import Gemma3VisionConfig, QwenVisionConfig, VisionConfig

# Images larger than this many pixels are refused before they are decoded.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One image as the tower reads it: float32 pixels (`[3, H, W]`; Qwen2.5-VL's
    `[patches, patch_dim]` with their `grid` of rows and columns), its content hash
    (which keys the encoder cache and the prefix cache's pages) and how many tokens
    stand for it in a prompt."""

    pixels: np.ndarray
    hash: bytes
    num_tokens: int
    grid: tuple[int, int] | None = None


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
                  cfg: VisionConfig | QwenVisionConfig | Gemma3VisionConfig) -> ImageInput:
    out = processor(image)
    if isinstance(cfg, QwenVisionConfig):  # patches and their grid
        pixels, grid = out
        num_tokens = grid[0] * grid[1] // cfg.spatial_merge_size ** 2
    else:
        pixels, grid, num_tokens = out, None, cfg.tokens_per_image
        expected = (3, cfg.image_size, cfg.image_size)
        if pixels.shape != expected:
            raise ValueError(f"the image processor made pixels {pixels.shape}, the vision "
                             f"tower reads {expected}: its preprocessor_config.json does not "
                             "fit the model")
    pixels = np.ascontiguousarray(pixels, np.float32)
    digest = hashlib.blake2b(repr((pixels.shape, grid)).encode() + pixels.tobytes(),
                             digest_size=16)
    return ImageInput(pixels, digest.digest(), num_tokens, grid)


@dataclasses.dataclass(frozen=True)
class ImagePreparer:
    """Turns a request's images into ImageInputs (`__call__`): all a server needs of the
    model to do it off the engine's thread (or process)."""

    cfg: VisionConfig | QwenVisionConfig | Gemma3VisionConfig
    processor: Callable[[Image.Image], np.ndarray]
    max_per_prompt: int | None = None  # limit_mm_per_prompt["image"]
    # Gemma 3: what an image's marker in prompt text (<start_of_image>) is written out as,
    # as its processor does before tokenizing (None: nothing to write out).
    image_text: tuple[str, str] | None = None

    def expand_text(self, text: str) -> str:
        """Prompt text with each image's marker written out (Gemma 3), else as it is."""
        return text if self.image_text is None else text.replace(*self.image_text)

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


def image_text(cfg: VisionConfig | QwenVisionConfig | Gemma3VisionConfig, token_text
               ) -> tuple[str, str] | None:
    """Gemma 3's (marker, what it stands for) in prompt text: "\n\n<start_of_image>",
    the soft tokens and "<end_of_image>\n\n" (`token_text`: an id's text); else None."""
    if not isinstance(cfg, Gemma3VisionConfig):
        return None
    boi, soft, eoi = (token_text(t) for t in (cfg.boi_token_id, cfg.image_token_id,
                                               cfg.eoi_token_id))
    return boi, f"\n\n{boi}{soft * cfg.tokens_per_image}{eoi}\n\n"


def place_images(token_ids: list[int], images: Sequence[ImageInput],
                 cfg: VisionConfig | QwenVisionConfig | Gemma3VisionConfig
                 ) -> tuple[list[int], list[ImageSpan]]:
    """The prompt with each image's placeholder standing for its tokens, and where they
    lie. A placeholder is one `image_token_id` (expanded here) or already a run of as many
    as the image has tokens (as transformers' processors write prompts), in the images'
    order; their number must be the images'."""
    token = cfg.image_token_id
    out, spans, i, k = [], [], 0, 0
    while i < len(token_ids):
        if token_ids[i] != token:
            out.append(token_ids[i])
            i += 1
            continue
        run = i
        while run < len(token_ids) and token_ids[run] == token:
            run += 1
        while i < run:  # placeholders back to back: each one token or a whole image's
            if k == len(images):
                raise ValueError(f"the prompt has more image placeholders (token {token}) "
                                 f"than the {len(images)} image(s) given")
            n = images[k].num_tokens
            step = n if run - i >= n else 1
            spans.append(ImageSpan(images[k], len(out)))
            out += [token] * n
            i += step
            k += 1
    if k != len(images):
        raise ValueError(f"the prompt has {k} image placeholder(s) (token {token}) for "
                         f"{len(images)} image(s)")
    return out, spans
