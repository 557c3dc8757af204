"""Images to the pixel arrays a vision tower reads, as Hugging Face's image processors make
them (their Pillow backends: transformers' `*ImageProcessorPil`), with numpy and Pillow.

CLIP's (LLaVA): RGB (transparency composited on white), the shortest edge resized to
`size["shortest_edge"]` (bicubic, the long edge truncated to an integer), a centre crop of
`crop_size`, pixels scaled by 1/255 and normalised by the mean and std, channels first.

Gemma 3's (SigLIP's): CLIP's steps with a square bilinear resize, no crop, mean and std
0.5.

Qwen2-VL's (Qwen2.5-VL): RGB, resized (bicubic) to the nearest multiples of patch x merge
pixels with between `min_pixels` and `max_pixels` in all (`smart_resize`), scaled and
normalised, then cut into patches of `temporal_patch_size` frames (a still image
repeated) x patch x patch pixels, 2 x 2 merge units row-major, each unit's patches
row-major: `[patches, 3 x frames x patch^2]` and the grid (rows, columns) of patches.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class PixelScaling:
    """The processors' last steps: pixels times `rescale_factor` (in float64, as
    transformers), then (x - mean) / std per channel; float32 `[C, H, W]`."""

    do_rescale: bool = True
    do_normalize: bool = True
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, config: dict) -> "PixelScaling":
        return cls(do_rescale=config.get("do_rescale", True),
                   do_normalize=config.get("do_normalize", True),
                   rescale_factor=config.get("rescale_factor", 1 / 255),
                   mean=tuple(config.get("image_mean", OPENAI_CLIP_MEAN)),
                   std=tuple(config.get("image_std", OPENAI_CLIP_STD)))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.mean, np.float32)[:, None, None]
            std = np.asarray(self.std, np.float32)[:, None, None]
            x = ((x - mean) / std).astype(np.float32)
        return x.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ClipImageProcessor:
    shortest_edge: int | None = 224  # None: resize to (height, width)
    height: int = 224  # of the resize when shortest_edge is None
    width: int = 224
    crop_height: int = 224
    crop_width: int = 224
    do_resize: bool = True
    do_center_crop: bool = True
    do_convert_rgb: bool = True
    scaling: PixelScaling = PixelScaling()
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_config(cls, config: dict) -> "ClipImageProcessor":
        size = config.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = config.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if config.get("use_square_size") and "shortest_edge" in size:
            size = {"height": size["shortest_edge"], "width": size["shortest_edge"]}
        return cls(
            shortest_edge=size.get("shortest_edge"), height=size.get("height", 224),
            width=size.get("width", 224), crop_height=crop["height"], crop_width=crop["width"],
            do_resize=config.get("do_resize", True),
            do_center_crop=config.get("do_center_crop", True),
            do_convert_rgb=config.get("do_convert_rgb", True),
            scaling=PixelScaling.from_config(config),
            resample=config.get("resample", Image.Resampling.BICUBIC))

    @property
    def output_size(self) -> tuple[int, int]:
        if self.do_center_crop:
            return self.crop_height, self.crop_width
        if self.shortest_edge is None:
            return self.height, self.width
        raise ValueError("a shortest-edge resize without a centre crop makes images of "
                         "varying sizes, which this model's tower cannot take")

    def __call__(self, image: Image.Image) -> np.ndarray:
        """`[3, H, W]` float32 pixels."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            image = image.resize(self._resized(image.size)[::-1], resample=self.resample)
        x = np.moveaxis(np.asarray(image), -1, 0) if image.mode != "L" else \
            np.asarray(image)[None]
        if self.do_center_crop:
            x = center_crop(x, self.crop_height, self.crop_width)
        return self.scaling(x)

    def _resized(self, size: tuple[int, int]) -> tuple[int, int]:
        """(height, width) after the resize, from PIL's (width, height)."""
        if self.shortest_edge is None:
            return self.height, self.width
        w, h = size
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(self.shortest_edge * long / short)
        return (new_long, self.shortest_edge) if w <= h else (self.shortest_edge, new_long)


@dataclasses.dataclass(frozen=True)
class QwenImageProcessor:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    scaling: PixelScaling = PixelScaling()
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_config(cls, config: dict) -> "QwenImageProcessor":
        size = config.get("size") or {}
        return cls(
            min_pixels=config.get("min_pixels") or size.get("shortest_edge", 56 * 56),
            max_pixels=config.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280),
            patch_size=config.get("patch_size", 14),
            temporal_patch_size=config.get("temporal_patch_size", 2),
            merge_size=config.get("merge_size", 2),
            scaling=PixelScaling.from_config(config),
            resample=config.get("resample", Image.Resampling.BICUBIC))

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        """(`[patches, 3 x frames x patch^2]` float32, (rows, columns) of patches)."""
        image = to_rgb(image)
        h, w = smart_resize(image.height, image.width, self.patch_size * self.merge_size,
                            self.min_pixels, self.max_pixels)
        image = image.resize((w, h), resample=self.resample)
        x = self.scaling(np.moveaxis(np.asarray(image), -1, 0))
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.astype(np.float32).reshape(3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # units, then patches within, then (c, y, x)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p)), (gh, gw)

    @property
    def max_patches(self) -> int:
        return self.max_pixels // self.patch_size ** 2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """Qwen2-VL's: the size nearest (height, width) in multiples of `factor`, with its
    pixels within [min_pixels, max_pixels], the aspect ratio kept as well as may be."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio is over 200 ({width}x{height})")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre `[C, height, width]` of `[C, H, W]`, zero-padded where it is smaller
    (transformers' center_crop)."""
    _, h, w = x.shape
    if h < height or w < width:
        top, left = max(0, (height - h) // 2), max(0, (width - w) // 2)
        padded = np.zeros((x.shape[0], max(h, height), max(w, width)), x.dtype)
        padded[:, top:top + h, left:left + w] = x
        x, h, w = padded, padded.shape[1], padded.shape[2]
    top, left = (h - height) // 2, (w - width) // 2
    return x[:, top:top + height, left:left + width]


def load_image_processor(model_dir: str | Path, image_size: int | None
                         ) -> ClipImageProcessor | QwenImageProcessor:
    """The image processor a checkpoint directory describes: in preprocessor_config.json
    (the hub's files), or under "image_processor" in processor_config.json (transformers
    5's `save_pretrained`); with neither, CLIP's resized and cropped to `image_size` (None:
    Qwen2-VL's defaults)."""
    path = Path(model_dir) / "preprocessor_config.json"
    if path.exists():
        config = json.loads(path.read_text())
    else:
        path = Path(model_dir) / "processor_config.json"
        config = json.loads(path.read_text()).get("image_processor") if path.exists() else None
    if config is None and image_size is None:
        config = {"image_processor_type": "Qwen2VLImageProcessor"}
    elif config is None:
        config = {"size": {"shortest_edge": image_size},
                  "crop_size": {"height": image_size, "width": image_size}}
    kind = config.get("image_processor_type", "CLIPImageProcessor")
    if kind.startswith("Qwen2VLImageProcessor"):
        return QwenImageProcessor.from_config(config)
    if kind.startswith(("Gemma3ImageProcessor", "SiglipImageProcessor")):
        if config.get("do_pan_and_scan"):
            raise ValueError(f"{path}: do_pan_and_scan (Gemma 3's crops) is not supported")
        # A square resize (bilinear), no crop, mean and std 0.5 (ImageNet's "standard").
        return ClipImageProcessor.from_config({
            "do_center_crop": False, "resample": Image.Resampling.BILINEAR,
            "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5),
            "size": {"height": 224, "width": 224}, **config})
    if not kind.startswith("CLIPImageProcessor"):
        raise ValueError(f"{path}: image processor {kind!r} is not supported (CLIP's, "
                         "Gemma 3's and Qwen2-VL's are)")
    return ClipImageProcessor.from_config(config)
