"""Compile the real step for a device topology without weights, and read what it does.

`compile_step` lowers the engine's jitted step (sharded as it would run) on abstract
parameters, KV cache and batch, for any devices: real ones, or a TPU topology from
`jax.experimental.topologies` when libtpu is installed (so a CPU machine can compile for
a v5e/v6e slice). `collectives` counts the communication ops of the compiled program.

`plan` reports per-chip memory, KV capacity, collectives and cost for a TPU slice
('v5e:2x2') or a GPU node ('h100x8'). There is no GPU compiler here: a GPU target is
compiled by XLA:CPU on as many emulated CPU devices, with the GPU's memory for the fit;
weights and KV per device are exact (shapes and shardings), temporaries, collectives and
cost are CPU-compiled estimates. `plan_target` starts a child process with enough CPU
devices when this one has too few (JAX fixes the count at start). `sharding/plan_report.py`
presents one plan or several (tables, chart).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.config import (
    KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig, Gemma3VisionConfig, ModelConfig, ModelOptions)
from jaxserve.engine.batch import BatchBuilder, BucketKey
from jaxserve.engine.multimodal.images import DEFAULT_CACHED_IMAGES
from jaxserve.engine.kv_memory import abstract_kv_cache, kv_page_bytes, pages_per_seq
from jaxserve.engine.packing import pack
from jaxserve.engine.programs import jit_programs
from jaxserve.loading.safetensors import abstract_model
from jaxserve.models.lora import abstract_stacks, stacks_bytes
from sharding.layouts import kernel_format
from sharding.mesh import make_mesh
from sharding.platforms import allow_shared_libtpu
from sharding.rules import ShardingContext, model_sharding
from sharding.strategies import STRATEGIES

_COLLECTIVE = re.compile(
    r" (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")


def tpu_devices(topology: str) -> list:
    """The devices of a TPU topology such as 'v5e:2x2' (needs libtpu, not a TPU).

    libtpu's default host is 2x2 chips; a smaller slice (v5e:1x1, v6e:1x2) is one host of
    its own size."""
    from jax.experimental import topologies

    allow_shared_libtpu()  # an engine or another compile may hold libtpu meanwhile
    dims = [int(d) for d in topology.partition(":")[2].split("x") if d.isdigit()]
    kwargs = {}
    if dims and min(dims) < 2 and math.prod(dims) < 4:
        kwargs["chips_per_host_bounds"] = tuple(dims + [1] * (3 - len(dims)))
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs)
    except Exception as e:  # noqa: BLE001 - libtpu says what was wrong with the name
        raise ValueError(f"cannot compile for TPU topology {topology!r}: {str(e).splitlines()[0]} "
                         f"(write GENERATION:AxB such as v5e:2x2 or v6e:2x4; needs libtpu: "
                         f"pip install 'jax[tpu]=={jax.__version__}')") from e
    return list(desc.devices)


def compile_step(cfg: ModelConfig, engine: EngineConfig, mesh_shape: dict[str, int],
                 strategy: str, devices: list, num_pages: int, key: BucketKey,
                 scores: bool = False, pools: bool = False) -> jax.stages.Compiled:
    """Ahead-of-time compile of one step bucket, sharded over `devices`, with the engine's
    weight quantization, KV cache dtype and kernels (on a TPU: our Pallas kernels).
    `num_pages` is the KV pool of each data shard. `scores`: the bucket's program that
    also scores its tokens (prompt logprobs: programs.prompt_scores); `pools`: the one
    that also sums pool segments' hidden states (embeddings, classification)."""
    shard = model_sharding(make_mesh(mesh_shape, devices=devices), strategy, cfg)
    graphdef, abstract = abstract_model(cfg, jnp.dtype(engine.dtype), shard,
                                        engine.model_options)
    params = placed(abstract, shard)
    max_len = engine.max_model_len or cfg.max_position_embeddings
    builder = BatchBuilder(engine.token_buckets, engine.max_num_seqs, engine.page_size,
                           num_pages, pages_per_seq(max_len, engine.page_size), max_len,
                           cfg.eos_token_ids, cfg.vocab_size, shard.data_shards,
                           lora=engine.enable_lora, images=cfg.vision is not None,
                           mrope=bool(cfg.mrope_section),
                           whole_images=isinstance(cfg.vision, Gemma3VisionConfig))
    caches = abstract_kv_cache(cfg, num_pages * shard.data_shards, engine.page_size,
                               jnp.dtype(engine.kv_storage_dtype), shard)
    replicated = shard.sharding(())
    inputs = pack(dataclasses.replace(builder.empty(key), sampling=None, history=None))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         inputs)  # its two buffers (packing.py)
    # The forward pass: every weight, cache page, kernel and collective of the step (its
    # sampling is a small replicated program of its own); no heads, verifying.
    programs = jit_programs(graphdef, params, jax.tree.map(lambda x: x.sharding, caches),
                            shard, builder.layout, engine.page_size)
    fn = (programs.pool[False, True, scores] if pools else
          (programs.score if scores else programs.forward)[False, True])
    tokens = jax.ShapeDtypeStruct((key.tokens,), jnp.int32, sharding=replicated)
    targets = (tokens,) * scores + (tokens,) * pools  # (prompt scores' targets, segments)
    carry = jax.ShapeDtypeStruct((builder.layout.size,), jnp.int32, sharding=replicated)
    with no_persistent_cache(), jax.default_device(devices[0]):
        layers = sum(cfg.sparse_layers)
        load = (jax.ShapeDtypeStruct((layers, cfg.num_experts), jnp.int32, sharding=replicated)
                if layers else None)
        images = None  # the image encoder's buffer of embeddings (replicated)
        if cfg.vision is not None:
            images = jax.ShapeDtypeStruct(
                (encoder_rows(cfg, engine.max_num_batched_tokens), cfg.vision.text_hidden_size),
                jnp.dtype(engine.dtype), sharding=replicated)
        return fn.lower(jax.tree.leaves(params), caches, batch, carry, load, None, None,
                        lora_stacks(cfg, engine, shard), images,
                        *targets).compile()  # no Medusa, EAGLE


def lora_stacks(cfg: ModelConfig, engine: EngineConfig, shard: ShardingContext) -> list | None:
    """The LoRA adapters' device stacks (replicated, as the engine holds them), abstract;
    None without enable_lora."""
    if not engine.enable_lora:
        return None
    replicated = shard.sharding(())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                        abstract_stacks(cfg, engine.max_loras, engine.max_lora_rank,
                                        jnp.dtype(engine.dtype), shard.rules.kv_head_replicas))


def placed(abstract: nnx.State, shard: ShardingContext) -> nnx.State:
    """Abstract parameters with the shardings their logical axes get under `shard` (and
    the layouts the kernels take: layouts.kernel_format)."""
    flat = nnx.to_flat_state(abstract)
    for _, var in flat:
        where = kernel_format(var, shard.param_sharding(var))
        var.set_value(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=where))
    return nnx.from_flat_state(flat)


@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off inside the block: a program compiled for a
    topology this machine lacks cannot be loaded back from it (there is no client for it).
    JAX decides once per process whether the cache is used, so the decision is reset."""
    was_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was_on)
        compilation_cache.reset_cache()


def collectives(compiled: jax.stages.Compiled) -> dict[str, int]:
    return dict(collections.Counter(_COLLECTIVE.findall(compiled.as_text())))


# HBM per chip, GiB (public specifications).
HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95, "v6e": 32}
# Memory per GPU, GiB, from NVIDIA's public datasheets: H100 SXM 80 GB (HBM3), H200 SXM
# 141 GB (HBM3e), A100 SXM 80 GB (HBM2e). Those "GB" are close to GiB (nvidia-smi shows an
# H100 80GB as 81559 MiB); the CUDA context's few hundred MiB are not taken off.
GPU_HBM_GIB = {"h100": 80, "h200": 141, "a100": 80}
GPU_COUNTS = (1, 2, 4, 8)  # GPUs of one NVLink node
GPU_TARGETS = tuple(f"{g}x{n}" for g in GPU_HBM_GIB for n in GPU_COUNTS)
CPU_ESTIMATE = "(CPU-compiled estimate)"
_GPU_ATTENTION = ("reference (pure JAX: no Pallas TPU kernel on CPU, and the Pallas GPU "
                  "kernel is not compiled here)")


def gpu_target(name: str) -> tuple[str, int] | None:
    """'h100x8' -> ('h100', 8); None for a TPU topology (it has a ':'); unknown names raise."""
    if ":" in name:
        return None
    gpu, _, count = name.lower().partition("x")
    if gpu not in GPU_HBM_GIB or not count.isdigit() or int(count) not in GPU_COUNTS:
        raise ValueError(f"unknown target {name!r}: a GPU target is one of "
                         f"{', '.join(GPU_TARGETS)}; a TPU slice is GENERATION:AxB "
                         f"(e.g. v5e:2x2) and goes to --topology")
    return gpu, int(count)


def resolve_target(target: str) -> tuple[str, list, int]:
    """(platform, devices, HBM bytes per device) of a TPU topology or a GPU target.

    A GPU target's devices are this process's CPU devices: XLA:CPU compiles the step with
    the same shardings, which fixes weight and KV bytes per device exactly."""
    gpu = gpu_target(target)
    if gpu is None:
        generation = target.split(":")[0]
        if generation not in HBM_GIB:
            raise ValueError(f"unknown TPU generation {generation!r}; known: {sorted(HBM_GIB)}")
        return "tpu", tpu_devices(target), int(HBM_GIB[generation] * 2**30)
    name, count = gpu
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise ValueError(f"{target} compiles on {count} CPU devices and this process has "
                         f"{len(cpus)}: start it with JAX_PLATFORMS=cpu XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={count}, or call plan_target")
    return "gpu", cpus[:count], int(GPU_HBM_GIB[name] * 2**30)


# An HLO instruction's result shape (an array, or a tuple of them where XLA combined
# several collectives into one: "(bf16[64,2880]{...}, bf16[64,4,2880]{...})"), its kind
# and whether it starts an asynchronous one.
_COLLECTIVE_SHAPE = re.compile(
    r"= (.+?) (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
    r"(-start)?\(")
_ARRAY = re.compile(r"([a-z]+)(\d+)\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes of results per chip)} from a compiled program's HLO text."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for shape, kind, start in _COLLECTIVE_SHAPE.findall(hlo_text):
        arrays = _ARRAY.findall(shape)
        if start and kind in ("all-gather", "collective-permute"):
            arrays = arrays[1:2]  # (operand, result, ...): the result
        out[kind][0] += 1
        out[kind][1] += sum(math.prod(int(d) for d in dims.split(",") if d)
                            * max(int(bits), 8) // 8 for _, bits, dims in arrays)
    return {k: (v[0], v[1]) for k, v in out.items()}


_ENTRY_PARAM = re.compile(r"^\s*(%[\w.\-]+) = (?:bf16|f16)\[([\d,]*)\]\S* parameter\(", re.M)
_F32_OF_ONE = re.compile(r"^\s*%[\w.\-]+ = f32\[([\d,]*)\]\S* (?:fusion|convert)\((%[\w.\-]+)\)",
                         re.M)


def cpu_weight_upcast_bytes(hlo_text: str) -> int:
    """Bytes of the f32 copies XLA:CPU makes of 16-bit arguments (it has no bf16 matmul and
    converts every weight up front, all live at once): counted in its temporaries, though a
    GPU would not make them. Each is an entry-computation f32 value computed from one
    16-bit parameter alone, with as many elements."""
    start = hlo_text.find("\nENTRY")
    if start < 0:
        return 0
    entry = hlo_text[start:]
    size = lambda dims: math.prod(int(d) for d in dims.split(",") if d)  # noqa: E731
    params = {name: size(dims) for name, dims in _ENTRY_PARAM.findall(entry)}
    return sum(4 * size(dims) for dims, operand in _F32_OF_ONE.findall(entry)
               if params.get(operand) == size(dims))


def _remove_cpu_artefacts(bucket: dict, hlo_text: str) -> None:
    """Take out of an XLA:CPU bucket what a GPU would not do: the f32 weight copies (their
    bytes from the temporaries; each is written once, its bf16 source read once more and
    the dot reads 4 bytes an element instead of 2: twice its bytes from bytes accessed).
    The raw numbers stay, prefixed cpu_. (The sampler, whose top-p cumsum XLA:CPU's cost
    analysis counted as N^2 adds over the vocabulary, is not in the planned program.)"""
    upcast = cpu_weight_upcast_bytes(hlo_text)
    bucket.update(cpu_weight_upcast_bytes=upcast,
                  cpu_temp_bytes=bucket["temp_bytes"], cpu_flops=bucket["flops"],
                  cpu_bytes_accessed=bucket["bytes_accessed"],
                  temp_bytes=max(0, bucket["temp_bytes"] - upcast),
                  bytes_accessed=max(0.0, bucket["bytes_accessed"] - 2 * upcast))


def plan(cfg: ModelConfig, target: str, strategy: str = "tp", dtype: str = "bfloat16",
         max_model_len: int = 4096, max_num_seqs: int = 64,
         max_num_batched_tokens: int = 512, page_size: int = 16,
         quantization: str | None = None, kv_cache_dtype_name: str = "auto",
         data_parallel: int = 2, max_loras: int = 0, max_lora_rank: int = 16,
         quant_group_size: int | None = None, quant_zero_points: bool = False,
         quant_act_order: bool = False, lm_head_quantization: str | None = None,
         lm_head_group_size: int | None = None, lm_head_zero_points: bool = False,
         quant_overrides: tuple = (), embed_from_lm_head: bool = False) -> dict:
    """Compile a decode and a prefill bucket for `target` (a TPU topology such as 'v5e:4x4',
    or a GPU target such as 'h100x8', whose CPU devices this process must have; see
    `plan_target`), and report per-chip memory, KV capacity, collectives and XLA's cost
    estimates. The mesh: tp strategies put every chip on the `model` axis; dp alone every
    chip on `data`; the other dp strategies `data_parallel` groups of chips/data_parallel.

    The step's shapes do not depend on the KV pool's size, so it compiles with a small
    nominal pool; the tokens of KV that fit come from the HBM left after weights and the
    largest bucket's temporaries. A bucket that XLA cannot fit is reported, not raised.
    For a GPU target (platform 'gpu') weights and KV per device are exact; temporaries,
    collectives and cost come from XLA:CPU, less its own artefacts, and are estimates.
    `max_loras` > 0: the step carries that many LoRA adapter slots of `max_lora_rank`
    (replicated on every chip; `lora_bytes`), which the KV cache does without.
    `quant_group_size` / `quant_zero_points` / `quant_act_order`: integer weights as a
    checkpoint stores them (AWQ, GPTQ, compressed-tensors, GGUF), `quant_overrides` the
    layers a GGUF file holds in other formats; `lm_head_*`: the LM head quantized,
    `embed_from_lm_head` a tied one read by lookups too (EngineConfig's fields).
    """
    platform, devices, hbm = resolve_target(target)
    chips = len(devices)
    engine = EngineConfig(dtype=dtype, max_model_len=max_model_len, page_size=page_size,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          token_buckets=(max_num_seqs, max_num_batched_tokens),
                          quantization=quantization, kv_cache_dtype=kv_cache_dtype_name,
                          quant_group_size=quant_group_size,
                          quant_zero_points=quant_zero_points,
                          quant_act_order=quant_act_order,
                          lm_head_quantization=lm_head_quantization,
                          lm_head_group_size=lm_head_group_size,
                          lm_head_zero_points=lm_head_zero_points,
                          quant_overrides=quant_overrides,
                          embed_from_lm_head=embed_from_lm_head, enable_lora=max_loras > 0,
                          max_loras=max(max_loras, 1),
                          max_lora_rank=max_lora_rank)
    data = chips if strategy == "dp" else data_parallel if strategy.startswith("dp") else 1
    if data < 1 or chips % data or max_num_seqs % data or max_num_batched_tokens % data:
        raise ValueError(f"{data} data-parallel groups must divide the {chips} chips, "
                         f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                         f"({max_num_batched_tokens})")
    mesh_shape = {"data": data, "model": chips // data}
    num_pages = 2 * max_num_seqs // data  # nominal, per data shard
    shard = model_sharding(make_mesh(mesh_shape, devices=devices), strategy, cfg)
    kv_dtype = jnp.dtype(engine.kv_storage_dtype)
    kv_per_token = kv_page_bytes(cfg, page_size, kv_dtype, shard) // page_size
    nominal_kv = num_pages * page_size * kv_per_token
    buckets = {name: _compile_bucket(cfg, engine, mesh_shape, strategy, devices, num_pages,
                                     t, platform)
               for name, t in (("decode", max_num_seqs), ("prefill", max_num_batched_tokens))}
    tpu_kernels = max((b.pop("tpu_kernels", 0) for b in buckets.values()), default=0)
    analytic = _analytic_weight_bytes(cfg, jnp.dtype(dtype), shard, engine.model_options)
    ok = [b for b in buckets.values() if "error" not in b]
    lora = stacks_bytes(lora_stacks(cfg, engine, shard))  # on every chip
    # The step's arguments: weights, the nominal KV pool, LoRA stacks, the image buffer.
    buffer = (encoder_rows(cfg, max_num_batched_tokens) * cfg.vision.text_hidden_size
              * jnp.dtype(dtype).itemsize if cfg.vision is not None else 0)
    compiled_weights = ok[0]["argument_bytes"] - nominal_kv - lora - buffer if ok else None
    # On a TPU the compiled size is the truth (it includes tile padding); XLA:CPU's layout
    # says nothing about a GPU's, so there the shapes and shardings are.
    weights = compiled_weights if platform == "tpu" and ok else analytic
    temp = max((b["temp_bytes"] for b in ok), default=0)
    vision = vision_bytes(cfg, jnp.dtype(dtype), max_num_batched_tokens)
    fit_tokens = max(0, (hbm - weights - lora - vision - temp) // kv_per_token)  # per shard
    wanted = max_num_seqs // data * max_model_len
    return {
        "model_params": cfg.num_params(), "target": target, "platform": platform,
        "chips": chips, "strategy": strategy, "dtype": dtype, "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype_name, "hbm_bytes": hbm, "weight_bytes": weights,
        "compiled_weight_bytes": compiled_weights, "analytic_weight_bytes": analytic,
        "mesh": mesh_shape, "kv_bytes_per_token": kv_per_token,
        "kv_heads_per_chip": kv_heads_per_chip(cfg, shard),
        "temp_bytes": temp, "kv_tokens_that_fit": fit_tokens, "lora_bytes": lora,
        "max_loras": max_loras, "max_lora_rank": max_lora_rank,
        "vision_params": cfg.vision.num_params() if cfg.vision is not None else 0,
        "vision_bytes": vision,
        "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
        "wanted_kv_tokens": wanted,
        "fits": len(ok) == len(buckets) and fit_tokens >= wanted,
        "attention": _kernels_used(platform, tpu_kernels, quantization, max_loras > 0),
        "buckets": buckets,
    }


def encoder_rows(cfg: ModelConfig, max_num_batched_tokens: int) -> int:
    """The encoder cache's default rows (multimodal/images.py): DEFAULT_CACHED_IMAGES of
    the largest image (LLaVA's and Gemma 3's fixed count, Qwen2.5-VL's at its processor's
    default max_pixels, 1280 tokens), at least a step's tokens."""
    most = getattr(cfg.vision, "tokens_per_image", 1280)
    return max(max_num_batched_tokens, DEFAULT_CACHED_IMAGES * most)


def vision_bytes(cfg: ModelConfig, dtype, max_num_batched_tokens: int) -> int:
    """A vision-language model's image side on every chip (replicated): its tower and
    projector, and the encoder cache's default rows."""
    if cfg.vision is None:
        return 0
    rows = encoder_rows(cfg, max_num_batched_tokens)
    return (cfg.vision.num_params() + rows * cfg.vision.text_hidden_size) * dtype.itemsize


def _kernels_used(platform: str, tpu_kernels: int, quantization: str | None,
                  lora: bool = False) -> str:
    if platform == "gpu":
        return _GPU_ATTENTION
    if tpu_kernels:
        what = ["attention"] + ["quantized matmuls"] * bool(quantization) + [
            "LoRA deltas' grouped matmuls"] * lora
        return (f"Pallas TPU kernels ({tpu_kernels} Mosaic calls per step, per chip: "
                f"{', '.join(what)})")
    return "reference (pure JAX, partitioned by XLA)"


def _compile_bucket(cfg: ModelConfig, engine: EngineConfig, mesh_shape: dict[str, int],
                    strategy: str, devices: list, num_pages: int, tokens: int,
                    platform: str) -> dict:
    """One bucket of `tokens` compiled: its memory, collectives, XLA's cost estimates and
    its Mosaic kernel calls (`tpu_kernels`); or, where XLA cannot fit it, why."""
    key = BucketKey(tokens, min(tokens, engine.max_num_seqs), False)
    try:
        compiled = compile_step(cfg, engine, mesh_shape, strategy, devices, num_pages, key)
    except Exception as e:  # noqa: BLE001 - XLA reports "does not fit" as an error
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"tokens": tokens, "error": str(e).splitlines()[0]}
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    bucket = {
        "tokens": tokens, "argument_bytes": mem.argument_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
        "collectives": collective_bytes(text),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "tpu_kernels": text.count('custom_call_target="tpu_custom_call"'),
    }
    if platform == "gpu":
        _remove_cpu_artefacts(bucket, text)
    return bucket


def kv_heads_per_chip(cfg: ModelConfig, shard: ShardingContext) -> int:
    """KV heads each chip stores: split, one per chip (heads copied where fewer than
    chips), or all of them (replicated)."""
    heads = cfg.num_kv_heads * shard.rules.kv_head_replicas
    return heads // shard.axis_size(shard.rules.spec(("cache_heads",))[0])


def _analytic_weight_bytes(cfg: ModelConfig, dtype, shard: ShardingContext,
                           options: ModelOptions) -> int:
    """Parameters x bytes / shards, from each parameter's shard shape under the rules."""
    _, abstract = abstract_model(cfg, dtype, shard, options)
    total = 0
    for _, var in nnx.to_flat_state(abstract):
        shape = shard.param_sharding(var).shard_shape(var.shape)
        total += math.prod(shape) * jnp.dtype(var.dtype).itemsize
    return total


def plan_target(cfg: ModelConfig, target: str, **kwargs) -> dict:
    """`plan(cfg, target, **kwargs)`, in a child process with enough CPU devices when the
    target is N GPUs and this process has fewer than N (JAX fixes the count at start)."""
    gpu = gpu_target(target)
    if gpu is None or len(jax.devices("cpu")) >= gpu[1]:
        return plan(cfg, target, **kwargs)
    return _plan_in_child(cfg, target, gpu[1], kwargs)


def _plan_in_child(cfg: ModelConfig, target: str, devices: int, kwargs: dict) -> dict:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="jaxserve-plan-") as tmp:
        job, result = Path(tmp) / "job.pkl", Path(tmp) / "result.pkl"
        job.write_bytes(pickle.dumps((cfg, target, kwargs)))
        code = ("import sys; from sharding.planner import _child_main; "
                "sys.exit(_child_main(sys.argv[1:]))")
        proc = subprocess.run([sys.executable, "-c", code, str(job), str(result)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"planning {target} on {devices} CPU devices failed in a child "
                               f"process (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        out = pickle.loads(result.read_bytes())
    if isinstance(out, ValueError):
        raise out
    return out


def _child_main(argv: list[str]) -> int:
    """Run one plan from a pickled (cfg, target, kwargs) job; the result (or the ValueError
    that says what was wrong with the input) is pickled back."""
    job, result = argv
    cfg, target, kwargs = pickle.loads(Path(job).read_bytes())
    try:
        out = plan(cfg, target, **kwargs)
    except ValueError as e:
        out = ValueError(str(e))
    Path(result).write_bytes(pickle.dumps(out))
    return 0


def parse_compare(spec: str, strategy: str = "tp", quantization: str | None = None,
                  kv_cache_dtype_name: str = "auto") -> list[dict]:
    """'v5e:2x2/tp,v5e:2x4/tp+sp/int8,h100x8' -> one dict of plan() arguments per entry.

    An entry is TARGET[/STRATEGY[/WEIGHTS[/KV]]]: WEIGHTS is a quantization or 'none', KV a
    KV cache dtype; fields left out take the values given here (the command's flags)."""
    configs = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        target, *fields = entry.split("/")
        if len(fields) > 3 or not target:
            raise ValueError(f"--compare entry {entry!r}: write TARGET[/STRATEGY[/WEIGHTS[/KV]]], "
                             f"e.g. v5e:2x2/tp or h100x8/tp/int8/int8")
        s, q, kv = (fields + [strategy, quantization or "none", kv_cache_dtype_name][len(fields):])
        if s not in STRATEGIES:
            raise ValueError(f"--compare entry {entry!r}: strategy {s!r} is unknown; choose "
                             f"one of {STRATEGIES}")
        if q not in ("none", *QUANTIZATIONS):
            raise ValueError(f"--compare entry {entry!r}: weights {q!r} are unknown; choose "
                             f"none or one of {QUANTIZATIONS}")
        if kv not in KV_CACHE_DTYPES:
            raise ValueError(f"--compare entry {entry!r}: KV cache dtype {kv!r} is unknown; "
                             f"choose one of {tuple(KV_CACHE_DTYPES)}")
        gpu_target(target)  # an unknown GPU name fails now, not after the others compiled
        configs.append({"target": target, "strategy": s,
                        "quantization": None if q == "none" else q, "kv_cache_dtype_name": kv})
    if not configs:
        raise ValueError("--compare needs at least one TARGET[/STRATEGY[/WEIGHTS[/KV]]] entry")
    return configs
