"""What an engine serves, loaded and placed on its mesh: the checkpoint (a Hugging Face
directory, our converted one, or random weights for benchmarks), its tokenizer, and a
speculative method's models."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.speculative.setup import SpeculativeModels
from jaxserve.loading import converted, gguf
from jaxserve.loading.safetensors import checkpoint_tensors, load_checkpoint, random_params
from jaxserve.loading.source import open_checkpoint
from jaxserve.loading.image_processor import load_image_processor
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.vision import VisionTensors
from sharding.layouts import lay_out_for_kernels
from sharding.mesh import make_mesh
from sharding.rules import ShardingContext, model_sharding


@dataclasses.dataclass
class Loaded:
    config: EngineConfig  # as served (the demo model's directory, a converted one's options)
    model_config: ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Tokenizer | None
    shard: ShardingContext
    speculative: SpeculativeModels | None = None
    vision: Vision | None = None  # a vision-language model's image side


def _devices(config: EngineConfig) -> list | None:
    """The devices `config.devices` names (None: the mesh takes the first ones)."""
    if config.devices is None:
        return None
    everything = jax.devices()
    size = math.prod((config.mesh or {}).values())
    if len(config.devices) != size or max(config.devices) >= len(everything):
        raise ValueError(f"devices {list(config.devices)}: the mesh {config.mesh or {}} takes "
                         f"{size} of this process's {len(everything)} devices (0-"
                         f"{len(everything) - 1})")
    return [everything[d] for d in config.devices]


@dataclasses.dataclass
class Vision:
    params: Any  # the tower's and projector's (models/vision/), on the mesh
    processor: Any  # images -> pixels (loading/image_processor.py)


def load(config: EngineConfig, random_weights_preset: str | None = None) -> Loaded:
    """The checkpoint directory `config.model` (the demo model when None), placed as
    `config.mesh` ({"data": d, "model": m}) and `config.sharding` (a strategy of
    sharding/rules.py) say; with `random_weights_preset` (a YAML model preset) random
    weights instead, and no tokenizer. Its models' parameters are laid out as the
    kernels take them (sharding/layouts.py)."""
    loaded = _load(config, random_weights_preset)
    speculative = loaded.speculative or SpeculativeModels()
    for params in [loaded.params] + [m[3] for m in (speculative.draft, speculative.eagle)
                                     if m is not None]:
        lay_out_for_kernels(params)
    return loaded


def _load(config: EngineConfig, random_weights_preset: str | None) -> Loaded:
    mesh = make_mesh(config.mesh, _devices(config))
    vision = None
    dtype = jnp.dtype(config.dtype)
    options = config.model_options
    if random_weights_preset is not None:
        # Random weights for the language model only (a preset's vision side is ignored).
        model_config = dataclasses.replace(ModelConfig.from_file(random_weights_preset),
                                           vision=None).for_context(config.max_model_len)
        shard = model_sharding(mesh, config.sharding, model_config)
        graphdef, params = random_params(model_config, dtype, shard, seed=config.seed,
                                         options=options)
        return Loaded(config, model_config, graphdef, params, None, shard)
    if config.model is None:
        from jaxserve.demo import demo_model_dir
        config = dataclasses.replace(config, model=str(demo_model_dir()))
    model_dir = Path(config.model)
    if not (gguf.is_gguf(model_dir) or model_dir.is_dir()):
        raise ValueError(f"model {config.model!r} is not a directory (nor a .gguf file); give "
                         "a Hugging Face checkpoint directory (config.json, *.safetensors, "
                         "tokenizer) or a GGUF file")
    if converted.is_converted(model_dir):
        model_config = ModelConfig.from_file(model_dir, config.hf_overrides).for_context(
            config.max_model_len)
        if model_config.vision is not None:
            raise ValueError(f"{model_dir}: converted vision-language checkpoints are not "
                             "supported; serve the Hugging Face directory")
        shard = model_sharding(mesh, config.sharding, model_config)
        config = dataclasses.replace(
            config, **converted.served_settings(model_dir, config.quantization,
                                                config.lm_head_quantization))
        options = config.model_options
        graphdef, params = converted.restore(model_dir, model_config, dtype, shard, options)
    else:  # a float checkpoint, a GGUF file, or one quantized by its makers (as stored)
        ckpt = open_checkpoint(model_dir, config.quantization, config.lm_head_quantization,
                               config.hf_overrides)
        model_dir, model_config = ckpt.model_dir, ckpt.config.for_context(config.max_model_len)
        shard = model_sharding(mesh, config.sharding, model_config)
        config = dataclasses.replace(config, **ckpt.settings)
        options = config.model_options
        tensors, split = ckpt.tensors, None
        if model_config.vision is not None:
            if ckpt.method is not None:
                raise ValueError(f"a vision-language checkpoint quantized by its makers "
                                 f"({ckpt.method}) is not supported yet")
            split = VisionTensors(model_config.vision)
            tensors = split.text(checkpoint_tensors(model_dir))
        graphdef, params = load_checkpoint(model_dir, model_config, dtype, shard, options,
                                           tensors)
        if split is not None:
            vision = Vision(split.params(dtype, shard.sharding(())),
                            load_image_processor(model_dir, getattr(model_config.vision,
                                                                    "image_size", None)))
    tokenizer = Tokenizer.from_pretrained(model_dir)
    speculative = SpeculativeModels.load(config.speculative_config, model_config, shard,
                                         config.sharding, dtype, options, model_dir)
    return Loaded(config, model_config, graphdef, params, tokenizer, shard, speculative,
                  vision)
