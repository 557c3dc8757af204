"""Compile the real step for a device topology without weights, and read what it does.

`compile_step` lowers the engine's jitted step (sharded as it would run) on abstract
parameters, KV cache and batch, for any devices: real ones, or a TPU topology from
`jax.experimental.topologies` when libtpu is installed (so a CPU machine can compile for
a v5e/v6e slice). `collectives` counts the communication ops of the compiled program.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.batch import BatchBuilder, BucketKey
from jaxserve.engine.runner import jit_step, pages_per_seq
from jaxserve.loading.safetensors import abstract_model
from sharding.mesh import make_mesh
from sharding.rules import ShardingContext, strategy_rules

_COLLECTIVE = re.compile(
    r" (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")


def tpu_devices(topology: str) -> list:
    """The devices of a TPU topology such as 'v5e:2x2' (needs libtpu, not a TPU)."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def compile_step(cfg: ModelConfig, engine: EngineConfig, mesh_shape: dict[str, int],
                 strategy: str, devices: list, num_pages: int, key: BucketKey,
                 dtype=jnp.bfloat16) -> jax.stages.Compiled:
    """Ahead-of-time compile of one step bucket, sharded over `devices`."""
    mesh = make_mesh(mesh_shape, devices=devices)
    shard = ShardingContext(mesh, strategy_rules(strategy, mesh, cfg.num_heads, cfg.num_kv_heads,
                                                 cfg.vocab_size, cfg.intermediate_size))
    graphdef, abstract = abstract_model(cfg, dtype, shard)
    flat = nnx.to_flat_state(abstract)
    for _, var in flat:
        sharding = shard.sharding(var.get_metadata()["logical_axes"])
        var.set_value(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding))
    params = nnx.from_flat_state(flat)
    max_len = engine.max_model_len or cfg.max_position_embeddings
    builder = BatchBuilder(engine.token_buckets, engine.max_num_seqs, engine.page_size,
                           num_pages, pages_per_seq(max_len, engine.page_size), max_len,
                           cfg.eos_token_ids)
    kv_sharding = shard.sharding((None, None, "kv_heads", None))
    kv = jax.ShapeDtypeStruct((num_pages, engine.page_size, cfg.num_kv_heads, cfg.head_dim),
                              dtype, sharding=kv_sharding)
    caches = [(kv, kv) for _ in range(cfg.num_layers)]
    replicated = shard.sharding(())
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         builder.empty(key))
    fn = jit_step(graphdef, jax.tree.map(lambda x: x.sharding, params), shard, cfg.num_layers)
    with jax.default_device(devices[0]):
        return fn.lower(params, caches, batch).compile()


def collectives(compiled: jax.stages.Compiled) -> dict[str, int]:
    return dict(collections.Counter(_COLLECTIVE.findall(compiled.as_text())))
