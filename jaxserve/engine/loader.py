"""What an engine serves, loaded and placed on its mesh: the checkpoint (a Hugging Face
directory, our converted one, or random weights for benchmarks), its tokenizer, and a
speculative method's models."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.speculative.setup import SpeculativeModels
from jaxserve.loading import converted, gguf, prequantized
from jaxserve.loading.safetensors import checkpoint_tensors, load_checkpoint, random_params
from jaxserve.loading.tokenizer import Tokenizer
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


def load(config: EngineConfig, random_weights_preset: str | None = None) -> Loaded:
    """The checkpoint directory `config.model` (the demo model when None), placed as
    `config.mesh` ({"data": d, "model": m}) and `config.sharding` (a strategy of
    sharding/rules.py) say; with `random_weights_preset` (a YAML model preset) random
    weights instead, and no tokenizer."""
    mesh = make_mesh(config.mesh)
    dtype = jnp.dtype(config.dtype)
    options = config.model_options
    if random_weights_preset is not None:
        model_config = ModelConfig.from_file(random_weights_preset)
        shard = model_sharding(mesh, config.sharding, model_config)
        graphdef, params = random_params(model_config, dtype, shard, seed=config.seed,
                                         options=options)
        return Loaded(config, model_config, graphdef, params, None, shard)
    if config.model is None:
        from jaxserve.demo import demo_model_dir
        config = dataclasses.replace(config, model=str(demo_model_dir()))
    model_dir, tensors = Path(config.model), None
    if gguf.is_gguf(model_dir):  # its metadata as files; its weights streamed from it
        stored = None if config.quantization else gguf.stored_settings(config.model)
        if stored is not None:  # Q4_0 linear layers: our int4, as stored
            config = dataclasses.replace(config, **stored)
            options = config.model_options
        model_dir = gguf.metadata_dir(config.model)
        tensors = gguf.open_weights(config.model, keep=stored is not None)
    elif not model_dir.is_dir():
        raise ValueError(f"model {config.model!r} is not a directory (nor a .gguf file); give "
                         "a Hugging Face checkpoint directory (config.json, *.safetensors, "
                         "tokenizer) or a GGUF file")
    model_config = ModelConfig.from_file(model_dir)
    shard = model_sharding(mesh, config.sharding, model_config)
    if tensors is None and converted.is_converted(model_dir):
        config = dataclasses.replace(
            config, **converted.served_settings(model_dir, config.quantization))
        options = config.model_options
        graphdef, params = converted.restore(model_dir, model_config, dtype, shard, options)
    else:
        stored = None if tensors is not None else prequantized.read(model_dir)
        if stored is not None:  # AWQ, GPTQ, compressed-tensors: served as stored
            config = dataclasses.replace(
                config, **stored.settings(config.quantization, model_config))
            options = config.model_options
            tensors = prequantized.tensors(checkpoint_tensors(model_dir), stored)
        graphdef, params = load_checkpoint(model_dir, model_config, dtype, shard, options,
                                           tensors)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    speculative = SpeculativeModels.load(config.speculative_config, model_config, shard,
                                         config.sharding, dtype, options)
    return Loaded(config, model_config, graphdef, params, tokenizer, shard, speculative)
