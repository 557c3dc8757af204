"""A vision-language checkpoint's tensors: the language model's under the names a text
checkpoint uses (loading/safetensors.py reads them), the vision tower's and projector's
gathered into the tower's parameter pytree (models/vision/).

Three layouts are read alike: the hub's (`language_model.model.layers...`,
`vision_tower.vision_model.encoder...`; Qwen2.5-VL's `model.layers...`, `visual...`),
transformers 5's `save_pretrained` (the tower without `vision_model`), and transformers'
own module names (`model.language_model.layers...`, `model.vision_tower...`,
`model.visual...`, `model.multi_modal_projector...`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import jax
import numpy as np

from jaxserve.config import Gemma3VisionConfig, QwenVisionConfig, VisionConfig
from jaxserve.models.vision.clip import ClipLayer, ClipParams
from jaxserve.models.vision.gemma3 import Gemma3VisionParams
from jaxserve.models.vision.llava import LlavaParams
from jaxserve.models.vision.qwen2_5_vl import QwenVisionLayer, QwenVisionParams

_TEXT = re.compile(r"(?:model\.)?language_model\.(?:(model)\.)?(.+)")
_TOWER = re.compile(r"(?:model\.)?(?:vision_tower\.(?:vision_model\.)?|visual\.)(.+)")
_PROJECTOR = re.compile(r"(?:model\.)?multi_modal_projector\.(.+)")


class VisionTensors:
    """Splits a checkpoint's tensors: `text(tensors)` passes the language model's on,
    renamed; the vision side's are kept (memory-mapped) for `params`."""

    def __init__(self, cfg: VisionConfig | QwenVisionConfig | Gemma3VisionConfig):
        self.cfg = cfg
        self.kept: dict[str, np.ndarray] = {}

    def text(self, tensors: Iterable[tuple[str, np.ndarray]]
             ) -> Iterator[tuple[str, np.ndarray]]:
        for name, x in tensors:
            if m := _TOWER.fullmatch(name):
                self.kept["tower." + m.group(1)] = x
            elif m := _PROJECTOR.fullmatch(name):
                self.kept["projector." + m.group(1)] = x
            elif m := _TEXT.fullmatch(name):
                rest = m.group(2)
                yield (rest if rest.startswith("lm_head.") else "model." + rest), x
            else:  # lm_head.weight at the top (transformers' module names)
                yield name, x

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.kept:
            raise ValueError(f"the checkpoint lacks the vision tensor {name!r}")
        x = np.asarray(self.kept[name])
        if x.shape != shape:
            raise ValueError(f"vision tensor {name!r} has shape {x.shape}, the config "
                             f"expects {shape}")
        return x

    def params(self, dtype, sharding: jax.sharding.Sharding) -> LlavaParams | QwenVisionParams:
        """The tower and projector in our layout, placed with `sharding`; a missing or
        misshapen tensor raises ValueError naming it."""
        params = (self._qwen() if isinstance(self.cfg, QwenVisionConfig) else
                  self._gemma3() if isinstance(self.cfg, Gemma3VisionConfig) else self._llava())
        self.kept.clear()
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x, dtype), sharding), params)

    def _qwen(self) -> QwenVisionParams:
        cfg, get, d = self.cfg, self.get, self.cfg.hidden_size
        m, u = cfg.intermediate_size, d * cfg.spatial_merge_size ** 2

        def layer(i: int) -> QwenVisionLayer:
            p = f"tower.blocks.{i}."
            return QwenVisionLayer(
                norm1=get(p + "norm1.weight", (d,)),
                qkv_w=get(p + "attn.qkv.weight", (3 * d, d)).T.reshape(d, 3, d),
                qkv_b=get(p + "attn.qkv.bias", (3 * d,)).reshape(3, d),
                proj_w=get(p + "attn.proj.weight", (d, d)).T, proj_b=get(p + "attn.proj.bias", (d,)),
                norm2=get(p + "norm2.weight", (d,)),
                gate_w=get(p + "mlp.gate_proj.weight", (m, d)).T,
                gate_b=get(p + "mlp.gate_proj.bias", (m,)),
                up_w=get(p + "mlp.up_proj.weight", (m, d)).T, up_b=get(p + "mlp.up_proj.bias", (m,)),
                down_w=get(p + "mlp.down_proj.weight", (d, m)).T,
                down_b=get(p + "mlp.down_proj.bias", (d,)))

        t, ps = cfg.text_hidden_size, cfg.patch_size
        return QwenVisionParams(
            patch_w=get("tower.patch_embed.proj.weight",
                        (d, 3, cfg.temporal_patch_size, ps, ps)).reshape(d, -1).T,
            layers=[layer(i) for i in range(cfg.num_layers)],
            merger_norm=get("tower.merger.ln_q.weight", (d,)),
            merger_1_w=get("tower.merger.mlp.0.weight", (u, u)).T,
            merger_1_b=get("tower.merger.mlp.0.bias", (u,)),
            merger_2_w=get("tower.merger.mlp.2.weight", (t, u)).T,
            merger_2_b=get("tower.merger.mlp.2.bias", (t,)))

    def _clip_layer(self, i: int) -> ClipLayer:
        """Layer i of a CLIP or SigLIP tower."""
        get, d, m = self.get, self.cfg.hidden_size, self.cfg.intermediate_size
        p = f"tower.encoder.layers.{i}."
        attn = p + "self_attn."
        return ClipLayer(
            ln1_w=get(p + "layer_norm1.weight", (d,)), ln1_b=get(p + "layer_norm1.bias", (d,)),
            qkv_w=np.stack([get(f"{attn}{x}_proj.weight", (d, d)).T for x in "qkv"], 1),
            qkv_b=np.stack([get(f"{attn}{x}_proj.bias", (d,)) for x in "qkv"]),
            out_w=get(attn + "out_proj.weight", (d, d)).T,
            out_b=get(attn + "out_proj.bias", (d,)),
            ln2_w=get(p + "layer_norm2.weight", (d,)), ln2_b=get(p + "layer_norm2.bias", (d,)),
            fc1_w=get(p + "mlp.fc1.weight", (m, d)).T, fc1_b=get(p + "mlp.fc1.bias", (m,)),
            fc2_w=get(p + "mlp.fc2.weight", (d, m)).T, fc2_b=get(p + "mlp.fc2.bias", (d,)))

    def _gemma3(self) -> Gemma3VisionParams:
        cfg, get, d, ps = self.cfg, self.get, self.cfg.hidden_size, self.cfg.patch_size
        return Gemma3VisionParams(
            patch_w=get("tower.embeddings.patch_embedding.weight", (d, 3, ps, ps))
            .reshape(d, -1).T,
            patch_b=get("tower.embeddings.patch_embedding.bias", (d,)),
            positions=get("tower.embeddings.position_embedding.weight", (cfg.num_patches, d)),
            layers=[self._clip_layer(i) for i in range(cfg.num_layers)],
            post_ln_w=get("tower.post_layernorm.weight", (d,)),
            post_ln_b=get("tower.post_layernorm.bias", (d,)),
            soft_norm=get("projector.mm_soft_emb_norm.weight", (d,)),
            projection=get("projector.mm_input_projection_weight", (d, cfg.text_hidden_size)))

    def _llava(self) -> LlavaParams:
        cfg, get, d, ps = self.cfg, self.get, self.cfg.hidden_size, self.cfg.patch_size
        tower = ClipParams(
            patch_w=get("tower.embeddings.patch_embedding.weight", (d, 3, ps, ps))
            .reshape(d, -1).T,
            class_embedding=get("tower.embeddings.class_embedding", (d,)),
            positions=get("tower.embeddings.position_embedding.weight", (cfg.num_patches + 1, d)),
            pre_ln_w=get("tower.pre_layrnorm.weight", (d,)),
            pre_ln_b=get("tower.pre_layrnorm.bias", (d,)),
            layers=[self._clip_layer(i) for i in range(cfg.layers_used)])
        t, f = cfg.text_hidden_size, d * len(cfg.feature_layers)
        bias = cfg.projector_bias
        return LlavaParams(
            tower=tower,
            linear_1_w=get("projector.linear_1.weight", (t, f)).T,
            linear_1_b=get("projector.linear_1.bias", (t,)) if bias else None,
            linear_2_w=get("projector.linear_2.weight", (t, t)).T,
            linear_2_b=get("projector.linear_2.bias", (t,)) if bias else None)
