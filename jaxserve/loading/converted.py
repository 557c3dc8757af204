"""Our own converted checkpoints: quantized parameters saved with Orbax, restored into shards.

A converted directory holds the Hugging Face files a model needs besides its weights
(config.json, generation_config.json, tokenizer files), the parameters as an Orbax
checkpoint under `params/`, and `jaxserve.json` saying how they were made. Restoring
reads every array straight into its device shards under the engine's sharding rules, and
quantized weights are loaded as stored: nothing is re-quantized. k/v projections are saved
with one copy of each KV head, whatever mesh converted them, and repeated at restore for
the serving mesh (transformer.Attention).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.loading.source import open_checkpoint
from jaxserve.loading.safetensors import (
    abstract_model, is_kv_param, kv_heads_shape, load_checkpoint, repeat_kv_heads,
    unrepeat_kv_heads)
from sharding.rules import ShardingContext

MANIFEST = "jaxserve.json"
FORMAT = "jaxserve-orbax-v1"


def _checkpointer():
    """Orbax's checkpointer, imported here: orbax takes 0.45 s to import, which every
    `jaxserve serve` of a Hugging Face checkpoint would otherwise pay at start-up."""
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


# Everything of an HF directory but its weights.
_CARRIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def is_converted(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MANIFEST).is_file()


def read_manifest(model_dir: str | Path) -> dict:
    manifest = json.loads((Path(model_dir) / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{model_dir}/{MANIFEST}: format {manifest.get('format')!r} is not "
                         f"{FORMAT!r}; convert the checkpoint again with this jaxserve")
    return manifest


def convert(model_dir: str | Path, out_dir: str | Path, dtype: str, quantization: str | None,
            shard: ShardingContext) -> Path:
    """Load an HF checkpoint (quantizing its linear layers, the rest in `dtype`, a name
    such as "bfloat16"; an AWQ, GPTQ or compressed-tensors one as stored) or a GGUF file
    (as `--model file.gguf` serves it) and save it as a converted dir."""
    source, out_dir = Path(model_dir), Path(out_dir).absolute()
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output directory {out_dir} is not empty; choose a new one")
    ckpt = open_checkpoint(source, quantization)
    model_dir, cfg, method = ckpt.model_dir, ckpt.config, ckpt.method
    options = ModelOptions(**{"quantization": quantization, **ckpt.settings})
    _, params = load_checkpoint(model_dir, cfg, jnp.dtype(dtype), shard, options, ckpt.tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _CARRIED:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)
    replicas = shard.rules.kv_head_replicas
    flat = nnx.to_flat_state(params)
    for path, var in flat:
        if is_kv_param(path):
            var.set_value(unrepeat_kv_heads(var[...], path, replicas, cfg.head_dim))
    with _checkpointer() as ckptr:
        ckptr.save(out_dir / "params", nnx.to_pure_dict(nnx.from_flat_state(flat)))
    manifest = {"format": FORMAT, "dtype": dtype, "quantization": options.quantization,
                "quant_group_size": options.quant_group_size,
                "quant_zero_points": options.quant_zero_points,
                "quant_act_order": options.quant_act_order,
                "lm_head_quantization": options.lm_head_quantization,
                "lm_head_group_size": options.lm_head_group_size,
                "lm_head_zero_points": options.lm_head_zero_points,
                "quant_overrides": [list(o) for o in options.quant_overrides],
                "embed_from_lm_head": options.embed_from_lm_head,
                "source": str(source.absolute()), "source_quantization": method}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out_dir


def restore(model_dir: str | Path, cfg: ModelConfig, dtype, shard: ShardingContext,
            options: ModelOptions) -> tuple[nnx.GraphDef, nnx.State]:
    """The converted parameters, each array read straight into its shards."""
    manifest = read_manifest(model_dir)
    if options.quantization != manifest["quantization"]:
        raise ValueError(f"{model_dir} holds {manifest['quantization'] or 'unquantized'} weights;"
                         f" it cannot be served with quantization={options.quantization!r}")
    if options.lm_head_quantization != manifest.get("lm_head_quantization"):
        raise ValueError(f"{model_dir} holds its LM head "
                         f"{manifest.get('lm_head_quantization') or 'unquantized'}; it cannot be "
                         f"served with lm_head_quantization={options.lm_head_quantization!r}")
    graphdef, abstract = abstract_model(cfg, dtype, shard, options)
    replicas = shard.rules.kv_head_replicas
    flat = nnx.to_flat_state(abstract)
    repeat = {}  # k/v parameters: restored with one copy per head (replicated), then repeated
    for path, var in flat:
        sharding = shard.param_sharding(var)
        shape = var.shape
        if is_kv_param(path) and replicas > 1:
            repeat[path] = sharding
            shape = kv_heads_shape(shape, path, 1, replicas)
            sharding = shard.sharding(())
        var.set_value(jax.ShapeDtypeStruct(shape, var.dtype, sharding=sharding))
    target = nnx.from_flat_state(flat)
    with _checkpointer() as ckptr:
        restored = ckptr.restore(Path(model_dir).absolute() / "params", nnx.to_pure_dict(target))
    nnx.replace_by_pure_dict(target, restored)
    flat = nnx.to_flat_state(target)
    for path, var in flat:
        if path in repeat:
            expand = jax.jit(lambda x, p=path: repeat_kv_heads(x, p, replicas, cfg.head_dim),
                             out_shardings=repeat[path])
            var.set_value(expand(var[...]))
    return graphdef, nnx.from_flat_state(flat)


def served_settings(model_dir: str | Path, quantization: str | None,
                    lm_head_quantization: str | None = None) -> dict:
    """The engine settings a converted checkpoint is served with: its own quantization
    (group size, zero points) and its LM head's unless the caller asked for another, which
    restore() refuses."""
    manifest = read_manifest(model_dir)
    return dict(quantization=quantization or manifest["quantization"],
                quant_group_size=manifest.get("quant_group_size"),
                quant_zero_points=manifest.get("quant_zero_points", False),
                quant_act_order=manifest.get("quant_act_order", False),
                lm_head_quantization=lm_head_quantization or manifest.get("lm_head_quantization"),
                lm_head_group_size=manifest.get("lm_head_group_size"),
                lm_head_zero_points=manifest.get("lm_head_zero_points", False),
                quant_overrides=tuple(tuple(o) for o in manifest.get("quant_overrides", ())),
                embed_from_lm_head=manifest.get("embed_from_lm_head", False))
