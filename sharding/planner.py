"""Compile the real step for a device topology without weights, and read what it does.

`compile_step` lowers the engine's jitted step (sharded as it would run) on abstract
parameters, KV cache and batch, for any devices: real ones, or a TPU topology from
`jax.experimental.topologies` when libtpu is installed (so a CPU machine can compile for
a v5e/v6e slice). `collectives` counts the communication ops of the compiled program.
"""

from __future__ import annotations

import collections
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.batch import BatchBuilder, BucketKey
from jaxserve.engine.engine import kv_cache_dtype, model_options
from jaxserve.engine.runner import abstract_kv_cache, jit_step, kv_page_bytes, pages_per_seq
from jaxserve.loading.safetensors import abstract_model
from jaxserve.models.layers import ModelOptions
from sharding.mesh import make_mesh
from sharding.rules import ShardingContext, model_sharding

_COLLECTIVE = re.compile(
    r" (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")


def tpu_devices(topology: str) -> list:
    """The devices of a TPU topology such as 'v5e:2x2' (needs libtpu, not a TPU)."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def compile_step(cfg: ModelConfig, engine: EngineConfig, mesh_shape: dict[str, int],
                 strategy: str, devices: list, num_pages: int, key: BucketKey,
                 dtype=jnp.bfloat16) -> jax.stages.Compiled:
    """Ahead-of-time compile of one step bucket, sharded over `devices`, with the engine's
    weight quantization, KV cache dtype and kernels (on a TPU: our Pallas kernels)."""
    shard = model_sharding(make_mesh(mesh_shape, devices=devices), strategy, cfg)
    graphdef, abstract = abstract_model(cfg, dtype, shard, model_options(engine))
    flat = nnx.to_flat_state(abstract)
    for _, var in flat:
        sharding = shard.sharding(var.get_metadata()["logical_axes"])
        var.set_value(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding))
    params = nnx.from_flat_state(flat)
    max_len = engine.max_model_len or cfg.max_position_embeddings
    builder = BatchBuilder(engine.token_buckets, engine.max_num_seqs, engine.page_size,
                           num_pages, pages_per_seq(max_len, engine.page_size), max_len,
                           cfg.eos_token_ids)
    caches = abstract_kv_cache(cfg, num_pages, engine.page_size, kv_cache_dtype(engine), shard)
    replicated = shard.sharding(())
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         builder.empty(key))
    fn = jit_step(graphdef, jax.tree.map(lambda x: x.sharding, params),
                  jax.tree.map(lambda x: x.sharding, caches), shard)
    with jax.default_device(devices[0]):
        sampled = jax.ShapeDtypeStruct((engine.max_num_seqs,), jnp.int32, sharding=replicated)
        return fn.lower(params, caches, batch, sampled).compile()


def collectives(compiled: jax.stages.Compiled) -> dict[str, int]:
    return dict(collections.Counter(_COLLECTIVE.findall(compiled.as_text())))


# HBM per chip, GiB (public specifications).
HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95, "v6e": 32}
_COLLECTIVE_SHAPE = re.compile(
    r"= (\(?[a-z0-9]+\[[\d,]*\][^ ]*) (all-reduce|reduce-scatter|all-gather|all-to-all|"
    r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"([a-z]+)(\d+)\[([\d,]*)\]")


def _bytes_of(shape_text: str) -> int:
    total = 0
    for _, bits, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * max(int(bits), 8) // 8
    return total


def collective_bytes(compiled: jax.stages.Compiled) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes of results per chip)} from the compiled HLO."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for shape, kind in _COLLECTIVE_SHAPE.findall(compiled.as_text()):
        out[kind][0] += 1
        out[kind][1] += _bytes_of(shape)
    return {k: (v[0], v[1]) for k, v in out.items()}


def plan(cfg: ModelConfig, topology: str, strategy: str = "tp", dtype: str = "bfloat16",
         max_model_len: int = 4096, max_num_seqs: int = 64,
         max_num_batched_tokens: int = 512, page_size: int = 16,
         quantization: str | None = None, kv_cache_dtype_name: str = "auto") -> dict:
    """Compile a decode and a prefill bucket for `topology` (TP over all its chips) and
    report per-chip memory, KV capacity, collectives and XLA's cost estimates.

    The step's shapes do not depend on the KV pool's size, so it compiles with a small
    nominal pool; the tokens of KV that fit come from the HBM left after weights and the
    largest bucket's temporaries. A bucket that XLA cannot fit is reported, not raised.
    """
    devices = tpu_devices(topology)
    chips = len(devices)
    generation = topology.split(":")[0]
    if generation not in HBM_GIB:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {sorted(HBM_GIB)}")
    hbm = HBM_GIB[generation] * 2**30
    jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    engine = EngineConfig(dtype=dtype, max_model_len=max_model_len, page_size=page_size,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          token_buckets=(max_num_seqs, max_num_batched_tokens),
                          quantization=quantization, kv_cache_dtype=kv_cache_dtype_name)
    num_pages = 2 * max_num_seqs  # nominal
    shard = model_sharding(make_mesh({"model": chips}, devices=devices), strategy, cfg)
    kv_split = chips if any(k == "kv_heads" for k, _ in shard.rules.table) else 1
    kv_per_token = kv_page_bytes(cfg, page_size, kv_cache_dtype(engine)) // page_size // kv_split
    nominal_kv = num_pages * page_size * kv_per_token
    buckets = {}
    for name, t in (("decode", max_num_seqs), ("prefill", max_num_batched_tokens)):
        key = (t, min(t, max_num_seqs), False)
        try:
            compiled = compile_step(cfg, engine, {"model": chips}, strategy, devices, num_pages,
                                    key, jdtype)
        except Exception as e:  # noqa: BLE001 - XLA reports "does not fit" as an error
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            buckets[name] = {"tokens": t, "error": str(e).splitlines()[0]}
            continue
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, list) else cost
        buckets[name] = {
            "tokens": t, "argument_bytes": mem.argument_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "collectives": collective_bytes(compiled),
            "flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        }
    analytic = _analytic_weight_bytes(cfg, jdtype, shard, model_options(engine))
    ok = [b for b in buckets.values() if "error" not in b]
    weights = ok[0]["argument_bytes"] - nominal_kv if ok else analytic
    temp = max((b["temp_bytes"] for b in ok), default=0)
    fit_tokens = max(0, (hbm - weights - temp) // kv_per_token)
    return {
        "model_params": cfg.num_params(), "topology": topology, "chips": chips,
        "strategy": strategy, "dtype": dtype, "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype_name, "hbm_bytes": hbm, "weight_bytes": weights,
        "analytic_weight_bytes": analytic, "kv_bytes_per_token": kv_per_token,
        "kv_heads_split": kv_split > 1, "temp_bytes": temp, "kv_tokens_that_fit": fit_tokens,
        "wanted_kv_tokens": max_num_seqs * max_model_len,
        "fits": len(ok) == len(buckets) and fit_tokens >= max_num_seqs * max_model_len,
        "buckets": buckets,
    }


def _analytic_weight_bytes(cfg: ModelConfig, dtype, shard: ShardingContext,
                           options: ModelOptions) -> int:
    """Parameters x bytes / shards, from each parameter's shard shape under the rules."""
    _, abstract = abstract_model(cfg, dtype, shard, options)
    total = 0
    for _, var in nnx.to_flat_state(abstract):
        shape = shard.sharding(var.get_metadata()["logical_axes"]).shard_shape(var.shape)
        total += math.prod(shape) * jnp.dtype(var.dtype).itemsize
    return total


def format_plan(p: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    kv_note = "" if p["kv_heads_split"] else " (KV heads replicated: fewer than chips)"
    rows = [
        ("model", f"{p['model_params'] / 1e9:.2f}B params, {p['dtype']}, weights "
                  f"{p['quantization'] or p['dtype']}, KV cache {p['kv_cache_dtype']}"),
        ("topology", f"{p['topology']} ({p['chips']} chips, {gib(p['hbm_bytes'])} HBM each), "
                     f"strategy {p['strategy']}"),
        ("weights per chip (compiled)", gib(p["weight_bytes"])),
        ("weights per chip (analytic)", f"{gib(p['analytic_weight_bytes'])} "
                                        f"(ratio {p['weight_bytes'] / p['analytic_weight_bytes']:.3f})"),
        ("KV cache per token per chip", f"{p['kv_bytes_per_token'] / 1024:.1f} KiB{kv_note}"),
        ("temporary memory (max bucket)", gib(p["temp_bytes"])),
        ("KV tokens that fit in the rest", f"{p['kv_tokens_that_fit']:,}"),
        ("fits max_num_seqs x max_model_len", f"{'yes' if p['fits'] else 'NO'} "
                                              f"({p['wanted_kv_tokens']:,} tokens wanted)"),
    ]
    for name, b in p["buckets"].items():
        if "error" in b:
            rows.append((f"{name} step, {b['tokens']} tokens", f"does not compile: {b['error']}"))
            continue
        coll = ", ".join(f"{k} x{c} ({v / 2**20:.1f} MiB)" for k, (c, v) in
                         sorted(b["collectives"].items())) or "none"
        rows.append((f"{name} step, {b['tokens']} tokens: collectives", coll))
        rows.append((f"{name} step: XLA cost estimate",
                     f"{b['flops'] / 1e12:.3f} TFLOP, {b['bytes_accessed'] / 2**30:.2f} GiB accessed"))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'per chip'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)
