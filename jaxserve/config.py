"""Model and engine configuration: frozen dataclasses, from a Hugging Face config.json or YAML.

Model presets in `configs/models/*.yaml` use Hugging Face's config.json key names, so one
mapping (`ModelConfig.from_hf`) serves checkpoints and presets alike.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from pallas_kernels.ragged_paged_attention.work_items import MAX_TREE_NODES
from sharding.strategies import MESH_AXES, STRATEGIES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                         "qwen3_moe", "gemma2", "gemma3_text", "deepseek_v2", "deepseek_v3",
                         "gpt_oss")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DTYPES = ("bfloat16", "float32")
# kv_cache_dtype names and the dtype each stores ("auto": the model's dtype).
KV_CACHE_DTYPES = {"auto": None, "int8": "int8", "fp8": "float8_e4m3fn"}
KERNEL_IMPLS = ("reference", "tpu", "gpu", "cpu")
QUANTIZATIONS = ("int8", "int4", "fp8", "fp4")
LM_HEAD_QUANTIZATIONS = ("int8", "int4")
SPECULATIVE_METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "mtp")
_NO_MODEL_METHODS = ("ngram", "mtp")  # n-gram needs none; mtp reads the target's own files


def _check_group(name: str, group, kind: str | None) -> None:
    """A group size: a positive integer (even for int4 and fp4), or unset."""
    if group is not None and (not isinstance(group, int) or group < 1
                              or (kind in ("int4", "fp4") and group % 2)):
        raise ValueError(f"{name} must be a positive integer (even for int4 and fp4), or unset; "
                         f"got {group!r}")


def _check_overrides(overrides, quantization: str | None) -> tuple:
    """`quant_overrides` as a tuple of (path, kind, group size, zero points) tuples (a YAML
    file or a converted checkpoint's manifest gives lists), each entry validated."""
    checked = []
    for entry in overrides or ():
        if isinstance(entry, (str, bytes)) or len(entry) != 4:
            raise ValueError(f"quant_overrides entries are [path, kind, group size, zero "
                             f"points], e.g. ['layers.3.mlp.down_proj', 'int8', 16, false]; "
                             f"got {entry!r}")
        path, kind, group, zero_points = entry
        if not isinstance(path, str) or kind not in ("int8", "int4", None) or \
                not isinstance(zero_points, bool) or (kind is None and (group or zero_points)):
            raise ValueError(f"quant_overrides entry {list(entry)!r}: a parameter path, "
                             f"'int8' or 'int4', a group size and true/false for zero points "
                             f"(or null, null, false: the layer in the model's dtype)")
        _check_group(f"quant_overrides {path!r}: the group size", group, kind)
        checked.append((path, kind, group, zero_points))
    integer = quantization in ("int8", "int4")
    if any(path != "embed" and not (integer or (kind is None and quantization))
           for path, kind, *_ in checked):
        raise ValueError("quant_overrides name layers held in another integer format than "
                         "`quantization`'s; set quantization: int4 or int8 (only an 'embed' "
                         "entry, a quantized embedding, stands without it; a layer held in "
                         "the model's dtype needs some quantization)")
    if len({path for path, *_ in checked}) < len(checked):
        raise ValueError("quant_overrides names a layer twice")
    return tuple(checked)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, shaped like vLLM's `speculative_config`.

    `method` "ngram" (prompt lookup): the proposer matches the last `prompt_lookup_max`
    down to `prompt_lookup_min` tokens of a sequence against its earlier tokens (prompt and
    output) and proposes `num_speculative_tokens` tokens that followed a match.
    "draft_model": `model`, a smaller checkpoint with the target's vocabulary, proposes its
    next `num_speculative_tokens` tokens (the method when only `model` is given).
    "medusa": `model`, a directory of Medusa heads (config.json and medusa_lm_head.*),
    guesses with its first `num_speculative_tokens` heads from the target's hidden state.
    "eagle" / "eagle3": `model`, an EAGLE-1 / EAGLE-3 head (config.json and weights),
    guesses `num_speculative_tokens` tokens from the target's features.
    "mtp": DeepSeek-V3's (and R1's) multi-token-prediction layer, in the target's own
    checkpoint (no `model`), guesses them as an EAGLE-1 head does (models/mtp.py).
    The step verifies the drafts as extra query tokens (engine/speculative/).
    `speculative_token_tree` (Medusa and EAGLE; vLLM's, as a list or its string): the tree
    of candidates to verify instead of a chain, as paths of ranks, e.g. [[0], [1], [0, 0]]
    (the two most likely first tokens, and the most likely second token after the most
    likely first), every path's parent in it, at most 32 paths, none deeper than
    `num_speculative_tokens` (engine/speculative/drafts.py).
    Speculation stops while more than `disable_by_batch_size` sequences run, and in steps
    that compute prompt tokens (None: never): such steps are compute-bound, and guessed
    tokens only add work.
    `sampled_drafts` (the draft model, EAGLE chains): a request that samples (temperature
    > 0) gets guesses drawn from the proposer's own distribution (with the request's
    logit bias, banned tokens, temperature, top-k, top-p and min-p), which the step keeps
    with probability min(1, p / q) (rejection sampling: the output follows the target's
    distribution either way, and more guesses are kept than greedy ones where the
    distributions are wide); false: greedy guesses, for which a seeded request gets the
    very tokens it gets without speculation.
    """

    method: str | None = None  # None: "draft_model" with a model, else "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 8
    model: str | None = None  # the draft model's checkpoint directory
    speculative_token_tree: Any = None  # kept as a tuple of paths in depth-first order
    sampled_drafts: bool = True

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method not in _NO_MODEL_METHODS and not self.model:
            raise ValueError(f"speculative_config: method {self.method!r} needs model, the "
                             "directory of the draft checkpoint, the Medusa heads or the "
                             "EAGLE head")
        if self.method in _NO_MODEL_METHODS and self.model is not None:
            raise ValueError(f"speculative_config: method {self.method!r} takes no model")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"exceeds prompt_lookup_max ({self.prompt_lookup_max})")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be a positive "
                             f"integer or null, got {limit!r}")
        if not isinstance(self.sampled_drafts, bool):
            raise ValueError(f"speculative_config: sampled_drafts must be true or false, got "
                             f"{self.sampled_drafts!r}")
        if self.speculative_token_tree is not None:
            object.__setattr__(self, "speculative_token_tree", self._tree())

    def _tree(self) -> tuple[tuple[int, ...], ...]:
        """The tree's paths, checked, in depth-first order with ranks ascending."""
        def bad(why: str) -> ValueError:
            return ValueError(f"speculative_config: speculative_token_tree {why}")

        if self.method not in ("medusa", "eagle", "eagle3", "mtp"):
            raise bad(f"needs method 'medusa', 'eagle', 'eagle3' or 'mtp' (got "
                      f"{self.method!r}): only their heads propose trees")
        tree = self.speculative_token_tree
        if isinstance(tree, str):
            try:
                tree = ast.literal_eval(tree)
            except (ValueError, SyntaxError):
                raise bad(f"must be a list of paths such as [[0], [1], [0, 0]], got "
                          f"{tree!r}") from None
        if not isinstance(tree, (list, tuple)) or not tree:
            raise bad(f"must be a non-empty list of paths, got {tree!r}")
        paths = []
        for path in tree:
            if (not isinstance(path, (list, tuple)) or not path or
                    not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                            for r in path)):
                raise bad(f"paths are non-empty lists of ranks >= 0, got {path!r}")
            paths.append(tuple(path))
        if len(set(paths)) != len(paths):
            raise bad("lists a path twice")
        if len(paths) > MAX_TREE_NODES:
            raise bad(f"has {len(paths)} paths; at most {MAX_TREE_NODES} (the attention "
                      "kernels' tree masks are 32 bits)")
        for path in paths:
            if len(path) > 1 and path[:-1] not in paths:
                raise bad(f"has {list(path)} without its parent {list(path[:-1])}")
            if len(path) > self.num_speculative_tokens:
                raise bad(f"path {list(path)} is deeper than num_speculative_tokens "
                          f"({self.num_speculative_tokens}), the heads it may use")
        return tuple(sorted(paths))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpeculativeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**data)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("grpc", "jax")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """Prefilling on one engine and decoding on another (docs/disaggregation.md), shaped
    like vLLM's `kv_transfer_config`. `kv_role` "kv_producer": the engine prefills, and a
    request added with `remote_decode` ends after its first token with its prompt's K/V
    handed out; "kv_consumer": it decodes requests added `prefilled` (their K/V and
    first token made elsewhere); "kv_both": either. The page programs of the role compile
    at warm-up."""

    kv_role: str = "kv_both"
    # Servers (server/kv_transfer.py): `kv_connector` "grpc" moves K/V as bytes over
    # gRPC through host memory (any two machines); "jax" device to device with
    # jax.experimental.transfer (the producer's choice; consumers take either). A
    # producer serves its handed-off K/V on
    # `kv_host`:`kv_port` (0: a free port), named to decode servers as
    # `kv_advertise_host` (default kv_host):port, held `kv_hold_seconds` for them to pull,
    # streamed in chunks of `kv_chunk_bytes`; a consumer gives a pull `kv_pull_timeout`
    # seconds.
    kv_connector: str = "grpc"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_advertise_host: str | None = None
    kv_hold_seconds: float = 30.0
    kv_chunk_bytes: int = 4 << 20
    kv_pull_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {KV_ROLES}, got "
                             f"{self.kv_role!r}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector must be one of "
                             f"{KV_CONNECTORS}, got {self.kv_connector!r}")
        for name in ("kv_hold_seconds", "kv_pull_timeout", "kv_chunk_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv_transfer_config: {name} must be positive, got "
                                 f"{getattr(self, name)!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be a port number (0: any "
                             f"free one), got {self.kv_port!r}")

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVTransferConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding frequency scaling: 'default', 'linear', 'llama3', 'yarn' or
    'longrope'. YaRN: `beta_fast` / `beta_slow` bound the frequencies interpolated by
    `factor`; the rotated q and k are scaled by `attention_factor` (None: from `factor`,
    `mscale` and `mscale_all_dim`, as transformers' `_compute_yarn_parameters` infers it).
    LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): each frequency divided by its
    `short_factor`, or its `long_factor` where `use_long_factor` (the engine's context is
    longer than `original_max_position_embeddings`: ModelConfig.for_context), q and k
    scaled by `attention_factor` (None: from `factor`, as `_compute_longrope_parameters`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    use_long_factor: bool = False


# What config.json leaves out of a LLaVA checkpoint's nested configs takes transformers'
# defaults (llava-1.5's hub config names only what differs from LlamaConfig's and
# CLIPVisionConfig's): those used here.
_LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32,
                       max_position_embeddings=2048, rms_norm_eps=1e-6)
_CLIP_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                             num_attention_heads=12, image_size=224, patch_size=32,
                             layer_norm_eps=1e-5, hidden_act="quick_gelu")
# LlavaConfig's tower when config.json names none (llava-1.5's CLIP ViT-L/14 at 336).
_LLAVA_VISION_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=336, patch_size=14)
VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's image side (models/vision/): its vision tower, the
    projector into the language model, and the token that stands for an image's embeddings
    in a prompt (`tokens_per_image` of them per image).

    LLaVA ("llava"): a CLIP ViT whose hidden states after layer(s) `feature_layers`
    (negative: from the end; HF's `vision_feature_layer`, -2 = before the last layer) are
    the image's features, without the class token when `feature_select` is "default"
    ("full": with it), through a two-layer MLP projector (`projector_act`)."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    text_hidden_size: int
    image_token_id: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    feature_layers: tuple[int, ...] = (-2,)
    feature_select: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self) -> None:
        if self.hidden_act not in VISION_ACTIVATIONS or \
                self.projector_act not in VISION_ACTIVATIONS:
            raise ValueError(f"vision activations must be among {VISION_ACTIVATIONS}, got "
                             f"{self.hidden_act!r} / {self.projector_act!r}")
        if self.feature_select not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', "
                             f"got {self.feature_select!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")
        for layer in self.feature_layers:
            if not -self.num_layers - 1 <= layer <= self.num_layers:
                raise ValueError(f"vision_feature_layer {layer} is outside the tower's "
                                 f"{self.num_layers} layers")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + (self.feature_select == "full")

    @property
    def layers_used(self) -> int:
        """The tower's layers the features need (those after the last one read are not
        run; HF's hidden_states[i] is the input of layer i, i = num_layers the output)."""
        return max(x % (self.num_layers + 1) for x in self.feature_layers)

    def num_params(self) -> int:
        e, m, p = self.hidden_size, self.intermediate_size, self.patch_size
        layer = 4 * e * e + 4 * e + 2 * e * m + m + e + 4 * e
        t = self.text_hidden_size
        projector = len(self.feature_layers) * e * t + t * t + 2 * t * self.projector_bias
        return (3 * p * p * e + e + (self.num_patches + 1) * e + 2 * e
                + self.layers_used * layer + projector)

    @classmethod
    def from_llava(cls, hf: dict[str, Any], text_hidden_size: int) -> "VisionConfig":
        vision = hf.get("vision_config")
        v = {**_CLIP_VISION_DEFAULTS, **(_LLAVA_VISION_DEFAULTS if vision is None else {}),
             **(vision or {})}
        if v.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"LLaVA with a {v['model_type']!r} vision tower is not supported "
                             "(only CLIP's)")
        layers = hf.get("vision_feature_layer", -2)
        return cls(
            family="llava", hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"], num_layers=v["num_hidden_layers"],
            num_heads=v["num_attention_heads"], image_size=v["image_size"],
            patch_size=v["patch_size"], layer_norm_eps=v["layer_norm_eps"],
            hidden_act=v["hidden_act"], text_hidden_size=text_hidden_size,
            image_token_id=hf.get("image_token_index", hf.get("image_token_id", 32000)),
            feature_layers=tuple(layers) if isinstance(layers, list) else (layers,),
            feature_select=hf.get("vision_feature_select_strategy", "default"),
            projector_act=hf.get("projector_hidden_act", "gelu"),
            projector_bias=hf.get("multimodal_projector_bias", True))


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    """Gemma 3's image side ("gemma3"): a SigLIP ViT (no class token, learned positions,
    pre-norm layers with biases, tanh-gelu, a final LayerNorm) over `image_size` pixels,
    its patches average-pooled to `tokens_per_image` soft tokens, RMSNorm'd (1 + w) and
    projected into the language model; the language model attends bidirectionally among
    one image's tokens. A prompt marks an image by `boi_token_id` (<start_of_image>), which
    the processor writes out as "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n"."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    text_hidden_size: int
    image_token_id: int  # <image_soft_token>
    tokens_per_image: int = 256
    boi_token_id: int = 255999
    eoi_token_id: int = 256000
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    family: str = "gemma3"

    def __post_init__(self) -> None:
        side = math.isqrt(self.tokens_per_image)
        if side * side != self.tokens_per_image or (self.image_size // self.patch_size) % side:
            raise ValueError(f"mm_tokens_per_image {self.tokens_per_image} must be a square "
                             f"whose side divides the {self.image_size // self.patch_size} "
                             "patches per side")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def pool(self) -> int:
        """Patches per side pooled into one soft token's side."""
        return self.image_size // self.patch_size // math.isqrt(self.tokens_per_image)

    def num_params(self) -> int:
        e, m, p = self.hidden_size, self.intermediate_size, self.patch_size
        layer = 4 * e * e + 4 * e + 2 * e * m + m + e + 4 * e
        return (3 * p * p * e + e + self.num_patches * e + self.num_layers * layer + 2 * e
                + e + e * self.text_hidden_size)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], text_hidden_size: int) -> "Gemma3VisionConfig":
        v = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
             "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
             "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
             **(hf.get("vision_config") or {})}
        return cls(
            hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
            image_size=v["image_size"], patch_size=v["patch_size"],
            text_hidden_size=text_hidden_size,
            image_token_id=hf.get("image_token_index", hf.get("image_token_id", 262144)),
            tokens_per_image=hf.get("mm_tokens_per_image", 256),
            boi_token_id=hf.get("boi_token_index", 255999),
            eoi_token_id=hf.get("eoi_token_index", 256000),
            layer_norm_eps=v["layer_norm_eps"], hidden_act=v["hidden_act"])


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's image side ("qwen2_5_vl"): a ViT over patches of `patch_size` pixels
    (two frames of a still image: `temporal_patch_size`), with 2-D rotary positions, RMSNorm
    and SwiGLU, attention within windows of `window_size` pixels but in the layers
    `fullatt_block_indexes` (over the whole image), then `spatial_merge_size`^2
    neighbouring patches merged into one token by an MLP. An image of any size (resized
    to multiples of patch x merge pixels) is (H / 28) x (W / 28) tokens; the language
    model places them with M-RoPE (ModelConfig.mrope_section)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    text_hidden_size: int
    image_token_id: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    family: str = "qwen2_5_vl"

    def __post_init__(self) -> None:
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size % unit or self.window_size < unit:
            raise ValueError(f"window_size {self.window_size} must be a multiple of "
                             f"patch_size x spatial_merge_size ({unit})")
        if self.hidden_act != "silu":
            raise ValueError(f"Qwen2.5-VL vision hidden_act {self.hidden_act!r} is not "
                             "supported (silu is)")

    @property
    def patch_dim(self) -> int:
        """Values per patch: 3 channels x frames x patch^2."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_patches(self) -> int:
        """Patches in a whole window."""
        return (self.window_size // self.patch_size) ** 2

    def num_params(self) -> int:
        e, m, t = self.hidden_size, self.intermediate_size, self.text_hidden_size
        u = e * self.spatial_merge_size ** 2
        layer = 3 * e * e + 3 * e + e * e + e + 3 * e * m + 2 * m + e + 2 * e
        return self.patch_dim * e + self.num_layers * layer + e + u * u + u + u * t + t

    @classmethod
    def from_hf(cls, hf: dict[str, Any], text_hidden_size: int) -> "QwenVisionConfig":
        v = hf.get("vision_config") or {}
        rope = v.get("rope_parameters") or {}
        return cls(
            hidden_size=v.get("hidden_size", 1280), intermediate_size=v.get("intermediate_size", 3420),
            num_layers=v.get("depth", 32), num_heads=v.get("num_heads", 16),
            text_hidden_size=v.get("out_hidden_size", text_hidden_size),
            image_token_id=hf.get("image_token_id", 151655),
            patch_size=v.get("patch_size", 14),
            temporal_patch_size=v.get("temporal_patch_size", 2),
            spatial_merge_size=v.get("spatial_merge_size", 2),
            window_size=v.get("window_size", 112),
            fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
            hidden_act=v.get("hidden_act", "silu"),
            rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer (the families of models/transformer.py)."""

    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # gpt-oss: a learned logit per query head in every softmax (ragged_paged_attention's
    # `sinks`).
    attention_sinks: bool = False
    # Per layer: "full_attention" or "sliding_attention" (uses sliding_window).
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2 / 3: RMSNorm scaling by (1 + w), embeddings times sqrt(hidden), norms after
    # attention and around the MLP as well ("sandwich"), softmax scale
    # query_pre_attn_scalar ** -0.5, tanh soft-caps of attention scores and final logits,
    # and sliding-window layers with a rope of their own.
    hidden_act: str = "silu"
    norm_offset: bool = False
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_rope_theta: float | None = None  # None: the same rope as full layers
    sliding_rope_scaling: RopeScaling = RopeScaling()
    # Mixture of experts (jaxserve/models/moe.py); num_experts 0 = dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0 = none
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate; DeepSeek's have none
    norm_topk_prob: bool = False
    # DeepSeek's routing (moe.route_grouped; router_scoring "" = the others' softmax
    # top-k): scores "softmax" (V2) or "sigmoid" (V3, plus a per-expert bias that steers
    # the choice, not the weights), experts chosen within the best `topk_group` of
    # `n_group` groups (a group's score: its best expert's (V2) or the sum of its best
    # two (V3, `router_bias`)), weights times routed_scaling_factor.
    router_scoring: str = ""
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # gpt-oss: biases on the router's logits and on each expert's projections, and its
    # clamped SwiGLU: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
    # limit) (swiglu_limit 0: the plain activation of hidden_act).
    expert_biases: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # Per layer: whether its feed-forward is the experts (else the dense MLP).
    sparse_layers: tuple[bool, ...] = ()
    # A vision-language model's image side (None: text only).
    vision: VisionConfig | QwenVisionConfig | Gemma3VisionConfig | None = None
    # M-RoPE (Qwen2.5-VL): the rotary frequencies split in sections, each turned by its
    # own position stream (time, height, width); () for the usual 1-D rope.
    mrope_section: tuple[int, ...] = ()
    # The fraction of each head's dimensions the rope turns (Phi-4-mini: 0.75; the first
    # ones, the rest pass through).
    partial_rotary_factor: float = 1.0
    # DeepSeek-V2/V3's multi-head latent attention (models/latent_attention.py;
    # kv_lora_rank 0: none). Queries through a q_lora_rank bottleneck (0: one projection),
    # each head's qk_nope_head_dim + qk_rope_head_dim wide; keys and values from one
    # kv_lora_rank latent per token, which the cache holds with the rotated
    # qk_rope_head_dim key all heads share: num_kv_heads is 1 and head_dim that width
    # (kv_lora_rank + qk_rope_head_dim), what the cache and the attention kernels see.
    # `rope_interleave`: the rotated dims pair up as (0, 1), (2, 3), ... (DeepSeek's).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (self.num_experts > 0,) * self.num_layers)
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"sparse_layers has {len(self.sparse_layers)} entries for "
                             f"{self.num_layers} layers")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_experts ({self.num_experts})]")
        if self.router_scoring and (self.num_experts % self.n_group
                                    or not 0 < self.topk_group <= self.n_group):
            raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts "
                             f"({self.num_experts}) and topk_group ({self.topk_group}) be in "
                             f"[1, n_group]")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must turn an "
                             f"even number of each head's {self.head_dim} dimensions")
        scaling = self.rope_scaling
        if scaling.rope_type == "longrope" and not (
                len(scaling.short_factor) == len(scaling.long_factor) == self.rotary_dim // 2):
            raise ValueError(f"longrope short_factor ({len(scaling.short_factor)}) and "
                             f"long_factor ({len(scaling.long_factor)}) need one entry per "
                             f"rotary frequency ({self.rotary_dim // 2})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    def first_layers(self, n: int) -> "ModelConfig":
        """The same model cut to its first `n` layers (for compile tests and planning)."""
        return dataclasses.replace(self, num_layers=n, layer_types=self.layer_types[:n],
                                   sparse_layers=self.sparse_layers[:n])

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling]:
        """(rope theta, scaling) of a layer: Gemma 3's sliding layers have their own."""
        if self.sliding_rope_theta is not None and self.layer_window(layer):
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def rotary_dim(self) -> int:
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def for_context(self, max_model_len: int | None) -> "ModelConfig":
        """This model served with contexts up to `max_model_len` (None: its
        max_position_embeddings): LongRoPE's long factors then, for every position, when
        that passes its original context (vLLM's choice; transformers switches with each
        forward pass's length, which a KV cache cannot follow)."""
        scaling = self.rope_scaling
        if scaling.rope_type != "longrope":
            return self
        long = (max_model_len or self.max_position_embeddings) > \
            scaling.original_max_position_embeddings
        return dataclasses.replace(
            self, rope_scaling=dataclasses.replace(scaling, use_long_factor=long))

    @property
    def sm_scale(self) -> float:
        if self.kv_lora_rank:  # YaRN's mscale_all_dim scales every dim's scores (DeepSeek)
            scaling, mscale = self.rope_scaling, 1.0
            if scaling.rope_type == "yarn" and scaling.mscale_all_dim and scaling.factor > 1:
                mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
            return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * mscale**2
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_params(self) -> int:
        e, m, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.kv_lora_rank:
            h, r, ql = self.num_heads, self.kv_lora_rank, self.q_lora_rank
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            attn = ((e * ql + ql + ql * h * qk) if ql else e * h * qk) \
                + e * (r + self.qk_rope_head_dim) + r \
                + r * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * e
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += e
        if self.attention_sinks:
            attn += self.num_heads
        if self.qk_norm:
            attn += 2 * d
        dense = 3 * e * m
        shared = self.shared_expert_intermediate_size
        # router, experts, and the shared expert with its [hidden, 1] gate
        sparse = (self.num_experts * e * (1 + 3 * self.moe_intermediate_size)
                  + (3 * shared + self.shared_expert_gated) * e * bool(shared)
                  + self.num_experts * self.router_bias
                  + self.expert_biases * self.num_experts * (1 + 2 * self.moe_intermediate_size
                                                             + e))
        norms = (4 if self.sandwich_norms else 2) * e
        layers = sum(attn + norms + (sparse if s else dense) for s in self.sparse_layers)
        embed = self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
        return layers + embed + e

    def num_active_params(self) -> int:
        """Parameters one token reads: the router, `num_experts_per_tok` experts and the
        shared expert of each sparse layer (all of a dense model)."""
        unused = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * \
            self.moe_intermediate_size
        return self.num_params() - unused * sum(self.sparse_layers)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Map a Hugging Face config.json dict onto ModelConfig; unsupported features raise.
        A vision-language model's (LLaVA) is its language model's, with `vision` set."""
        model_type = hf.get("model_type")
        if model_type == "llava":
            text = {"model_type": "llama", **(hf.get("text_config") or {})}
            if text["model_type"] == "llama":
                text = {**_LLAMA_DEFAULTS, **text}
            lm = cls.from_hf(text)
            return dataclasses.replace(
                lm, architecture=(hf.get("architectures") or ["LlavaForConditionalGeneration"])[0],
                vision=VisionConfig.from_llava(hf, lm.hidden_size))
        if model_type == "gemma3":
            text = {"model_type": "gemma3_text", **(hf.get("text_config") or {})}
            text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
            lm = cls.from_hf(text)
            return dataclasses.replace(
                lm, architecture=(hf.get("architectures") or ["Gemma3ForConditionalGeneration"])[0],
                vision=Gemma3VisionConfig.from_hf(hf, lm.hidden_size))
        if model_type == "qwen2_5_vl":  # the text config nested (transformers 5) or flat
            text = {**(hf.get("text_config") or hf), "model_type": "qwen2"}
            text.pop("vision_config", None)
            rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
            section = tuple(rope.get("mrope_section", ()))
            lm = cls.from_hf(text)
            if sum(section) * 2 != lm.head_dim:
                raise ValueError(f"mrope_section {section} must sum to head_dim / 2 "
                                 f"({lm.head_dim // 2})")
            return dataclasses.replace(
                lm, model_type="qwen2_5_vl",
                architecture=(hf.get("architectures") or ["Qwen2_5_VLForConditionalGeneration"])[0],
                vision=QwenVisionConfig.from_hf(hf, lm.hidden_size), mrope_section=section)
        if model_type == "kimi_k2":  # Kimi K2: DeepSeek-V3's architecture under its own name
            return dataclasses.replace(cls.from_hf({**hf, "model_type": "deepseek_v3"}),
                                       model_type="kimi_k2")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (only {ACTIVATIONS})")
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        mla = _mla_from_hf(hf, model_type)
        attention_bias = bool(hf.get("attention_bias", False))
        if mla and attention_bias:
            raise ValueError("attention_bias=true with DeepSeek's latent attention is not "
                             "supported")
        qkv_bias, o_bias = attention_bias, attention_bias
        if model_type in ("qwen2", "qwen2_moe"):  # always q/k/v bias, never an o_proj bias
            qkv_bias, o_bias = True, False
        sliding_window, layer_types = _layers_from_hf(hf, model_type, num_layers)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta, rope_scaling, sliding_rope = _rope_from_hf(hf)
        moe = _moe_from_hf(hf, model_type, num_layers)
        gemma = model_type.startswith("gemma")
        return cls(
            model_type=model_type,
            architecture=(hf.get("architectures") or [f"{model_type.title()}ForCausalLM"])[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=1 if mla else hf.get("num_key_value_heads") or num_heads,
            head_dim=(mla["kv_lora_rank"] + mla["qk_rope_head_dim"] if mla
                      else hf.get("head_dim") or hf["hidden_size"] // num_heads),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # A sequence classifier has no LM head: a pooling request's discarded token
            # comes from its embedding's table (loading/classifier.py).
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False))
            or (hf.get("architectures") or [""])[0].endswith("ForSequenceClassification"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=sliding_window or None,
            attention_sinks=model_type == "gpt_oss",
            layer_types=layer_types,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=act,
            norm_offset=gemma,
            scale_embeddings=gemma,
            sandwich_norms=gemma,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            sliding_rope_theta=sliding_rope[0] if sliding_rope else None,
            sliding_rope_scaling=sliding_rope[1] if sliding_rope else RopeScaling(),
            partial_rotary_factor=float(
                (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
                or hf.get("partial_rotary_factor") or 1.0),
            **moe,
            **mla,
        ).for_context(None)

    @classmethod
    def from_file(cls, path: str | os.PathLike,
                  overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """Load from a checkpoint directory, a config.json, or a YAML preset, with
        `overrides` set over its top-level keys."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ValueError(f"no model config at {path}")
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
        return cls.from_hf({**data, **(overrides or {})})


def _mla_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The latent attention fields of a DeepSeek-V2 / V3 config.json (none for the others).
    V2 always pairs its rotated dims as (0, 1), (2, 3), ...; V3 unless rope_interleave is
    false."""
    if not model_type.startswith("deepseek"):
        return {}
    return dict(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                qk_nope_head_dim=hf["qk_nope_head_dim"],
                qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                rope_interleave=model_type == "deepseek_v2"
                or bool(hf.get("rope_interleave", True)))


def _moe_from_hf(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek /
    gpt-oss config.json (none for a dense model). Mixtral's and gpt-oss's experts are all
    layers' MLPs of intermediate_size, their top-k weights always renormalised (gpt-oss
    with biases and its clamped SwiGLU); the Qwen models' layer i
    is sparse unless it is in mlp_only_layers or (i + 1) is not a multiple of
    decoder_sparse_step; DeepSeek's from first_k_dense_replace on, every moe_layer_freq-th
    (as vLLM), with n_shared_experts ungated shared experts."""
    if model_type == "mixtral":
        return dict(num_experts=hf["num_local_experts"],
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    if model_type == "gpt_oss":  # a softmax over the top-k logits = top-k renormalised
        return dict(num_experts=hf["num_local_experts"],
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                    expert_biases=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                    swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    if model_type.startswith("deepseek"):
        experts = hf.get("n_routed_experts") or 0
        if not experts:
            return {}
        first, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
        method = hf.get("topk_method") or ("noaux_tc" if model_type == "deepseek_v3"
                                           else "greedy")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method {method!r} is not supported")
        scoring = hf.get("scoring_func") or ("sigmoid" if method == "noaux_tc" else "softmax")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {scoring!r} is not supported")
        grouped = method != "greedy"
        return dict(
            num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            shared_expert_intermediate_size=hf["moe_intermediate_size"]
            * (hf.get("n_shared_experts") or 0),
            shared_expert_gated=False, norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router_scoring=scoring, router_bias=method == "noaux_tc",
            n_group=(hf.get("n_group") or 1) if grouped else 1,
            topk_group=(hf.get("topk_group") or 1) if grouped else 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            sparse_layers=tuple(i >= first and i % freq == 0 for i in range(num_layers)))
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    step = hf.get("decoder_sparse_step", 1) or 1
    only_dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(experts > 0 and i not in only_dense and (i + 1) % step == 0
                   for i in range(num_layers))
    shared = hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                shared_expert_intermediate_size=shared or 0,
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), sparse_layers=sparse)


def _layers_from_hf(hf: dict[str, Any], model_type: str, num_layers: int
                    ) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and each layer's attention type ("sliding_attention" or
    "full_attention"; () when all are alike), as each family's config.json says them."""
    sliding_window = hf.get("sliding_window")
    layer_types = tuple(hf.get("layer_types") or ())
    if model_type.startswith("qwen") and not layer_types:
        if hf.get("use_sliding_window"):
            first = hf.get("max_window_layers", num_layers)
            layer_types = tuple(
                "sliding_attention" if i >= first else "full_attention"
                for i in range(num_layers)
            )
        else:
            sliding_window = None
    if model_type.startswith("gemma") and not layer_types and sliding_window:
        # Older config.json files: Gemma 2 alternates, sliding first; Gemma 3 has one
        # full layer in every sliding_window_pattern (6).
        pattern = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
        layer_types = tuple("full_attention" if (i + 1) % pattern == 0
                            else "sliding_attention" for i in range(num_layers))
    if layer_types and "sliding_attention" not in layer_types:
        sliding_window = None
    return sliding_window, layer_types


def _rope_from_hf(hf: dict[str, Any]
                  ) -> tuple[float, RopeScaling, tuple[float, RopeScaling] | None]:
    """(theta, scaling) of the full-attention layers, and of the sliding-window layers
    where they have a rope of their own (Gemma 3), else None."""
    # transformers >= 5 writes `rope_parameters` (per layer type for Gemma 3); older files
    # have rope_theta + rope_scaling (+ Gemma 3's rope_local_base_freq).
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:
        sliding = params.get("sliding_attention")
        full = _rope(params["full_attention"], {}, 10000.0, hf)
        return (*full, _rope(sliding, {}, 10000.0, hf) if sliding else None)
    theta, scaling = _rope(params, dict(hf.get("rope_scaling") or {}),
                           hf.get("rope_theta", 10000.0), hf)
    local = hf.get("rope_local_base_freq")
    return theta, scaling, ((float(local), RopeScaling()) if local is not None else None)


def _rope(params: dict[str, Any], scaling: dict[str, Any], theta: float, hf: dict[str, Any]
          ) -> tuple[float, RopeScaling]:
    params = dict(params)
    theta = params.pop("rope_theta", theta)
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if merged.pop("mrope_section", None) is not None and rope_type in ("mrope", "default"):
        rope_type = merged["rope_type"] = "default"  # M-RoPE: ModelConfig.mrope_section
    if rope_type == "su":  # LongRoPE's first name (Phi-3's early config.json files)
        rope_type = "longrope"
    if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported")
    if rope_type in ("llama3", "yarn", "longrope"):  # transformers' standardize_rope_params
        merged["original_max_position_embeddings"] = (
            hf.get("original_max_position_embeddings")
            or merged.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings", 4096))
    if rope_type in ("yarn", "longrope") and merged.get("factor") is None:
        # DeepSeek-V3's and Phi-3's implicit one
        merged["factor"] = (hf.get("max_position_embeddings", 4096)
                            / merged["original_max_position_embeddings"])
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            merged[name] = tuple(float(f) for f in merged[name])
    for beta in ("beta_fast", "beta_slow"):  # null: the default
        if merged.get(beta) is None:
            merged.pop(beta, None)
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: v for k, v in merged.items() if k in fields and k != "rope_type"}
    return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the model runs, beyond its shape: the kernels (None: by platform; "reference" |
    "tpu" | "gpu"), weight quantization (None | "int8" | "int4" | "fp8" | "fp4"), and
    interpret mode for the Pallas kernels (CPU tests). Integer weights come in groups of
    `quant_group_size` rows (None: int4 by 128, int8 per output channel; a checkpoint's
    own otherwise), with `quant_zero_points` when the checkpoint is asymmetric (AWQ, GPTQ;
    pallas_kernels/quantized_matmul), and with `quant_act_order` (GPTQ's desc_act) each
    linear layer's input permuted so that its groups are contiguous rows (`perm`
    parameters, layers.act_order_perm). `lm_head_quantization` ("int8" | "int4"; None:
    the head in the model's dtype) quantizes the LM head on its own terms
    (`lm_head_group_size`, `lm_head_zero_points`): a tied head is then a quantized copy of
    the embedding, which lookups keep reading in float. `quant_overrides` names the
    linear layers held in another integer format than `quantization`'s (a GGUF file that
    mixes block types, as Q4_K_M does): (parameter path, kind, group size, zero points);
    kind None holds that layer in the dtype (a GGUF file's float or IQ-type layers).
    A weight's kind is read from its values (layers.matmul), so the step needs no more.
    An entry for "embed" holds an untied model's embedding quantized (by rows, which
    lookups dequantize: layers.quantized_table; a GGUF file's quantized `token_embd` as
    stored); without one the embedding is in the dtype.
    `embed_from_lm_head`: a tied model holds no float embedding; token lookups dequantize
    columns of its quantized LM head (layers.quantized_embedding). A GGUF file whose tied
    head is kept as stored sets it: the head's values are the file's embedding."""

    kernel_impl: str | None = None
    quantization: str | None = None
    interpret: bool = False
    quant_group_size: int | None = None
    quant_zero_points: bool = False
    quant_act_order: bool = False
    lm_head_quantization: str | None = None
    lm_head_group_size: int | None = None
    lm_head_zero_points: bool = False
    quant_overrides: tuple[tuple[str, str, int | None, bool], ...] = ()
    embed_from_lm_head: bool = False

    def head_options(self) -> ModelOptions:
        """The options the LM head's matmul runs with: its own quantization."""
        return dataclasses.replace(self, quantization=self.lm_head_quantization,
                                   quant_group_size=self.lm_head_group_size,
                                   quant_zero_points=self.lm_head_zero_points,
                                   quant_act_order=False, quant_overrides=())

    def weight_options(self, path: str | None) -> ModelOptions:
        """The options the linear layer at `path` (its parameter path: "layers.3.attn.q_proj",
        "lm_head"; None for a layer outside the model's decoder, e.g. an EAGLE head's) is
        held and quantized with: the head's own, its entry of `quant_overrides`, or these;
        the embedding ("embed") is in the dtype unless an entry names it."""
        if path == "lm_head":
            return self.head_options()
        for name, kind, group, zero_points in self.quant_overrides:
            if name == path:
                return dataclasses.replace(self, quantization=kind, quant_group_size=group,
                                           quant_zero_points=zero_points)
        if path == "embed":  # in the dtype unless an entry names it
            return dataclasses.replace(self, quantization=None, quant_group_size=None,
                                       quant_zero_points=False)
        return self


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: memory, batching, buckets.

    `num_pages` fixes the KV page pool; otherwise it is sized from `kv_cache_memory_gib`
    (or, on accelerators, from `memory_utilization` of the device's free memory).
    Token buckets default to 1 (single-sequence decode) and powers of two from 8 to
    `max_num_batched_tokens`; a batch of T tokens holds up to min(T, max_num_seqs)
    sequences, so each token bucket is a fixed set of compiled programs (runner.py).
    `kv_cache_dtype` "auto" stores K/V in `dtype`; "int8" / "fp8" (e4m3) store them
    quantized with a float32 scale per token and head. `quantization` ("int8" | "int4" |
    "fp8" | "fp4") quantizes the linear layers' weights at load (embeddings, norms and the
    LM head stay in `dtype`); int4 by groups of `quant_group_size` rows (default 128), fp4
    (MXFP4) by groups of 32, int8 and fp8 per output channel or by groups of
    `quant_group_size`, integers asymmetric with
    `quant_zero_points`. A checkpoint quantized by its makers (AWQ, GPTQ,
    compressed-tensors; our converted ones) sets these to its own at load, and
    `quant_act_order` for GPTQ's act-order (desc_act) checkpoints. `lm_head_quantization`
    ("int8" | "int4"), with `lm_head_group_size` and `lm_head_zero_points`, quantizes the
    LM head too (a tied one: a quantized copy; lookups read the float embedding); a GGUF
    file whose head is stored quantized sets them to hold it as stored, and one whose
    layers mix block types sets `quant_overrides` (ModelOptions) for the layers of a
    format other than the most common one's (and for an untied quantized embedding, held
    as stored: an "embed" entry), and one whose tied head is kept
    `embed_from_lm_head` (token lookups read the quantized head: no float embedding).
    `kernel_impl` picks the attention and matmul kernels ("reference":
    pure JAX / XLA dots | "tpu" | "gpu" | "cpu": the native CPU kernels; None: by
    platform, the native ones on a CPU where they build); `interpret_kernels` runs the
    Pallas kernels in interpret mode (for testing them on CPU). `async_scheduling` dispatches each step
    before the host has processed the previous one's tokens (see Engine.step).
    `num_scheduler_steps` > 1 runs up to that many decode steps in one program while
    every running request decodes (vLLM's multi-step scheduling; Engine._decode_steps):
    the host's per-step work is paid once for them, and their tokens stream out together.
    `mesh` ({"data": d, "model": m}; default one device) and `sharding` (tp, tp+sp, dp,
    dp+tp, dp+tp+sp; sharding/rules.py) place the model on devices; under data
    parallelism `num_pages`, `max_num_seqs` and `max_num_batched_tokens` are totals over
    the data shards. `compilation_cache_dir` keeps the compiled step programs across
    restarts (None: a folder under ~/.cache/jaxserve, or JAX's own if one is set; "off":
    no cache; engine/compile_cache.py). `speculative_config` (a SpeculativeConfig or its
    dict) turns on speculative decoding. `enable_lora` serves LoRA adapters
    (engine/lora.py): `max_loras` on the device at once, each of rank up to
    `max_lora_rank`, and up to `max_cpu_loras` (default `max_loras`) kept in host memory.
    A vision-language model keeps its images' embeddings in an encoder cache of
    `mm_encoder_cache_tokens` rows (None: room for 8 images, at least
    `max_num_batched_tokens`) and takes at most `limit_mm_per_prompt["image"]` images per
    prompt (None: as many as the cache holds at once). `devices` picks the mesh's devices
    by their index in `jax.devices()` (None: the first ones), so that two engines of one
    process can sit on devices of their own; `kv_transfer_config` (a KVTransferConfig or
    its dict) makes the engine one side of prefill/decode disaggregation.
    `kv_offloading_size` (GiB; vLLM's) keeps the pages the prefix cache evicts in that
    much host memory and copies them back for a later prompt with their prefix
    (engine/host_kv_cache.py).
    `hf_overrides` (vLLM's): keys set over the checkpoint's config.json (e.g. a
    classification head from LM head rows: loading/classifier.py); `pooler_config`
    (vLLM's) sets how embeddings and classifications are pooled and finished over what
    the checkpoint says (loading/pooling_config.POOLER_KEYS).
    """

    model: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_gib: float | None = None
    memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    token_buckets: tuple[int, ...] = ()
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    quant_group_size: int | None = None
    quant_zero_points: bool = False
    quant_act_order: bool = False
    lm_head_quantization: str | None = None
    lm_head_group_size: int | None = None
    lm_head_zero_points: bool = False
    quant_overrides: tuple[tuple[str, str, int | None, bool], ...] = ()
    embed_from_lm_head: bool = False
    kernel_impl: str | None = None
    interpret_kernels: bool = False
    async_scheduling: bool = True
    num_scheduler_steps: int = 1
    mesh: dict[str, int] | None = None
    sharding: str = "tp"
    compilation_cache_dir: str | None = None
    speculative_config: SpeculativeConfig | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    mm_encoder_cache_tokens: int | None = None
    limit_mm_per_prompt: dict[str, int] | None = None
    devices: tuple[int, ...] | None = None
    kv_transfer_config: KVTransferConfig | None = None
    kv_offloading_size: float | None = None
    hf_overrides: dict[str, Any] | None = None
    pooler_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        if isinstance(self.kv_transfer_config, dict):
            object.__setattr__(self, "kv_transfer_config",
                               KVTransferConfig.from_dict(self.kv_transfer_config))
        role, spec = self.kv_transfer_config, self.speculative_config
        if role is not None and spec is not None:
            if not role.consumes:
                raise ValueError("speculative decoding belongs to the decode engine (a "
                                 "kv_producer samples one token a request): give "
                                 "speculative_config to the decode side")
            if spec.method in ("eagle", "eagle3"):
                raise ValueError(f"{spec.method} speculative decoding is not supported with "
                                 "prefill/decode disaggregation: its head reads the target's "
                                 "hidden states over the prompt, which a decode engine does "
                                 "not compute (n-gram, draft-model and Medusa speculation "
                                 "are)")
        if self.devices is not None:
            devices = tuple(self.devices)
            if not devices or len(set(devices)) != len(devices) or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0
                    for d in devices):
                raise ValueError(f"devices must list distinct device indices (>= 0), got "
                                 f"{self.devices!r}")
            object.__setattr__(self, "devices", devices)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens",
                     "num_scheduler_steps", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {self.max_cpu_loras!r}")
        if self.mm_encoder_cache_tokens is not None and (
                not isinstance(self.mm_encoder_cache_tokens, int)
                or self.mm_encoder_cache_tokens < 1):
            raise ValueError(f"mm_encoder_cache_tokens must be a positive integer, got "
                             f"{self.mm_encoder_cache_tokens!r}")
        limits = self.limit_mm_per_prompt
        if limits is not None and (not isinstance(limits, dict) or set(limits) - {"image"}
                                   or not all(isinstance(v, int) and v >= 0
                                              for v in limits.values())):
            raise ValueError(f"limit_mm_per_prompt must map 'image' to a count >= 0, e.g. "
                             f"{{'image': 2}}; got {limits!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float))
                                 or not size > 0):
            raise ValueError(f"kv_offloading_size is the host memory for evicted KV pages "
                             f"in GiB, a number > 0; got {size!r}")
        if size is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size keeps the prefix cache's evicted pages in "
                             "host memory: it needs enable_prefix_caching")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kernel_impl not in (None, *KERNEL_IMPLS):
            raise ValueError(f"kernel_impl must be one of {KERNEL_IMPLS} (or unset: by "
                             f"platform), got {self.kernel_impl!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or unset), "
                             f"got {self.quantization!r}")
        group = self.quant_group_size
        _check_group("quant_group_size", group, self.quantization)
        if group is not None and self.quantization is None:
            raise ValueError("quant_group_size describes quantized weights; set quantization")
        if (self.quant_zero_points or self.quant_act_order) and \
                self.quantization not in ("int4", "int8"):
            raise ValueError("quant_zero_points (asymmetric weights) and quant_act_order "
                             "describe integer weights; set quantization: int4 or int8")
        if self.lm_head_quantization not in (None, *LM_HEAD_QUANTIZATIONS):
            raise ValueError(f"lm_head_quantization must be one of {LM_HEAD_QUANTIZATIONS} (or "
                             f"unset), got {self.lm_head_quantization!r}")
        group = self.lm_head_group_size
        _check_group("lm_head_group_size", group, self.lm_head_quantization)
        if (group is not None or self.lm_head_zero_points) and self.lm_head_quantization is None:
            raise ValueError("lm_head_group_size and lm_head_zero_points describe a quantized "
                             "LM head; set lm_head_quantization: int8 or int4")
        object.__setattr__(self, "quant_overrides", _check_overrides(self.quant_overrides,
                                                                     self.quantization))
        if self.embed_from_lm_head and self.lm_head_quantization is None:
            raise ValueError("embed_from_lm_head reads token embeddings from a quantized LM "
                             "head; set lm_head_quantization: int8 or int4")
        if self.sharding not in STRATEGIES:
            raise ValueError(f"sharding must be one of {STRATEGIES}, got {self.sharding!r}")
        if self.mesh is not None:
            bad = {k: v for k, v in self.mesh.items()
                   if k not in MESH_AXES or not isinstance(v, int) or v < 1}
            if bad:
                raise ValueError(f"mesh {self.mesh}: axes are {MESH_AXES} with positive integer "
                                 f"sizes, e.g. {{data: 2, model: 4}}; bad: {bad}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        buckets = tuple(sorted(set(self.token_buckets))) or _default_buckets(
            self.max_num_batched_tokens)
        object.__setattr__(self, "token_buckets", buckets)
        if buckets[0] < 1 or buckets[-1] < self.max_num_batched_tokens:
            raise ValueError(f"token_buckets {buckets} must be positive and the largest must "
                             f"cover max_num_batched_tokens ({self.max_num_batched_tokens})")

    @property
    def model_options(self) -> ModelOptions:
        return ModelOptions(kernel_impl=self.kernel_impl, quantization=self.quantization,
                            interpret=self.interpret_kernels,
                            quant_group_size=self.quant_group_size,
                            quant_zero_points=self.quant_zero_points,
                            quant_act_order=self.quant_act_order,
                            lm_head_quantization=self.lm_head_quantization,
                            lm_head_group_size=self.lm_head_group_size,
                            lm_head_zero_points=self.lm_head_zero_points,
                            quant_overrides=self.quant_overrides,
                            embed_from_lm_head=self.embed_from_lm_head)

    @property
    def kv_storage_dtype(self) -> str:
        """The dtype name the KV cache stores (`kv_cache_dtype`, or the model's for auto)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> "EngineConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown engine settings {unknown}; known: {sorted(known)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        if "token_buckets" in data:
            data["token_buckets"] = tuple(data["token_buckets"])
        return cls(**data)


def _default_buckets(hi: int) -> tuple[int, ...]:
    buckets, b = [1], 8
    while b < hi:
        buckets.append(b)
        b *= 2
    return tuple(sorted(set(buckets + [hi])))
