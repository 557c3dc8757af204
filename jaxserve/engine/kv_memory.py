"""How much device memory the KV cache takes, and how many pages fit: the engine sizes its
pool with these, and the planner (sharding/planner.py) a slice's."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models.parallel import KV_CACHE_AXES
from jaxserve.models.transformer import kv_cache_layout
from sharding.rules import ShardingContext

DEFAULT_CPU_KV_GIB = 1.0


def kv_page_bytes(cfg: ModelConfig, page_size: int, kv_dtype,
                  shard: ShardingContext | None = None) -> int:
    """Bytes of one page across all layers: K and V, and their scales when quantized.
    With `shard`, the bytes one device holds of it (its share of the cache heads)."""
    replicas = shard.rules.kv_head_replicas if shard else 1
    split = shard.axis_size(shard.rules.spec(KV_CACHE_AXES)[0]) if shard else 1
    layer = kv_cache_layout(cfg, 1, page_size, kv_dtype, replicas)
    return cfg.num_layers * sum(int(np.prod(shape)) * jnp.dtype(dtype).itemsize
                                for shape, dtype, _ in layer) // split


def abstract_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, kv_dtype,
                      shard: ShardingContext) -> list[tuple[jax.ShapeDtypeStruct, ...]]:
    """The KV cache's shapes, dtypes and shardings (`num_pages` in all data shards),
    allocating nothing."""
    layout = kv_cache_layout(cfg, num_pages, page_size, kv_dtype, shard.rules.kv_head_replicas)
    layer = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=shard.sharding(axes))
                  for shape, dtype, axes in layout)
    return [layer] * cfg.num_layers


def pool_size(page_bytes: int, pages_needed: int, memory_gib: float | None,
              utilization: float, device, reserved: int = 0) -> int:
    """Pages that fit the memory budget, at most what max_num_seqs full contexts can use.

    The budget is `memory_gib` if given, else `utilization` of the device's free memory
    (accelerators) less `reserved` bytes (arrays allocated beside the pool), else
    DEFAULT_CPU_KV_GIB (CPU reports no memory limit).
    """
    if memory_gib is not None:
        budget = memory_gib * 2**30
    else:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "bytes_limit" in stats:
            budget = (stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0)
                      - reserved)
        else:
            budget = DEFAULT_CPU_KV_GIB * 2**30
    return max(0, min(int(budget // page_bytes), pages_needed))


def pages_per_seq(max_model_len: int, page_size: int) -> int:
    """The pages one sequence of `max_model_len` tokens holds at most."""
    return math.ceil(max_model_len / page_size)


def pool_pages(config: EngineConfig, model: ModelConfig, shard: ShardingContext,
               max_model_len: int, kv_dtype, extra_page_bytes: int = 0, reserved: int = 0
               ) -> int:
    """KV pages per data shard: `num_pages`, or what the memory budget holds of pages of
    the model's K/V and `extra_page_bytes` beside them (a speculative method's), with
    `reserved` bytes allocated beside the pool. ValueError if one sequence does not fit."""
    per_seq = pages_per_seq(max_model_len, config.page_size)
    page_bytes = kv_page_bytes(model, config.page_size, kv_dtype, shard) + extra_page_bytes
    shards = shard.data_shards
    num_pages = config.num_pages // shards if config.num_pages else pool_size(
        page_bytes, per_seq * config.max_num_seqs // shards, config.kv_cache_memory_gib,
        config.memory_utilization, shard.mesh.local_devices[0], reserved)
    if num_pages < per_seq:
        raise ValueError(
            f"the KV cache holds {num_pages} pages of {config.page_size} tokens per data "
            f"shard, fewer than one sequence of max_model_len={max_model_len} needs "
            f"({per_seq}); lower max_model_len or give the cache more memory")
    return num_pages
